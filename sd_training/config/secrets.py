"""Secrets in config dumps: what ``config.yaml``, every checkpoint's copy and the trackers' run config hold
instead of a token.

Two rules, applied to every dump (``loading.public_dict``):

- **Values read from the environment stay unresolved.** A value that came through ``${oc.env:NAME}``
  (directly, or through an interpolation of such a key) is written as the interpolation text, e.g.
  ``pipe:curl -H "Authorization: Bearer ${oc.env:HF_TOKEN}" https://...``: the dump re-reads the variable
  when it is loaded again, and no token is written. (``EnvView`` records, at load, which keys those are.)
- **Literal secrets are redacted by pattern** (``redact_text``): an ``Authorization:`` header's credentials,
  ``Bearer <token>``, ``X-Api-Key:``-style headers, ``user:password@`` in URLs, ``?token=``/``&sig=``-style
  query parameters, ``curl -u user:pass``, well-known token shapes (``hf_...``, ``ghp_...``, ``sk-...``,
  ``AKIA...``), and every string value of a key named like a secret (``api_key``, ``*_token``,
  ``password``, ``secret*``, ``credentials``). They become ``<redacted>``.

A resume compares the checkpoint's dump with this run's (``same_value``): a redacted part or an
environment interpolation matches anything, so a rotated token or another machine's variables never
refuse a resume, while every other character of the value is still compared.

Beyond the dumps: every log record of a process that loaded a config is scrubbed when it is made
(``protect_logs``: the environment values the config read become their interpolation, credentials are
redacted), so a skipped shard's command line reaches train.log without its token; wandb, which records
the command line, sees the arguments scrubbed (``scrub_argument``). Every script's output (its prints,
tracebacks and logs) is scrubbed the same way (``scrub_script_output``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

REDACTED = "<redacted>"

# A credential: anything up to a space, quote, comma or semicolon; never an interpolation (kept as written).
_CRED = r"(?!\$\{)[^\s\"',;]+"
_PATTERNS = [
    # Authorization: Bearer <token> / Basic <b64> / token <t> (the scheme is kept).
    (re.compile(r"(?i)(\bauthorization\s*[:=]\s*(?:(?:bearer|basic|token|digest|negotiate)\s+)?)"
                r"(?!(?:bearer|basic|token|digest|negotiate)\s)" + _CRED), r"\1" + REDACTED),
    (re.compile(r"(?i)(\bbearer\s+)" + _CRED), r"\1" + REDACTED),
    # Other credential headers: X-Api-Key: ..., Private-Token: ..., X-Auth-Token: ..., Cookie: ...
    (re.compile(r"(?i)(\b[\w-]*(?:api[-_]?key|token|secret|password|cookie)\s*:\s*)" + _CRED), r"\1" + REDACTED),
    # curl -u user:pass / --user user:pass
    (re.compile(r"((?:^|\s)(?:-u|--user)\s+['\"]?)(?!\$\{)[^\s\"',;:]+:(?!\$\{)[^\s\"',;]+"), r"\1" + REDACTED),
    # Query parameters: ?token=..., &access_key=..., &sig=..., &X-Amz-Signature=..., &password=...
    (re.compile(r"(?i)([?&;](?:[\w.-]*[_.-])?(?:token|api_?key|key|secret|password|passwd|signature|sig|auth|"
                r"credential|session)=)(?!\$\{)[^&\s\"'#]+"), r"\1" + REDACTED),
    # Well-known token shapes.
    (re.compile(r"\b(?:hf|ghp|gho|ghu|ghs|ghr|github_pat|glpat|xox[abpr])[-_][A-Za-z0-9_-]{16,}"), REDACTED),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{16,}"), REDACTED),
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), REDACTED),
]
# scheme://userinfo@host: the userinfo goes (unless it is only an interpolation).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^/\s@\"']+)@")
# Key names whose string values are secrets (the last part of the key, lower case).
_SECRET_KEY = re.compile(r"(?:^|[_-])(?:api_?key|access_?key|private_?key|secret\w*|\w*token|password|passwd|"
                         r"credentials?|authorization|auth|cookie)$", re.I)
_ENV_INTERPOLATION = re.compile(r"(?<!\\)\$\{oc\.env:")
_ENV_NAME = re.compile(r"\$\{oc\.env:\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)")
# An environment value shorter than this (or a path) is not searched for in other values: too likely to
# occur by chance ("1", "offline", "/scratch").
_MIN_SEARCHED = 8


def interpolations(text: str) -> list[tuple[int, int]]:
    """(start, end) of every top-level ``${...}`` in ``text`` (nested braces included)."""
    out, i = [], 0
    while True:
        start = text.find("${", i)
        if start < 0:
            return out
        if start > 0 and text[start - 1] == "\\":
            i = start + 2
            continue
        depth, j = 0, start + 1
        while j < len(text):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        out.append((start, j + 1))
        i = j + 1


def _outside_interpolations(text: str, fn) -> str:
    """``fn`` applied to the parts of ``text`` outside ``${...}``; the interpolations kept as written."""
    spans = interpolations(text)
    if not spans:
        return fn(text)
    out, last = [], 0
    for a, b in spans:
        out += [fn(text[last:a]), text[a:b]]
        last = b
    out.append(fn(text[last:]))
    return "".join(out)


def _redact_plain(text: str) -> str:
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)

    def userinfo(m: re.Match) -> str:
        keep = m.group(2) == REDACTED or "${" in m.group(2)
        return m.group(0) if keep else f"{m.group(1)}{REDACTED}@"

    return _USERINFO.sub(userinfo, text)


def redact_text(text: str) -> str:
    """``text`` with literal credentials replaced by ``<redacted>``; ``${...}`` interpolations kept (an
    ``${oc.env:NAME,default}`` whose variable names a secret loses its literal default)."""
    if not text or not isinstance(text, str):
        return text
    spans = interpolations(text)
    if not spans:
        return _redact_plain(text)
    # Patterns that span an interpolation (Authorization: Bearer ${oc.env:T}) must see the whole text:
    # each interpolation becomes a placeholder starting with '${', where no credential pattern starts.
    kept, masked, last = [], [], 0
    for n, (a, b) in enumerate(spans):
        kept.append(_redact_default(text[a:b]))
        masked += [text[last:a], f"${{{n}}}"]
        last = b
    masked.append(text[last:])
    out = _redact_plain("".join(masked))
    for n, value in enumerate(kept):
        out = out.replace(f"${{{n}}}", value, 1)
    return out


def _redact_default(interpolation: str) -> str:
    m = re.fullmatch(r"\$\{oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)\s*,(.*)\}", interpolation, re.S)
    if m and is_secret_key(m.group(1)) and m.group(2).strip() and not only_interpolations(m.group(2).strip()):
        return "${oc.env:" + m.group(1) + "," + REDACTED + "}"
    return interpolation


def only_interpolations(text: Any) -> bool:
    """``text`` is made of ``${...}`` interpolations (and spaces) only: nothing literal to redact."""
    if not isinstance(text, str) or "${" not in text:
        return False
    rest, last = [], 0
    for a, b in interpolations(text):
        rest.append(text[last:a])
        last = b
    rest.append(text[last:])
    return not "".join(rest).strip()


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(str(key)))


def redact_tree(node: Any, key: str = "") -> Any:
    """Plain containers with every secret redacted: string values of secret-named keys, and credentials
    inside any string (``redact_text``)."""
    if isinstance(node, dict):
        return {k: redact_tree(v, str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [redact_tree(v, key) for v in node]
    if isinstance(node, str):
        if node and is_secret_key(key) and not only_interpolations(node):
            return REDACTED
        return redact_text(node)
    return node


# ----------------------------------------------------------------------------------------------
# Values read from the environment.
# ----------------------------------------------------------------------------------------------


def escape_env(node: Any) -> Any:
    """A raw (unresolved) config tree whose ``${oc.env:...}`` are escaped, so resolving it gives their text."""
    if isinstance(node, dict):
        return {k: escape_env(v) for k, v in node.items()}
    if isinstance(node, list):
        return [escape_env(v) for v in node]
    if isinstance(node, str):
        return _ENV_INTERPOLATION.sub(r"\\${oc.env:", node)
    return node


def env_names(node: Any) -> set[str]:
    """Names of the environment variables a raw config tree reads."""
    if isinstance(node, dict):
        return set().union(*(env_names(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(env_names(v) for v in node)) if node else set()
    return set(_ENV_NAME.findall(node)) if isinstance(node, str) else set()


@dataclass
class EnvView:
    """What the dump writes instead of the values that came from the environment, recorded at load.

    ``paths``: key path (a tuple of keys and list indices) -> (the value at load, the value with its
    environment interpolations unresolved). ``values``: variable name -> its value at load, searched for
    in every dumped string as a last resort (a value copied to another key after load)."""

    paths: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)

    @classmethod
    def record(cls, raw: Any, resolved: Any, unresolved: Any, typed: Any) -> "EnvView":
        """``raw``: the config tree before resolution; ``resolved`` / ``unresolved``: it resolved as is and
        with its environment interpolations escaped; ``typed``: the values the run uses."""
        view = cls()
        view._walk((), resolved, unresolved, typed)
        for name in sorted(env_names(raw)):
            value = os.environ.get(name)
            if value and len(value) >= _MIN_SEARCHED and not os.path.isabs(value):
                view.values[name] = value
        return view

    def _walk(self, path: tuple, resolved: Any, unresolved: Any, typed: Any) -> None:
        if resolved == unresolved:
            return
        if isinstance(resolved, dict) and isinstance(unresolved, dict) and isinstance(typed, dict):
            for k in resolved:
                if k in unresolved and k in typed:
                    self._walk(path + (k,), resolved[k], unresolved[k], typed[k])
            return
        if (isinstance(resolved, list) and isinstance(unresolved, list) and isinstance(typed, list)
                and len(resolved) == len(unresolved) == len(typed)):
            for i, (a, b, c) in enumerate(zip(resolved, unresolved, typed)):
                self._walk(path + (i,), a, b, c)
            return
        self.paths[path] = (typed, unresolved)

    def apply(self, tree: dict) -> dict:
        """``tree`` (the config as the run holds it now, plain containers) with the environment's values
        replaced by their interpolations; a value changed since load is left to the last-resort search."""
        for path, (at_load, text) in self.paths.items():
            parent = tree
            try:
                for k in path[:-1]:
                    parent = parent[k]
                if path and parent[path[-1]] == at_load:
                    parent[path[-1]] = text
            except (KeyError, IndexError, TypeError):
                continue
        return _replace_values(tree, self.values) if self.values else tree


def _replace_values(node: Any, values: dict) -> Any:
    if isinstance(node, dict):
        return {k: _replace_values(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_replace_values(v, values) for v in node]
    if isinstance(node, str):
        for name, value in values.items():
            if value in node:
                node = node.replace(value, "${oc.env:" + name + "}")
    return node


# ----------------------------------------------------------------------------------------------
# Comparing a dump with another (resume).
# ----------------------------------------------------------------------------------------------


def _wildcard(text: str) -> re.Pattern:
    """``text`` as a pattern where each ``${...}`` and each ``<redacted>`` matches anything."""
    parts, last = [], 0
    for a, b in interpolations(text):
        parts += [text[last:a], None]
        last = b
    parts.append(text[last:])
    out = []
    for p in parts:
        if p is None:
            out.append(".*")
        else:
            out.append(".*".join(re.escape(s) for s in p.split(REDACTED)))
    return re.compile("".join(out), re.S)


def same_value(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same setting, a secret or an environment value aside (see the module doc)."""
    if a == b or REDACTED in (a, b) or only_interpolations(a) or only_interpolations(b):
        return True
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    ra, rb = redact_text(a), redact_text(b)
    if ra == rb:
        return True
    wild_a = "${" in ra or REDACTED in ra
    wild_b = "${" in rb or REDACTED in rb
    return bool((wild_a and _wildcard(ra).fullmatch(rb)) or (wild_b and _wildcard(rb).fullmatch(ra)))


