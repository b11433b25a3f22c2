"""Preemption, time limits and prompt exits: a signal sets a flag; the loop checks it once per step; a
process that cannot act on it (or fails) still ends in bounded time.

SIGUSR1 (SLURM's pre-timeout warning via ``--signal``) and SIGTERM (preemption, ``scancel``) ask for a
save-and-requeue; SIGINT (Ctrl-C) outside SLURM asks for a save-and-exit. The handler only sets a flag:
saving inside a signal handler would run collectives at an arbitrary point of the step.

**Bounded exits** (:data:`EXITS`, enabled by the entry point ``train.py`` only: a library caller such as a
test or a notebook is never ended). A daemon thread ends the process with ``os._exit`` once a deadline
passes, after logging what every thread was doing:

* after SIGTERM / SIGINT: ``system.stop_timeout_s`` to finish the step, save and exit (exit code 75);
  and if the main thread has not even handled the signal after :data:`STUCK_S` seconds it is inside one
  call that does not return (a collective whose peer died, one enormous operation): no checkpoint can be
  taken, so it exits then (75). The signal is seen by that thread through the signal module's wakeup fd,
  which the C-level handler writes even while the main thread is blocked in C code.
* after a failure (an exception leaving the Trainer): :data:`FAILED_EXIT_S` for the whole shutdown
  (closing metrics and trackers, the checkpoint writer, the evaluator, loader workers, the process group,
  the interpreter's own exit), then exit code 1 (2 for a config error).
* at the end of ``main``: the interpreter's exit (non-daemon threads, atexit handlers) gets
  :data:`FAILED_EXIT_S` too, with the run's own exit code.

Loader workers ignore the stop signals (the main process owns them) and die with their rank
(:func:`loader_worker_start`: ``PR_SET_PDEATHSIG``), so a SIGKILLed rank leaves no orphan behind.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
# A run that stopped early (a signal) and was not requeued: EX_TEMPFAIL, "try again later". SLURM then
# records the job FAILED, not COMPLETED, so `afterok` dependents do not start on an unfinished model.
EXIT_STOPPED_NOT_REQUEUED = 75
# A peer died or stopped without the launcher noticing (distributed.heartbeat): EX_TEMPFAIL too; the sbatch
# templates requeue on the line the heartbeat writes to $SD_TRAINING_PEER_LOST_FILE.
PEER_LOST_EXIT = 75
EXIT_FAILED = 1
# A failed run's whole shutdown gets this long (the bound: exit within a minute of the error).
FAILED_EXIT_S = 30.0
# A stop signal the main thread has not handled after this long: it is blocked inside one call.
STUCK_S = 10.0
DEFAULT_STOP_TIMEOUT_S = 120.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Set by the first SIGTERM / SIGINT this process handles: a launcher (torchrun, srun, scancel) asked it to
# stop. Code that waits for something slower (the heartbeat judging a failed collective) stops waiting.
STOP_SIGNALLED = threading.Event()


# ----------------------------------------------------------------------------------------- bounded exits
class Deadlines:
    """Named deadlines (``failure``, ``stop``, ``exit``); the earliest one that passes ends the process.

    ``arm`` keeps an earlier deadline of the same name unless ``replace``; nothing happens until the
    entry point calls :meth:`enable`. :meth:`stage` records what the shutdown is doing now, for the line
    that names what the process was waiting for."""

    def __init__(self):
        self.enabled = False
        self._cond = threading.Condition()
        self._armed: dict[str, tuple[float, int, str, float]] = {}  # name -> (monotonic time, code, why, seconds)
        self._thread: threading.Thread | None = None
        self._stage: str | None = None

    def enable(self) -> None:
        self.enabled = True

    def stage(self, what: str | None) -> None:
        self._stage = what

    def arm(self, name: str, seconds: float, code: int, why: str, replace: bool = False) -> None:
        if not self.enabled:
            return
        at = time.monotonic() + max(seconds, 0.0)
        with self._cond:
            if not replace and name in self._armed and self._armed[name][0] <= at:
                return
            self._armed[name] = (at, code, why, seconds)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="exit-deadline", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def disarm(self, name: str) -> None:
        with self._cond:
            self._armed.pop(name, None)
            self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._armed:
                    self._cond.wait()
                    continue
                at, code, why, seconds = min(self._armed.values())
                left = at - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        self._fire(code, why, seconds)

    def _fire(self, code: int, why: str, seconds: float) -> None:
        stage = f" (it was {self._stage})" if self._stage else ""
        head = (f"exiting now with code {code}: {why}{stage}. Nothing more is written; every complete checkpoint "
                "stands. Where each thread was:")
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = []
        for ident, frame in frames.items():
            if ident == threading.get_ident():
                continue
            stack = "".join(traceback.format_stack(frame)[-8:])
            stacks.append(f"--- thread {names.get(ident, ident)}:\n{stack}")
        text = head + "\n" + "".join(stacks)
        done = threading.Event()

        # Logged (train.log, and the console on rank 0) and the buffered output flushed, in a helper thread:
        # a thread blocked while holding the logging or stdout lock must not keep this one from exiting.
        def report():
            if logging.getLogger().handlers:
                log.error("%s", text)
                done.set()
            flush_std()

        helper = threading.Thread(target=report, daemon=True)
        helper.start()
        helper.join(2.0)
        if not done.is_set():  # no log handlers yet, or logging blocked: straight to stderr
            try:
                os.write(2, f"\n[sd_training] {text}\n".encode(errors="replace"))
            except OSError:
                pass
        os._exit(code)


EXITS = Deadlines()


def enable_bounded_exits() -> None:
    """The entry point's promise that this process is its own (train.py): deadlines may end it."""
    EXITS.enable()


