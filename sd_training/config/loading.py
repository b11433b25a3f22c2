"""Loading a config: the command line and YAML layers merged onto the schema, ``~key`` removals,
interpolations resolved, then the schema-level rules (``rules.validate``); ``--help`` and the dump.

Precedence is schema defaults < YAML (``config=path.yaml``, repeatable) < ``key.sub=value`` on the
command line; ``~key.sub`` drops a key the YAML layers set, so the schema default applies. Unknown
keys and wrong types fail at start-up with the key's full path and the closest valid key.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sys
from dataclasses import fields, is_dataclass
from typing import Any, get_type_hints

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from . import secrets
from .fields import ConfigError
from .rules import validate
from .schema import TrainConfig, is_free_dict, schema_entries, train_config_class, unwrap_optional

# Files that ship inside the package (sd_training/assets/NAME): a config names them ${asset:NAME}, which
# resolves to an absolute path wherever the package is installed and whatever the working directory.
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")

USAGE = "usage: python train.py config=path/to/run.yaml [key.sub=value ...] [~key.sub ...]"


def _asset(name: str) -> str:
    path = os.path.join(ASSETS, str(name))
    if not os.path.exists(path):
        raise ConfigError(f"${{asset:{name}}}: no such file or folder in {ASSETS} "
                          f"(shipped: {', '.join(sorted(os.listdir(ASSETS))) if os.path.isdir(ASSETS) else 'none'})")
    return path


# omegaconf 2.4 renamed register_new_resolver (which it deprecates) to register_resolver.
(getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver)("asset", _asset, replace=True)


# ----------------------------------------------------------------------------------------------
# Keys: suggestions, YAML's booleans, unknown keys.
# ----------------------------------------------------------------------------------------------


def _all_paths() -> list[str]:
    return [p for p, *_ in schema_entries()]


def _suggest(bad_path: str) -> str:
    paths = _all_paths()
    # Same leaf in another section first ("experiment.batch_size" -> "system.batch_size"), then spelling.
    leaf = bad_path.rsplit(".", 1)[-1]
    same_leaf = [p for p in paths if p.rsplit(".", 1)[-1] == leaf]
    close = same_leaf or difflib.get_close_matches(bad_path, paths, n=1, cutoff=0.6)
    if not close:
        close = [p for p in paths if p.rsplit(".", 1)[-1] in difflib.get_close_matches(leaf, [q.rsplit(".", 1)[-1] for q in paths], n=1)]
    return f"; did you mean '{close[0]}'?" if close else ""


def _str_fields() -> frozenset[str]:
    """The schema's string keys (registered owners' included: read when a config is parsed, not at import)."""
    return _str_fields_of(train_config_class())


@functools.cache
def _str_fields_of(cls) -> frozenset[str]:
    return frozenset(path for path, tp, _d, _m, is_section in schema_entries(cls) if not is_section and tp is str)


def _unbool_strings(user: DictConfig) -> None:
    """YAML 1.1 reads a bare no/yes/off/on as a boolean; a string field (e.g. model.mixed_precision: no)
    gets the word back instead of a type error."""
    for path in _str_fields():
        value = OmegaConf.select(user, path, default=None, throw_on_missing=False, throw_on_resolution_failure=False)
        if isinstance(value, bool):
            OmegaConf.update(user, path, "yes" if value else "no", force_add=True)


_BOOL_WORDS = {"y", "yes", "n", "no", "true", "false", "on", "off"}


def _quote_bool_words(override: str) -> str:
    """``experiment.name=off``: a string field keeps the word as typed (YAML would read a bool)."""
    key, sep, value = override.partition("=")
    if sep and value.lower() in _BOOL_WORDS and key.strip() in _str_fields():
        return f"{key}='{value}'"
    return override


def _check_keys(node: Any, cls, prefix: str = "") -> None:
    """Reject keys the schema does not have, before OmegaConf's merge (whose messages are terse)."""
    if not isinstance(node, (dict, DictConfig)):
        return
    hints = {name: unwrap_optional(tp) for name, tp in get_type_hints(cls).items()}
    for key in node.keys():
        path = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"unknown config key '{path}'{_suggest(path)}")
        if is_dataclass(hints[key]):
            value = node[key] if isinstance(node, dict) else node._get_node(key)._value()
            if isinstance(value, (dict, DictConfig)):
                _check_keys(value, hints[key], path + ".")


