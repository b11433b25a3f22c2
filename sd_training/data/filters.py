"""Metadata filters (seed 001's syntax, parsed into predicates once at start-up; never ``eval``).

``filters: {pwatermark: "<=0.5", original_width: ">=512", status: "in [success, ok]"}``

* operators ``< <= > >= == !=`` and ``in [a, b]`` / ``not in [a, b]``;
* literals: numbers, ``true``/``false``, strings (bare or quoted: ``== "a b"``);
* a non-string YAML value means equality (``nsfw: false``), a YAML list means ``in``;
* a sample whose field is missing or null fails the filter; so does a type mismatch
  (a string field compared with ``<=``), which never raises inside a worker.

A dotted key (``meta.width``) looks into nested objects when the json has no such top-level key.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..config.dataset import DatasetConfigError

_ORDER_OPS: Dict[str, Callable[[Any, Any], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}
_EQ_OPS = {"==": operator.eq, "!=": operator.ne}
_COMPARE = re.compile(r"^\s*(<=|>=|==|!=|<|>)\s*(.*?)\s*$", re.S)
_MEMBERSHIP = re.compile(r"^\s*(not\s+in|in)\s*\[(.*)\]\s*$", re.S)
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


class _Missing:
    pass


MISSING_FIELD = _Missing()


def _literal(text: str, key: str, expr: str) -> Any:
    """A filter literal: quoted string, bool, number or bare string."""
    t = text.strip()
    if not t:
        raise DatasetConfigError(f"dataset.params.filters.{key}={expr!r}: the value after the operator is empty")
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        raise DatasetConfigError(
            f"dataset.params.filters.{key}={expr!r}: null is not a filter value (a missing/null field always fails)"
        )
    if _NUMBER.match(t):
        return float(t) if any(c in t for c in ".eE") else int(t)
    if any(c in t for c in "[]<>=!,"):
        raise DatasetConfigError(f"dataset.params.filters.{key}={expr!r}: cannot read the value {t!r}; quote strings")
    return t


def _split_list(body: str, key: str, expr: str) -> List[Any]:
    """Items of ``[a, 'b, c', 3]``: commas outside quotes separate items."""
    items, cur, quote = [], [], None
    for ch in body:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
            cur.append(ch)
        elif ch == ",":
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if quote:
        raise DatasetConfigError(f"dataset.params.filters.{key}={expr!r}: unclosed quote")
    items.append("".join(cur))
    if len(items) == 1 and not items[0].strip():
        return []
    return [_literal(i, key, expr) for i in items]


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _coerce(value: Any, literal: Any) -> Tuple[bool, Any]:
    """(ok, value) with ``value`` comparable to ``literal``; numbers stored as strings are read as numbers."""
    if isinstance(literal, bool):
        return (isinstance(value, bool), value)
    if _is_number(literal):
        if _is_number(value):
            return (not (isinstance(value, float) and math.isnan(value)), value)
        if isinstance(value, str) and _NUMBER.match(value.strip()):
            return (True, float(value))
        return (False, value)
    # a string literal
    return (isinstance(value, str), value)


@dataclass(frozen=True)
class Filter:
    """One parsed filter: ``key op literal`` (or membership in ``literals``)."""

    key: str
    op: str
    literal: Any
    text: str

    def lookup(self, meta: Mapping[str, Any]) -> Any:
        if self.key in meta:
            return meta[self.key]
        if "." in self.key:
            node: Any = meta
            for part in self.key.split("."):
                if not isinstance(node, Mapping) or part not in node:
                    return MISSING_FIELD
                node = node[part]
            return node
        return MISSING_FIELD

    def __call__(self, meta: Optional[Mapping[str, Any]]) -> bool:
        if not isinstance(meta, Mapping):
            return False
        value = self.lookup(meta)
        if value is MISSING_FIELD or value is None:
            return False
        if self.op in ("in", "not in"):
            hit = False
            for lit in self.literal:
                ok, v = _coerce(value, lit)
                if ok and v == lit:
                    hit = True
                    break
            return hit if self.op == "in" else not hit
        ok, v = _coerce(value, self.literal)
        if not ok:
            return False
        if self.op in _EQ_OPS:
            return _EQ_OPS[self.op](v, self.literal)
        return _ORDER_OPS[self.op](v, self.literal)


def parse_filter(key: str, expr: Any) -> Filter:
    """Parse one ``key: expression`` pair; raises :class:`DatasetConfigError` naming the key."""
    if not isinstance(key, str) or not key.strip():
        raise DatasetConfigError(f"dataset.params.filters: a filter key must be a non-empty string, got {key!r}")
    if isinstance(expr, bool) or _is_number(expr):
        return Filter(key, "==", expr, f"== {expr}")
    if isinstance(expr, (list, tuple)):
        lits = []
        for item in expr:
            if not (isinstance(item, (str, bool)) or _is_number(item)):
                raise DatasetConfigError(f"dataset.params.filters.{key}: list items must be numbers, strings or booleans")
            lits.append(item)
        return Filter(key, "in", tuple(lits), f"in {list(expr)}")
    if not isinstance(expr, str):
        raise DatasetConfigError(
            f"dataset.params.filters.{key}={expr!r}: expected an expression such as '<=0.5', '== foo' or 'in [a, b]'"
        )
    m = _MEMBERSHIP.match(expr)
    if m:
        op = "not in" if m.group(1).startswith("not") else "in"
        return Filter(key, op, tuple(_split_list(m.group(2), key, expr)), expr.strip())
    m = _COMPARE.match(expr)
    if not m:
        raise DatasetConfigError(
            f"dataset.params.filters.{key}={expr!r}: no operator; write e.g. '<=0.5', '>=512', '== \"x\"', "
            "'!= 0' or 'in [a, b]'"
        )
    op, lit_text = m.group(1), m.group(2)
    lit = _literal(lit_text, key, expr)
    if op in _ORDER_OPS and not _is_number(lit):
        raise DatasetConfigError(f"dataset.params.filters.{key}={expr!r}: '{op}' needs a number, got {lit!r}")
    return Filter(key, op, lit, expr.strip())


def parse_filters(spec: Optional[Mapping[str, Any]]) -> List[Filter]:
    """All filters of ``dataset.params.filters``, in config order."""
    if not spec:
        return []
    if not isinstance(spec, Mapping):
        raise DatasetConfigError(f"dataset.params.filters must be a mapping of key -> expression, got {type(spec).__name__}")
    return [parse_filter(k, v) for k, v in spec.items()]
