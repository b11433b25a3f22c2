"""Regular expressions a user writes (``model.adapter.target_regex``), compiled and matched with a bound.

Python's ``re`` backtracks: a repetition inside a repetition such as ``([a-z_0-9.]+)+Z`` takes time
exponential in the length of a layer name that almost matches, inside C code where no signal handler runs
(SIGTERM is logged and ignored until it returns; only SIGKILL ends it). These patterns go through the
``regex`` package instead: ``re``'s syntax (its VERSION0 mode), and a matcher that takes a ``timeout`` and
raises ``TimeoutError`` when it runs out, so a pattern gets ``MATCH_BUDGET_S`` seconds for all the names it
is matched against and is then a ``ConfigError`` naming the key and the pattern. The families' own presets
go through it too (they match in microseconds).
"""

from __future__ import annotations

import time

import regex

from .fields import ConfigError

# Seconds one pattern may take against all the names it is matched with (a model's few thousand layer
# names take milliseconds with any sensible pattern; an exponential one never finishes).
MATCH_BUDGET_S = 2.0
MAX_PATTERN_CHARS = 10_000  # longer is no hand-written layer pattern (and compiling it costs its length)


class PatternTimeout(ConfigError):
    """A user's pattern ran past its matching budget (a ``ConfigError`` naming the key and the pattern)."""


def compile_pattern(pattern: str, key: str) -> regex.Pattern:
    """``pattern`` compiled with ``re``'s syntax; a ``ConfigError`` naming ``key`` when it is not one."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ConfigError(f"'{key}' is {len(pattern):,} characters long (at most {MAX_PATTERN_CHARS:,}): name the "
                          "layers with a shorter pattern")
    try:
        return regex.compile(pattern, regex.VERSION0)
    except (regex.error, OverflowError, RecursionError, ValueError) as e:
        raise ConfigError(f"'{key}' {pattern!r} is not a regular expression: {e}") from None


def full_matches(pattern: str, names: list[str], key: str, budget_s: float = MATCH_BUDGET_S) -> list[str]:
    """The ``names`` that ``pattern`` matches in full, in order, all within ``budget_s`` seconds together;
    past it a :class:`PatternTimeout` naming ``key`` and the pattern."""
    compiled = compile_pattern(pattern, key)
    deadline = time.monotonic() + budget_s
    found = []
    for name in names:
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if compiled.fullmatch(name, timeout=left):
                found.append(name)
        except TimeoutError:
            raise PatternTimeout(
                f"'{key}' {pattern!r} took more than {budget_s:g} s to match {len(names):,} layer names (at "
                f"{name!r}): a repetition inside a repetition, such as (a+)+ or ([a-z.]+)*, backtracks "
                "exponentially. Write it without nesting, e.g. '.*attn[12]\\.to_(q|k|v)'") from None
    return found