def _check_removable(path: str) -> None:
    """``~path`` must name a key of the schema (or one inside a free-form mapping such as model.unet.params)."""
    parts = path.split(".")
    cls = train_config_class()
    for i, part in enumerate(parts):
        if part not in {fl.name for fl in fields(cls)}:
            raise ConfigError(f"cannot remove '~{path}': unknown config key '{path}'{_suggest(path)}")
        tp = unwrap_optional(get_type_hints(cls)[part])
        if is_free_dict(tp):
            return  # the rest of the path is inside the mapping
        if not is_dataclass(tp):
            if i != len(parts) - 1:
                raise ConfigError(f"cannot remove '~{path}': '{'.'.join(parts[:i + 1])}' is a value, not a section")
            return
        cls = tp


def _remove(user: DictConfig, path: str) -> None:
    """Drop ``path`` from the merged YAML layers; a key no layer sets already has the schema default."""
    _check_removable(path)
    parent_path, _, key = path.rpartition(".")
    parent = OmegaConf.select(user, parent_path, default=None, throw_on_missing=False) if parent_path else user
    if isinstance(parent, DictConfig) and key in parent:
        parent.pop(key)


# ----------------------------------------------------------------------------------------------
# Loading.
# ----------------------------------------------------------------------------------------------


def parse_argv(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Split ``config=path`` (repeatable: later files override earlier ones, e.g. a per-model base
    config then a recipe), ``key=value`` overrides and ``~key`` removals; anything else is an error."""
    config_paths, overrides, removals = [], [], []
    for arg in argv:
        if arg.startswith("~"):
            if "=" in arg or len(arg) == 1:
                raise ConfigError(f"argument '{arg}': ~key.sub removes a key from the config files and takes no value")
            removals.append(arg[1:])
            continue
        if "=" not in arg:
            raise ConfigError(f"argument '{arg}' is not key=value (use config=path.yaml, key.sub=value and ~key.sub; "
                              "--help lists keys)")
        key, value = arg.split("=", 1)
        if key in ("config", "--config"):
            config_paths.append(value)
        else:
            overrides.append(f"{key.lstrip('-')}={value}")
    both = sorted(set(removals) & {o.split("=", 1)[0] for o in overrides})
    if both:
        raise ConfigError(f"'{both[0]}' is both removed (~{both[0]}) and set on the command line: keep one")
    return config_paths, overrides, removals


def _list_entry(user: DictConfig, key: str) -> tuple[str, int] | None:
    """(the list's key, the entry's index) when ``key`` goes through a list the YAML layers set
    (``dataset.params.sources.1.weight``); None otherwise."""
    node, parts = user, key.split(".")
    for i, part in enumerate(parts[:-1]):
        node = node.get(part) if isinstance(node, DictConfig) and part in node else None
        if isinstance(node, ListConfig):
            if not parts[i + 1].isdigit():
                raise ConfigError(f"command-line key '{key}': '{'.'.join(parts[:i + 1])}' is a list; name an entry "
                                  f"by its index ({'.'.join(parts[:i + 1])}.0 ... .{len(node) - 1})")
            return ".".join(parts[:i + 1]), int(parts[i + 1])
        if node is None:
            return None
    return None


def _set_in_list(user: DictConfig, override: str) -> None:
    """Apply ``key=value`` where ``key`` names an entry (or a key inside one) of a list in ``user``."""
    key, value = override.split("=", 1)
    list_key, index = _list_entry(user, key)
    entries = OmegaConf.select(user, list_key)
    if index >= len(entries):
        raise ConfigError(f"command-line key '{key}': '{list_key}' has {len(entries)} entries (indices 0 to "
                          f"{len(entries) - 1}); add entries in a config file")
    try:  # the value read as the dotlist reads it, interpolations left as written
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([_quote_bool_words(f"v={value}")]), resolve=False)["v"]
        OmegaConf.update(user, key, parsed, merge=True)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"cannot set the command-line argument '{override}': {str(e).splitlines()[0]}") from None


def _parses(override: str) -> bool:
    try:
        OmegaConf.from_dotlist([_quote_bool_words(override)])
        return True
    except Exception:  # noqa: BLE001
        return False


def parse(argv: list[str] | None = None, *, yaml_text: str | None = None) -> TrainConfig:
    """The resolved ``TrainConfig`` from the command line (and/or YAML text), with the schema's own checks.

    The sections' owners check the rest: use ``sd_training.configure.load`` for a config to train with."""
    argv = sys.argv[1:] if argv is None else argv
    config_paths, overrides, removals = parse_argv(argv)
    layers = []
    for config_path in config_paths:
        if not os.path.exists(config_path):
            raise ConfigError(f"config file '{config_path}' does not exist")
        check_yaml_bounds(_config_text(config_path), f"config file '{config_path}'")
        try:
            layers.append(OmegaConf.load(config_path))
        except Exception as e:  # yaml syntax errors
            raise ConfigError(f"cannot parse config file '{config_path}': {e}") from e
    if yaml_text is not None:
        check_yaml_bounds(yaml_text, "the config text")
        try:
            layers.append(OmegaConf.create(yaml_text))
        except Exception as e:  # yaml syntax errors
            raise ConfigError(f"cannot parse the config text: {str(e).splitlines()[0]}") from None
    try:
        cli = OmegaConf.from_dotlist([_quote_bool_words(o) for o in overrides])
    except Exception as e:
        bad = next((o for o in overrides if not _parses(o)), None)
        what = f"the command-line argument '{bad}'" if bad else f"command-line overrides {overrides}"
        raise ConfigError(f"cannot parse {what}: {str(e).splitlines()[0]} (quote values that hold "
                          "'${', braces or spaces; an interpolation is ${key.path} or ${oc.env:NAME})") from None

    user = OmegaConf.merge(*layers) if layers else OmegaConf.create({})
    if not isinstance(user, DictConfig):
        raise ConfigError(f"config files {config_paths} must hold a mapping of sections")
    for path in removals:
        _remove(user, path)
    into_lists = [o for o in overrides if _list_entry(user, o.split("=", 1)[0]) is not None]
    if into_lists:  # a dotlist reads "sources.1" as a mapping key; these set the list's entry instead
        cli = OmegaConf.from_dotlist([_quote_bool_words(o) for o in overrides if o not in into_lists])
        for override in into_lists:
            _set_in_list(user, override)
    user = OmegaConf.merge(user, cli)
    _check_keys(user, train_config_class())
    _unbool_strings(user)
    # A ??? that no later layer filled. Checked before the schema merge, where OmegaConf would let a
    # ??? fall back to the schema default instead of stopping.
    try:
        _raise_missing(sorted(OmegaConf.missing_keys(user)))
    except OmegaConfBaseException:
        pass  # an interpolation that does not resolve: named with its key after the schema merge
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(train_config_class()), user)
    except ConfigKeyError as e:
        raise ConfigError(f"unknown config key '{e.full_key}'{_suggest(str(e.full_key))}") from None
    except ValidationError as e:
        raise ConfigError(f"wrong type for '{e.full_key}': {str(e).splitlines()[0]}") from None
    return resolve(cfg)