# ----------------------------------------------------------------------------------------------
# Log lines and command lines.
# ----------------------------------------------------------------------------------------------

_LOG_VALUES: dict[str, str] = {}  # variable name -> value, of every config loaded in this process
_LOG_FACTORY: list = []  # the record factory installed (once)


def scrub(text: str) -> str:
    """A log line or a message as it may be written: the values of the environment variables the loaded
    configs read replaced by their ``${oc.env:NAME}``, literal credentials redacted."""
    for name, value in _LOG_VALUES.items():
        if value in text:
            text = text.replace(value, "${oc.env:" + name + "}")
    return redact_text(text)


def protect_logs(values: dict[str, str]) -> None:
    """From now on every log record of this process (and of the processes it forks) is scrubbed
    (``scrub``) when it is made: a shard URL holding a token, logged by a reader that skipped it, reaches
    train.log and the console without the token. ``values``: variable name -> value to hide."""
    _LOG_VALUES.update(values)
    if _LOG_FACTORY:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
            clean = scrub(message)
            if clean != message:
                record.msg, record.args = clean, None
            if record.exc_info and record.exc_info[1] is not None:
                text = logging.Formatter().formatException(record.exc_info)
                clean = scrub(text)
                if clean != text:
                    record.exc_text = clean
        except Exception:  # noqa: BLE001 -- a record that does not format is the handler's to report
            pass
        return record

    logging.setLogRecordFactory(factory)
    _LOG_FACTORY.append(factory)


