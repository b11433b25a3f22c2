"""Preemption and time limits: a signal sets a flag; the loop checks it once per step.

SIGUSR1 (SLURM's pre-timeout warning via ``--signal``) and SIGTERM (preemption, ``scancel``) ask for a
save-and-requeue; SIGINT (Ctrl-C) outside SLURM asks for a save-and-exit. The handler only sets a flag:
saving inside a signal handler would run collectives at an arbitrary point of the step.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
# A run that stopped early (a signal) and was not requeued: EX_TEMPFAIL, "try again later". SLURM then
# records the job FAILED, not COMPLETED, so `afterok` dependents do not start on an unfinished model.
EXIT_STOPPED_NOT_REQUEUED = 75


def ignore_stop_signals(*_args) -> None:
    """DataLoader ``worker_init_fn``: the main process owns the stop signals.

    SLURM (scancel, preemption, the time limit) and ``kill -- -PGID`` signal every process of the step,
    loader workers included. torch's worker dies of SIGTERM, and the main process then fails with
    "DataLoader worker is killed by signal" before it can save. Ignored here, the workers keep feeding
    the main process until it has saved and shuts them down."""
    for sig in STOP_SIGNALS + (signal.SIGUSR2,):
        signal.signal(sig, signal.SIG_IGN)


class StopFlag:
    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def install(self) -> "StopFlag":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the save
        self.signal_name = name
        log.warning("received %s: saving at the end of this step, then exiting", name)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


def under_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ


def requeue_job() -> bool:
    """``scontrol requeue $SLURM_JOB_ID``; rank 0 calls it after the save. Returns success."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else os.environ["SLURM_JOB_ID"]
    try:
        out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        log.error("scontrol requeue %s failed: %s", job_id, e)
        return False
    if out.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, out.stderr.strip())
        return False
    log.info("requeued SLURM job %s", job_id)
    return True