# ----------------------------------------------------------------------------------------------
# Bounded YAML: aliases that expand without end (a "billion laughs" file: each line nine aliases of the
# line before) and nesting deeper than any config are refused before OmegaConf builds a node per value.
# ----------------------------------------------------------------------------------------------

MAX_CONFIG_BYTES = 2**20  # a config is a few KB, a mixture of a thousand sources ~100 KB (PyYAML: ~3 s per MiB)
# Nodes that aliases may add beyond those written out: sharing a block by hand (`optimizer: *adamw`, a
# list of prompts used twice) adds tens to hundreds; 10,000 takes milliseconds and a few MB to build,
# while nine levels of nine aliases each would be 387 million nodes (tens of GB).
MAX_ALIAS_NODES = 10_000
MAX_DEPTH = 64  # levels of nested mappings and lists (the schema has 4; OmegaConf recurses per level)


def _config_text(path: str) -> str:
    try:
        size = os.path.getsize(path)
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file '{path}' is {size:,} bytes (at most {MAX_CONFIG_BYTES:,}): not a "
                              "hand-written config; list a mixture's many sources in a file it reads instead")
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file '{path}': {e}") from None


def _expanded_size(root) -> tuple[int, int, int]:
    """(nodes written, nodes once every alias is expanded, deepest nesting) of a composed YAML node graph,
    each shared node counted once per use without expanding it (memoized by identity); a node that
    contains itself through an alias is a ``ValueError``."""
    import yaml

    size: dict[int, tuple[int, int]] = {}  # id -> (expanded nodes, depth)
    stack, visiting = [(root, False)], set()
    while stack:
        node, done = stack.pop()
        if id(node) in size and not done:
            continue
        children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if done:
            visiting.discard(id(node))
            size[id(node)] = (1 + sum(size[id(c)][0] for c in children),
                              1 + max((size[id(c)][1] for c in children), default=0))
            continue
        visiting.add(id(node))  # on the path from the root (a child already on it: the check below)
        stack.append((node, True))
        for c in children:
            if id(c) in visiting:
                raise ValueError("an alias refers to a node that contains it")
            if id(c) not in size:
                stack.append((c, False))
    return len(size), *size[id(root)]


