"""The live progress bar of training, on an interactive terminal only.

``experiment.progress_bar``: ``auto`` shows it when rank 0's stdout is a terminal and the run is not a
SLURM batch job; ``on`` / ``off`` force it. With the bar, the periodic "step N/M loss ..." lines go to
``train.log`` only (the bar shows steps, images/s, loss and ETA, redrawn in place), and every other log
message is printed above the bar. Without it (redirected output, SLURM, ``off``) the log lines are the
progress, as before.
"""

from __future__ import annotations

import logging
import os
import sys

PROGRESS = "progress"  # a log record with this attribute set is a periodic step line


def wanted(setting: str, stream=None) -> bool:
    stream = stream or sys.stdout
    if setting in ("on", "off"):
        return setting == "on"
    batch = os.environ.get("SLURM_JOB_ID") and not os.environ.get("SLURM_PTY_PORT")  # sbatch, not srun --pty
    return bool(getattr(stream, "isatty", lambda: False)()) and not batch


class _AboveTheBar(logging.Handler):
    """Console handler that prints through tqdm (above the bar) and leaves the step lines to the bar."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, PROGRESS, False):
            return
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class ProgressBar:
    """Steps done / total, images per second, the last logged loss, ETA; updated every optimizer step
    without touching the device (the loss shown is the one read at the last log interval)."""

    def __init__(self, total: int, initial: int, images_per_step: int, desc: str = "train"):
        import shutil

        from tqdm import tqdm

        self.images_per_step = images_per_step
        try:
            sized = os.get_terminal_size(sys.stdout.fileno()).columns > 0
        except (OSError, ValueError):
            sized = False
        # A terminal that reports no size (0 x 0: some pty wrappers) gets 100 x 20 instead of a hidden bar.
        fallback = {} if sized else dict(ncols=shutil.get_terminal_size((100, 20)).columns, nrows=20)
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stdout, smoothing=0.1,
                        dynamic_ncols=sized, **fallback)
        self._route_console_logging()

    def _route_console_logging(self) -> None:
        root = logging.getLogger()
        for h in list(root.handlers):
            if getattr(h, "_sd_training", False) and isinstance(h, logging.StreamHandler) and \
                    not isinstance(h, logging.FileHandler):
                above = _AboveTheBar()
                above.setFormatter(h.formatter)
                above._sd_training = True
                root.removeHandler(h)
                root.addHandler(above)

    def step(self) -> None:
        self.bar.update(1)

    def show(self, loss: float, images_per_sec: float) -> None:
        self.bar.set_postfix_str(f"loss {loss:.4f}, {images_per_sec:.1f} img/s", refresh=False)

    def close(self) -> None:
        self.bar.close()
