"""The building blocks of every config section: ``f(...)``, the dataclass field that carries its help, its
choices and its numeric range; ``ConfigError``, the error every config check raises; ``ComponentConfig``;
and ``check_fields``, the one check of what fields declare. Imports nothing else of the package, so any
module (a family's options included) can declare a section with it."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Iterable, Optional


class ConfigError(ValueError):
    """A configuration problem, reported before (or while) anything is built from it."""


def f(default: Any, help: str, *, choices: Iterable[str] | None = None, ge: float | None = 0,
      gt: float | None = None, le: float | None = None):
    """A dataclass field with its one-line help, which must state the unit where there is one.

    ``choices``: the values a string key accepts (``--help`` lists them, ``check_fields`` enforces them;
    ``None`` passes when it is the default). Numbers must be finite and within ``ge``/``gt``/``le``:
    ``ge=0`` unless the key says otherwise (``ge=None`` allows negative values)."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if isinstance(default, (dict, list)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=meta)
    if isinstance(default, type):  # a nested section: its dataclass
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ComponentConfig:
    pretrained: Optional[str] = f(None, "pipeline root or component folder, local path or hub id (None: from model.pretrained)")


def choice_error(path: str, value: Any, allowed: Iterable[str]) -> ConfigError:
    """``model.mixed_precision='bf17': expected one of no, bf16 or fp16; did you mean 'bf16'?``"""
    allowed = [str(a) for a in allowed]
    listed = ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
    close = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"{path}={value!r}: expected one of {listed}{hint}")


def _number(g: Optional[float]) -> str:
    return str(int(g)) if g is not None and float(g).is_integer() else str(g)


def check_value(path: str, value: Any, meta: dict, default: Any = None) -> None:
    """One field's value against what its ``f(...)`` declares (choices, finite number, range)."""
    if "choices" in meta:
        if value is None and default is None:
            return
        if value not in meta["choices"]:
            raise choice_error(path, value, meta["choices"])
        return
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # not a number (or an unset Optional, or an unresolved interpolation)
    why = f" ({meta['help']})" if meta.get("help") else ""
    if math.isnan(value):
        raise ConfigError(f"'{path}' is NaN: set a number (a NaN often comes from an interpolation or a typo in the YAML)")
    if math.isinf(value):
        raise ConfigError(f"'{path}' is infinite ({value}): set a finite number")
    ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
    if le is not None and not (ge if ge is not None else -math.inf) <= value <= le:
        raise ConfigError(f"'{path}' must be within [{_number(ge)}, {_number(le)}], got {value}{why}")
    if gt is not None and value <= gt:
        raise ConfigError(f"'{path}' must be > {_number(gt)}, got {value}{why}")
    if ge is not None and value < ge:
        if ge >= 1 and default is None:
            raise ConfigError(f"'{path}' must be >= {_number(ge)} when set, got {value} (leave it unset for the default)")
        raise ConfigError(f"'{path}' must be >= {_number(ge)}, got {value}{why}")


def check_fields(section: Any, prefix: str) -> None:
    """Every field of a section (a dataclass instance, nested sections included) against its declared
    choices and range; raises ``ConfigError`` naming the key (``prefix`` + its path)."""
    defaults = type(section)()
    for fld in fields(section):
        value = getattr(section, fld.name)
        path = f"{prefix}{fld.name}"
        if is_dataclass(value) and not isinstance(value, type):
            check_fields(value, path + ".")
        else:
            check_value(path, value, fld.metadata, getattr(defaults, fld.name))

