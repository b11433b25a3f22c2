"""``f(default, help)``: the dataclass field every config schema uses (its help shows in ``--help``),
and ``ConfigError``, the error every config check raises."""

from __future__ import annotations

from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem, reported before (or while) anything is built from it."""


def f(default: Any, help: str):
    """A dataclass field with its one-line help, which must state the unit where there is one."""
    if isinstance(default, (dict, list)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"help": help})
    if isinstance(default, type):  # a nested section: its dataclass
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})