def check_yaml_bounds(text: str, where: str) -> None:
    """``text`` (YAML) composed without being built: a ``ConfigError`` naming ``where`` when its aliases
    add more than ``MAX_ALIAS_NODES`` nodes, refer to themselves, or it nests deeper than ``MAX_DEPTH``.
    A syntax error is left to OmegaConf, which reports it with its line and column."""
    import yaml

    too_deep = ConfigError(f"{where} nests mappings or lists deeper than the parser can follow (at most "
                           f"{MAX_DEPTH} levels): not a config")
    try:
        root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml's when built
    except RecursionError:  # the pure-Python composer
        raise too_deep from None
    except yaml.YAMLError as e:
        if "maximum nesting depth" in str(e):  # libyaml's own bound (1,000 levels)
            raise too_deep from None
        return  # a syntax error: OmegaConf reports it with its line and column
    if root is None:
        return
    try:
        written, expanded, depth = _expanded_size(root)
    except ValueError as e:
        raise ConfigError(f"{where}: {e} (a recursive YAML alias): write the value out") from None
    if expanded - written > MAX_ALIAS_NODES:
        raise ConfigError(f"{where}: its YAML aliases (*name) expand {written:,} written nodes to {expanded:,}; "
                          f"at most {MAX_ALIAS_NODES:,} may come from aliases (a file whose aliases multiply, a "
                          "'billion laughs', would fill the memory). Write the repeated values out")
    if depth > MAX_DEPTH:
        raise ConfigError(f"{where} nests mappings or lists {depth} levels deep (at most {MAX_DEPTH}): not a config")