def scrub_argument(arg: str) -> str:
    """A command-line argument as a tracker may record it: ``key=value`` with a secret-named key loses
    its value; credentials inside any argument are redacted (``scrub``)."""
    key, sep, value = arg.partition("=")
    if sep and is_secret_key(key.rsplit(".", 1)[-1]) and value and not only_interpolations(value):
        return f"{key}={REDACTED}"
    return scrub(arg)


class _ScrubbedStream:
    """A text stream whose lines are scrubbed (``scrub``) before they reach ``raw``: a line is written when
    it is complete (a URL is never cut in two), the rest on ``flush`` (the interpreter flushes at exit)."""

    _MAX_PENDING = 1 << 16  # a line longer than this is written in pieces

    def __init__(self, raw):
        self._raw, self._pending = raw, ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending or len(self._pending) > self._MAX_PENDING:
            done, sep, self._pending = self._pending.rpartition("\n")
            if not sep:
                done, self._pending = self._pending, ""
            self._raw.write(scrub(done + sep))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, ""
            self._raw.write(scrub(pending))
        self._raw.flush()

    def __getattr__(self, name):  # encoding, fileno, isatty, buffer...: the real stream's
        return getattr(self._raw, name)


def scrub_script_output() -> None:
    """A script's whole output scrubbed as the logs are: ``sys.stdout`` and ``sys.stderr`` (prints,
    argparse's and SystemExit's messages, tracebacks) and every log record (``protect_logs``), so a URL
    with ``user:password`` (an ``HF_ENDPOINT``, a shard URL) or a token never reaches the terminal. Called
    first thing by every script under ``scripts/``; calling it twice is harmless."""
    import sys

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _ScrubbedStream):
            setattr(sys, name, _ScrubbedStream(stream))
    protect_logs({})
