"""Command line: parse the config (or print --help), run, and turn config errors into one clear line."""

from __future__ import annotations

import sys

from . import quickstart
from .config import ConfigError
from .configure import load
from .config.loading import help_text
from .config.secrets import scrub
from .loop import main as train
from .run.preemption import EXIT_STOPPED_NOT_REQUEUED, StopFlag

# Problems found while building models or data from the config (DatasetConfigError included): one
# clear line, no traceback.
USER_ERRORS = (ConfigError,)


def main(argv: list[str], stop: StopFlag | None = None) -> int:
    """Exit codes: 0 done (or stopped by a signal and requeued), 2 config error, 75 stopped by a signal
    and not requeued (resume with the same command; also a stop the run could not act on in time, see
    ``preemption``), 1 a crash (within ``preemption.FAILED_EXIT_S`` of it, whatever the shutdown waits for)."""
    if any(a in ("-h", "--help", "help") for a in argv):
        print(help_text())
        return 0
    try:
        cfg = load(argv)
    except USER_ERRORS as e:
        print(scrub(f"config error: {e}"), file=sys.stderr)  # a URL or token in a key's value stays out
        return 2
    try:
        # The generated inputs (tiny pipeline, shapes dataset) of configs that ask for them, written by
        # rank 0 before anything is built from them.
        summary = train(cfg, stop, prepare=lambda info: quickstart.prepare(cfg.quickstart, info.is_main))
    except USER_ERRORS as e:
        print(scrub(f"config error: {e}"), file=sys.stderr)  # a URL or token in a key's value stays out
        return 2
    if summary.get("stopped_by") and not summary.get("requeued"):
        return EXIT_STOPPED_NOT_REQUEUED
    return 0