def _raise_missing(missing: list[str]) -> None:
    if not missing:
        return
    hint = ""
    if "wandb.api_key" in missing:
        hint = " (wandb.api_key is optional here: delete the line and export WANDB_API_KEY instead)"
    raise ConfigError(
        "required config keys are not set (they are ??? in the config): " + ", ".join(missing)
        + f". Set them in the YAML or on the command line, e.g. {missing[0]}=...{hint}"
    )


def _mixture_path(cfg: DictConfig) -> None:
    """``dataset.params.sources`` replaces ``path``, which then names the sources joined by '::'."""
    params = cfg.dataset.params
    sources = params.get("sources") or []
    if not sources:
        return
    if not OmegaConf.is_missing(params, "path"):
        raise ConfigError("'dataset.params.path' and 'dataset.params.sources' are both set: a mixture's paths are "
                          "in its sources; remove dataset.params.path")
    if any(not hasattr(e, "get") or not e.get("path") for e in sources):
        return  # named by the dataset checks
    params.path = "::".join(_raw_if_env(e, "path") for e in sources)


def _raw_if_env(node: DictConfig, key: str) -> str:
    """The value of ``node.key``; an environment interpolation stays one (it is resolved with the rest)."""
    raw = node._get_node(key)._value() if isinstance(node, DictConfig) else None
    return raw if isinstance(raw, str) and "${oc.env:" in raw else str(node.get(key))


# ----------------------------------------------------------------------------------------------
# Interpolations that do not resolve: one ConfigError naming the key and the interpolation.
# ----------------------------------------------------------------------------------------------


