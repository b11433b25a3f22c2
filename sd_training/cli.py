"""Command line: parse the config (or print --help), run, and turn config errors into one clear line."""

from __future__ import annotations

import sys

from .config import ConfigError, help_text, load

# Problems found while building models or data from the config (DatasetConfigError included): one
# clear line, no traceback.
USER_ERRORS = (ConfigError,)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help", "help") for a in argv):
        print(help_text())
        return 0
    try:
        cfg = load(argv)
    except USER_ERRORS as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from .loop import main as train

    try:
        train(cfg)
    except USER_ERRORS as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0