def failed(exc: BaseException | None, why: str | None = None) -> None:
    """A failure: the shutdown that follows gets :data:`FAILED_EXIT_S` (the exit code: 2 for a config error)."""
    from ..config import ConfigError

    code = 2 if isinstance(exc, ConfigError) else EXIT_FAILED
    what = why or (f"the run failed ({type(exc).__name__}: {str(exc)[:200]})" if exc is not None else "the run failed")
    EXITS.arm("failure", FAILED_EXIT_S, code, f"{what} {FAILED_EXIT_S:.0f}s ago and its shutdown has not ended")


def shut_down(steps: list, failed_already: bool) -> None:
    """Run ``(what, step)`` pairs each on its own, ``what`` recorded as the stage a deadline would name: one
    that raises (a full disk: the metrics file's last flush) is logged in one line and the rest still run.
    After a clean run the first such error is raised at the end (and the exit deadline armed)."""
    first = None
    for what, step in steps:
        EXITS.stage(what)
        try:
            step()
        except Exception as e:  # noqa: BLE001 (a failed run's own error is the one that propagates)
            log.error("while %s: %s: %s", what, type(e).__name__, e)
            first = first or e
    EXITS.stage(None)
    if first is not None and not failed_already:
        failed(first)
        raise first


def within(seconds: float, fn, what: str) -> None:
    """``fn()`` in a helper thread, waited for ``seconds`` at most (a warning naming ``what`` if it is not done
    by then; it is left running); its error is raised here."""
    errors: list[BaseException] = []

    def call():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (raised below)
            errors.append(e)

    helper = threading.Thread(target=call, name="bounded-wait", daemon=True)
    helper.start()
    helper.join(seconds)
    if helper.is_alive():
        log.warning("gave up waiting for %s after %.0fs", what, seconds)
    elif errors:
        raise errors[0]


def exit_failed(exc: BaseException) -> None:
    """The entry point's end of a failed run: the traceback (as Python prints it), then :func:`exit_process`
    without its waits: what the interpreter's own exit would wait for (a checkpoint writer still waiting for a
    dead rank's file, third-party threads, atexit handlers) is not waited for. Bounded by the failure deadline
    throughout."""
    failed(exc)
    code = 130 if isinstance(exc, KeyboardInterrupt) else EXIT_FAILED
    try:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    except Exception:  # noqa: BLE001
        traceback.print_exception(exc)
    exit_process(code, wait=False)


def exit_process(code: int, wait: bool = True) -> None:
    """The entry point's end of a run that returned: the interpreter's exit done here, then ``os._exit``.

    What that exit would do is done first (non-daemon threads joined and the atexit handlers run, wandb's and
    logging's, unless not ``wait``; loader workers left over killed; the logs flushed), but the interpreter's
    finalization is not reached: a daemon thread still inside a C++ call that released the GIL (a store
    operation whose server has gone, torch's own threads) aborts the process there as it takes the GIL back
    ("terminate called without an active exception", exit -6 in place of the run's code). Bounded by the
    deadline the caller arms (``exit``, or ``failure``)."""
    EXITS.stage("stopping leftover loader workers")
    leftover_children()
    if wait:
        EXITS.stage("waiting for the non-daemon threads")
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        EXITS.stage("running the exit handlers")
        atexit._run_exitfuncs()
    EXITS.stage("flushing the logs")
    logging.shutdown()
    flush_std()
    os._exit(code)


def flush_std() -> None:
    """Flush the buffered stdout and stderr; a closed or broken stream is passed over."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def leftover_children(timeout: float = 1.0) -> list[int]:
    """SIGKILL what is left of this process's multiprocessing children (loader workers whose shutdown an
    error skipped; they ignore SIGTERM, so multiprocessing's exit handler would wait for them forever);
    returns their pids."""
    killed = []
    for p in multiprocessing.active_children():
        try:
            p.kill()
            killed.append(p.pid)
        except (OSError, AttributeError, ValueError):
            continue
    for p in multiprocessing.active_children():
        p.join(timeout)
    return killed


# ------------------------------------------------------------------------------------------- workers
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Linux: this process gets ``sig`` when ``parent_pid`` (its parent) dies; returns whether that is set.

    ``PR_SET_PDEATHSIG`` watches the thread that forked this process; the loader's workers are forked by
    the rank's main thread, which lives as long as the rank. A parent that died before the call leaves
    this process re-parented (``getppid()`` changed): it exits at once. Where the parent is not
    ``parent_pid`` (a forkserver start method), a thread checks every 2 s that ``parent_pid`` lives."""
    if os.getppid() != parent_pid:
        if not _pid_alive(parent_pid):
            os._exit(1)

        def watch():
            while _pid_alive(parent_pid):
                time.sleep(2.0)
            os._exit(1)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        ok = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:  # died between the check above and the prctl
        os._exit(1)
    return ok