def _raw_strings(node, path: str = ""):
    """(key path, raw text) of every string value holding an interpolation, in a raw container tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _raw_strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _raw_strings(v, f"{path}[{i}]")
    elif isinstance(node, str) and "${" in node:
        yield path, node


def _interpolation_hint(raw: str, error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    env = re.search(r"Environment variable '([^']+)' not found", text)
    if env:
        return (f"the environment variable {env.group(1)} is not set: export it, or give a default: "
                f"${{oc.env:{env.group(1)},default}}")
    if "Recursive interpolation" in text:
        return "it refers back to itself (an interpolation loop): set one of the keys in the loop to a value"
    unknown = re.search(r"Unsupported interpolation type (\S+)", text)
    if unknown:
        from omegaconf.basecontainer import BaseContainer

        known = ", ".join(sorted(getattr(BaseContainer, "_resolvers", {}))) or "oc.env"
        return f"there is no resolver '{unknown.group(1)}' (known: {known})"
    missing = re.search(r"Interpolation key '([^']+)' not found", text)
    if missing:
        return f"there is no key '{missing.group(1)}'{_suggest(missing.group(1))}"
    return text


def check_interpolations(cfg: DictConfig) -> None:
    """Resolve every interpolation once; the first that fails (the one at the root of a chain: not one
    that only refers to another failing key) is a ``ConfigError`` naming its key and its text."""
    try:
        raw = OmegaConf.to_container(cfg, resolve=False)
    except OmegaConfBaseException:
        return
    failures = {}
    for path, text in _raw_strings(raw):
        try:
            OmegaConf.select(cfg, path, throw_on_resolution_failure=True, throw_on_missing=False)
        except OmegaConfBaseException as e:
            failures[path] = (text, e)
        except Exception as e:  # a resolver's own error (our ${asset:...} raises ConfigError)
            failures[path] = (text, e)
    if not failures:
        return
    roots = [p for p, (text, _) in failures.items()
             if not any("${" + q + "}" in text for q in failures if q != p)] or list(failures)
    path = roots[0]
    text, error = failures[path]
    if isinstance(error, ConfigError):
        raise ConfigError(f"'{path}' ({text}): {error}") from None
    also = sorted(set(failures) - {path})
    tail = f" (keys that refer to it fail too: {', '.join(also)})" if also else ""
    raise ConfigError(f"'{path}' cannot be resolved: {text}: {_interpolation_hint(text, error)}{tail}") from None


def resolve(cfg: DictConfig) -> TrainConfig:
    """Check required keys, resolve interpolations, convert to dataclasses and validate."""
    check_interpolations(cfg)
    _mixture_path(cfg)
    _raise_missing(sorted(OmegaConf.missing_keys(cfg)))
    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"required config key '{e.full_key}' is not set (interpolated from a ??? value)") from None
    except InterpolationResolutionError as e:
        raise ConfigError(f"cannot resolve the interpolation in '{e.full_key}': {e.msg}") from None
    except ValidationError as e:
        raise ConfigError(f"wrong type for '{e.full_key}': {str(e).splitlines()[0]}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config at '{getattr(e, 'full_key', '?')}': {str(e).splitlines()[0]}") from None
    validate(obj)
    _record_env(cfg, obj)
    secrets.protect_logs(obj.__dict__[ENV_VIEW].values if ENV_VIEW in obj.__dict__ else {})
    return obj


def _record_env(cfg: DictConfig, obj: TrainConfig) -> None:
    """Remember which values came from the environment, so the dumps write their interpolations instead."""
    try:
        raw = OmegaConf.to_container(cfg, resolve=False)
        if not secrets.env_names(raw):
            return
        resolved = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)
        unresolved = OmegaConf.to_container(OmegaConf.create(secrets.escape_env(raw)), resolve=True)
        view = secrets.EnvView.record(raw, resolved, unresolved, _container(obj))
    except Exception:  # noqa: BLE001 -- an exotic resolver chain: the pattern redaction and value search still apply
        view = secrets.EnvView(values={n: v for n in secrets.env_names(OmegaConf.to_container(cfg, resolve=False))
                                       if (v := os.environ.get(n)) and len(v) >= 8})
    obj.__dict__[ENV_VIEW] = view


# ----------------------------------------------------------------------------------------------
# Output.
# ----------------------------------------------------------------------------------------------


REDACTED = secrets.REDACTED
ENV_VIEW = "_sd_training_env_view"  # attribute of a loaded TrainConfig: its values that came from the environment


def _container(cfg: TrainConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def public_dict(cfg: TrainConfig) -> dict:
    """The config as plain containers, as every dump holds it (config.yaml, checkpoints, the trackers' run
    config): values read from the environment written as their ``${oc.env:...}`` interpolations, literal
    secrets (``wandb.api_key``, tokens in headers and URLs ...) redacted (``config.secrets``)."""
    out = _container(cfg)
    view = cfg.__dict__.get(ENV_VIEW)
    if view is not None:
        out = view.apply(out)
    out = secrets.redact_tree(out)
    if out.get("wandb", {}).get("api_key"):
        out["wandb"]["api_key"] = REDACTED
    return out


def to_yaml(cfg: TrainConfig) -> str:
    """The config as YAML, secrets kept out (``public_dict``): written into the run directory and every
    checkpoint, loadable with config=... (an ``${oc.env:...}`` reads its variable again)."""
    return OmegaConf.to_yaml(OmegaConf.create(public_dict(cfg)))


def help_text() -> str:
    lines = [USAGE, "",
             "Precedence: schema defaults < YAML < command line. ??? = required. (a | b) = the values a key accepts.",
             "~key.sub drops a key the YAML files set, so its default applies.", ""]
    for path, _tp, default, meta, is_section in schema_entries():
        depth = path.count(".")
        help_ = meta.get("help", "")
        if is_section:
            lines.append(f"{'  ' * depth}{path.rsplit('.', 1)[-1]}:  # {help_}")
            continue
        shown = "???" if default == MISSING else repr(default) if isinstance(default, str) else default
        if isinstance(shown, (ListConfig, DictConfig)):
            shown = OmegaConf.to_container(shown)
        if "choices" in meta:
            help_ = f"({' | '.join(meta['choices'])}) {help_}"
        lines.append(f"{'  ' * depth}{path.rsplit('.', 1)[-1]}: {shown}  # {help_}")
    return "\n".join(lines)
