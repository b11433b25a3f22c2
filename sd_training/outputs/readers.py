"""Bounded readers of the YAML and JSON files in a run folder (``config.yaml``, ``metrics.jsonl``, eval
results, index files), for the report, the model card, the scripts and the evaluation.

A run folder may be copied from elsewhere, or edited: what it holds is read with bounds on the work it
can ask for. YAML: no anchors or aliases (a file the run wrote has none; a "billion laughs" of nested
aliases grew the report to 22.8 GB), nesting at most :data:`MAX_DEPTH`, at most :data:`MAX_YAML_BYTES`.
JSON: nesting at most :data:`MAX_DEPTH` (deeper raises RecursionError in the parser), lines of
``metrics.jsonl`` at most :data:`MAX_LINE_BYTES`. :func:`read_jsonl` skips a bad line and counts it, naming
the first few line numbers, instead of stopping the whole read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

MAX_DEPTH = 64  # lists / mappings inside each other: a config is ~4 deep, a metrics row 1
MAX_YAML_BYTES = 16 * 2**20  # a config.yaml is a few KB
MAX_JSON_BYTES = 64 * 2**20  # one JSON file read whole (an eval result, an index)
MAX_LINE_BYTES = 2**20  # one metrics.jsonl row is under 4 KB
NAMED_LINES = 5  # line numbers a warning names


class UnsafeFile(ValueError):
    """A run-folder file that asks for more work than its kind ever needs (aliases, deep nesting, size)."""


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader refusing anchors, aliases and nesting beyond MAX_DEPTH while composing."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.MarkedYAMLError(None, None, "holds a YAML anchor or alias (&name / *name), which a "
                                       "config.yaml written by a run never does", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.MarkedYAMLError(None, None, f"nests lists/mappings over {MAX_DEPTH} deep",
                                           event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str, what: str):
    """YAML ``text`` (from ``what``, named in errors) without aliases and deep nesting; UnsafeFile if it
    has them or is over :data:`MAX_YAML_BYTES`, yaml.YAMLError if it is not YAML."""
    if len(text) > MAX_YAML_BYTES:
        raise UnsafeFile(f"{what} holds {len(text):,} characters, over the {MAX_YAML_BYTES:,} a config ever needs")
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 -- a SafeLoader
    except yaml.MarkedYAMLError as e:
        if e.problem and ("anchor or alias" in e.problem or "nests" in e.problem):
            mark = e.problem_mark
            raise UnsafeFile(f"{what}, line {mark.line + 1 if mark else '?'}: {e.problem}; not read") from None
        raise


def read_yaml(path: str | Path):
    """:func:`load_yaml` of the file at ``path``, read no further than its bound."""
    path = Path(path)
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read(MAX_YAML_BYTES + 1)
    return load_yaml(text, str(path))


def too_deep(text: str | bytes, bound: int = MAX_DEPTH) -> bool:
    """Whether JSON ``text`` nests arrays/objects over ``bound`` deep (brackets inside strings ignored).
    Counted in C first: a line with fewer opening brackets than the bound cannot be deeper."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if text.count("[") + text.count("{") <= bound:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > bound:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def loads(text: str | bytes, what: str = "JSON"):
    """``json.loads`` refusing nesting over :data:`MAX_DEPTH` (UnsafeFile); ValueError when not JSON."""
    if too_deep(text):
        raise UnsafeFile(f"{what} nests arrays/objects over {MAX_DEPTH} deep: not read")
    try:
        return json.loads(text)
    except RecursionError:  # not reached after too_deep; kept so no reader ever sees one
        raise UnsafeFile(f"{what} nests too deep: not read") from None


def read_json(path: str | Path):
    """:func:`loads` of a whole JSON file, refused (UnsafeFile) over :data:`MAX_JSON_BYTES`."""
    path = Path(path)
    with open(path, "rb") as fh:
        raw = fh.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise UnsafeFile(f"{path} is over {MAX_JSON_BYTES:,} bytes: not read")
    return loads(raw, str(path))


@dataclass
class Skipped:
    """The lines :func:`read_jsonl` skipped, by reason, with their first line numbers."""

    path: Path
    lines: dict[str, list[int]] = field(default_factory=dict)  # reason -> line numbers (the first few)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str, n: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        named = self.lines.setdefault(reason, [])
        if len(named) < NAMED_LINES:
            named.append(n)

    def warn(self) -> None:
        """One warning per reason: how many lines, and the first line numbers."""
        for reason, count in self.counts.items():
            shown = ",".join(map(str, self.lines[reason])) + (",..." if count > len(self.lines[reason]) else "")
            log.warning("%s:%s %s: skipped (%d line%s)", self.path, shown, reason, count, "s" * (count > 1))


def read_jsonl(path: str | Path, skipped: Skipped | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, row) of every JSON object line of ``path``; a line that is cut, not JSON, not an object,
    nested over :data:`MAX_DEPTH` or over :data:`MAX_LINE_BYTES` is skipped and recorded in ``skipped``."""
    skipped = skipped if skipped is not None else Skipped(Path(path))
    with open(path, "rb") as fh:
        n = 0
        while True:
            raw = fh.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            n += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # the rest of the long line, a bounded piece at a time
                    raw = fh.readline(MAX_LINE_BYTES)
                skipped.add(f"is over {MAX_LINE_BYTES:,} bytes", n)
                continue
            raw = raw.strip()
            if not raw:
                continue
            try:
                row = loads(raw)
            except UnsafeFile:
                skipped.add(f"nests arrays/objects over {MAX_DEPTH} deep", n)
                continue
            except ValueError:
                skipped.add("is not JSON (a line cut by a kill?)", n)
                continue
            if not isinstance(row, dict):
                skipped.add("is not a JSON object", n)
                continue
            yield n, row