STACK_SIGNAL = signal.SIGUSR2


def install_stack_dump() -> None:
    """``kill -USR2 PID`` (or ``scancel --signal=USR2 JOB``) prints every thread's Python stack to the
    process's stderr, and the run goes on: what a hung rank is doing, without stopping it. A C-level handler
    (faulthandler), so it prints even while the main thread is blocked in a collective. Loader workers ignore
    the signal (:func:`ignore_stop_signals`)."""
    import faulthandler

    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def ignore_stop_signals(*_args) -> None:
    """The main process owns the stop signals.

    SLURM (scancel, preemption, the time limit) and ``kill -- -PGID`` signal every process of the step,
    loader workers included. torch's worker dies of SIGTERM, and the main process then fails with
    "DataLoader worker is killed by signal" before it can save. Ignored here, the workers keep feeding
    the main process until it has saved and shuts them down."""
    for sig in STOP_SIGNALS + (STACK_SIGNAL,):
        signal.signal(sig, signal.SIG_IGN)


def loader_worker_start(parent_pid: int, *_worker_id) -> None:
    """DataLoader ``worker_init_fn`` (``functools.partial(loader_worker_start, os.getpid())`` in the rank):
    ignore the stop signals, and die with the rank (SIGKILL; a SIGKILLed rank leaves no worker behind)."""
    ignore_stop_signals()
    die_with_parent(parent_pid)


def loader_worker_init():
    """The ``worker_init_fn`` for a DataLoader made in this process (it names this process as the parent)."""
    return functools.partial(loader_worker_start, os.getpid())


# ------------------------------------------------------------------------------------------ stop flag
class StopFlag:
    def __init__(self):
        self.signal_name: str | None = None
        self.timeout_s = DEFAULT_STOP_TIMEOUT_S
        self._previous = {}
        self._handled_at = float("-inf")  # monotonic time of the handler's last run (main thread)
        self._signal_at: float | None = None  # when the watchdog saw the first SIGTERM / SIGINT
        self._wakeup: tuple[int, int, int] | None = None  # read end, write end, the previous wakeup fd

    def install(self) -> "StopFlag":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        if EXITS.enabled and threading.current_thread() is threading.main_thread() and self._wakeup is None:
            r, w = os.pipe()
            os.set_blocking(w, False)
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._wakeup = (r, w, previous)
            threading.Thread(target=self._watch, args=(r,), name="stop-signal-watchdog", daemon=True).start()
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()
        if self._wakeup is not None:
            r, w, previous = self._wakeup
            self._wakeup = None
            signal.set_wakeup_fd(previous)
            os.close(w)  # the watchdog reads end-of-file and ends; a stop deadline already armed stays

    def set_timeout(self, seconds: float) -> None:
        """``system.stop_timeout_s`` from the config (the flag is installed before the config is read)."""
        self.timeout_s = float(seconds)
        if self._signal_at is not None:
            left = self._signal_at + self.timeout_s - time.monotonic()
            EXITS.arm("stop", left, EXIT_STOPPED_NOT_REQUEUED, self._stop_why(), replace=True)

    def _stop_why(self, name: str | None = None) -> str:
        return (f"{name or self.signal_name or 'a stop signal'} arrived and the run did not save and exit within "
                f"system.stop_timeout_s={self.timeout_s:.0f}")

    def _handle(self, signum, frame) -> None:
        self._handled_at = time.monotonic()
        name = signal.Signals(signum).name
        if self.signal_name == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the save
        self.signal_name = name
        if signum in (signal.SIGTERM, signal.SIGINT):
            STOP_SIGNALLED.set()
        log.warning("received %s: saving at the end of this step, then exiting", name)

    def _watch(self, r: int) -> None:
        """Sees every signal through the wakeup fd, even while the main thread is blocked in C code."""
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                os.close(r)
                return
            seen = time.monotonic()
            stops = [s for s in data if s in (signal.SIGTERM, signal.SIGINT)]
            if not stops:
                continue  # SIGUSR1 is a warning ahead of a deadline that SLURM enforces itself
            name = signal.Signals(stops[0]).name
            if self._signal_at is None:
                self._signal_at = seen
                EXITS.arm("stop", self.timeout_s, EXIT_STOPPED_NOT_REQUEUED, self._stop_why(name))
            time.sleep(min(STUCK_S, self.timeout_s))
            # Handled within a second before the read (the read can lag the signal) or after it: fine.
            if self._handled_at < seen - 1.0 and self._wakeup is not None:
                EXITS.arm("stop", 0, EXIT_STOPPED_NOT_REQUEUED,
                          f"{name} arrived {STUCK_S:.0f}s ago and the main thread has not been able to act on it: it is "
                          "inside one call that does not return (a collective whose peer is gone, or one enormous "
                          "operation), so no checkpoint can be taken", replace=True)

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
