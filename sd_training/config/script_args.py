"""Range checks for the scripts' command-line arguments, as argparse ``type=`` functions: a bad value is refused
while the command line is parsed, before anything is read or loaded, by argparse's own error (the usage,
then one line ``error: argument --n: ...`` naming the argument and what it allows; exit code 2).

    ap.add_argument("--n", type=integer(1, 1024), default=16)
    ap.add_argument("--gpu-gb", type=number(gt=0, hi=4096))
    ap.add_argument("--out", type=new_file(".png"))

Numbers are finite (``nan`` and ``inf`` are refused) and bounded: every bound the scripts use is stated in
their ``--help``. Paths: ``existing(...)`` for inputs, ``new_file(suffix)`` / ``out_folder`` for outputs (a
folder that is a file, or a file that is a folder, is refused up front, not after the work)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable

# Seeds: what numpy and torch generators take.
SEED_MAX = 2**63 - 1


def _num(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range(lo, hi, gt=None) -> str:
    if gt is not None:
        return f"> {_num(gt)}" + (f" and <= {_num(hi)}" if hi is not None else "")
    if lo is not None and hi is not None:
        return f"from {_num(lo)} to {_num(hi)}"
    return f">= {_num(lo)}" if lo is not None else f"<= {_num(hi)}"


def integer(lo: int | None = None, hi: int | None = None, multiple_of: int = 1) -> Callable[[str], int]:
    """An int in [lo, hi] (None: unbounded on that side), a multiple of ``multiple_of``."""
    what = f"an integer {_range(lo, hi)}" + (f", a multiple of {multiple_of}" if multiple_of > 1 else "")

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi) or value % multiple_of:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def number(lo: float | None = None, hi: float | None = None, gt: float | None = None) -> Callable[[str], float]:
    """A finite float in [lo, hi], or in (gt, hi] with ``gt``."""
    what = f"a finite number {_range(lo, hi, gt)}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if (not math.isfinite(value) or (lo is not None and value < lo) or (gt is not None and value <= gt)
                or (hi is not None and value > hi)):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def integer_or(word: str, lo: int, hi: int) -> Callable[[str], int | None]:
    """``word`` (returned as None) or an int in [lo, hi]; e.g. ``--scan-units all``."""
    as_int = integer(lo, hi)

    def parse(text: str) -> int | None:
        if text == word:
            return None
        try:
            return as_int(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be {word!r} or an integer from {lo} to {hi}, got {text!r}") from None

    parse.__name__ = "integer_or"
    return parse


def existing(kind: str = "any") -> Callable[[str], str]:
    """A path that exists: ``kind`` "file", "folder" or "any"."""

    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError("must be a path, got an empty one")
        ok = {"file": os.path.isfile, "folder": os.path.isdir, "any": os.path.exists}[kind](text)
        if not ok:
            wanted = {"file": "an existing file", "folder": "an existing folder", "any": "an existing path"}[kind]
            found = " (it is a folder)" if kind == "file" and os.path.isdir(text) else (
                " (it is a file)" if kind == "folder" and os.path.isfile(text) else "")
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}{found}")
        return text

    parse.__name__ = "existing"
    return parse


def new_file(*suffixes: str) -> Callable[[str], str]:
    """An output file name ending in one of ``suffixes`` (any case) that is not a folder, whose parent is
    not a file (the parent is created when missing)."""

    def parse(text: str) -> str:
        if not text.lower().endswith(tuple(s.lower() for s in suffixes)):
            raise argparse.ArgumentTypeError(f"must be a file name ending in {' or '.join(suffixes)}, got {text!r}")
        return _writable(text, folder=False)

    parse.__name__ = "new_file"
    return parse


def out_folder(text: str) -> str:
    """An output folder: a path that is not a file, and no part of whose parent is a file."""
    if not text:
        raise argparse.ArgumentTypeError("must be a folder path, got an empty one")
    return _writable(text, folder=True)


def _writable(text: str, folder: bool) -> str:
    if folder and os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"must be a folder, got {text!r}, which is a file")
    if not folder and os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"must be a file, got {text!r}, which is a folder")
    parent = os.path.dirname(os.path.abspath(text))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot be written: {parent!r} in {text!r} is a file, not a folder")
    return text


def name_part(text: str) -> str:
    """A piece of a file name (a prefix): not empty, no path separator."""
    if not text or os.sep in text or (os.altsep and os.altsep in text) or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"must be a file name part without '/', got {text!r}")
    return text


__all__ = ["integer", "number", "integer_or", "existing", "new_file", "out_folder", "name_part", "SEED_MAX"]
