"""Heartbeats between ranks: a peer that died or stopped without the launcher noticing ends the job for a
requeue (exit code :data:`~sd_training.run.preemption.PEER_LOST_EXIT`, 75), within
``distributed.peer_timeout_s``, instead of leaving the survivors in a collective for
``distributed.timeout_minutes``.

Each rank runs one daemon thread. It beats (sets its key: a counter, its last step, host and pid) every
``interval`` seconds, and watches the next rank's key (a ring: ``rank + 1 mod world``; a run of dead ranks
is seen by the live rank before it). A thread beats while the main thread saves, exports or waits in a
collective, so only a process whose threads do not run (SIGKILL, SIGSTOP, a frozen node) goes silent.

* A watched key that has not changed for ``peer_timeout_s`` (measured on the watcher's own monotonic clock,
  so clocks need not agree): the watcher writes ``lost`` (the peer's rank, host and last step) and leaves;
  every other rank reads ``lost`` at its next beat and leaves with the same message.
* The store's host gone (rank 0's process holds the env:// store; torchrun's agent holds it under
  torchrun): the store's operations fail or time out on every rank; after ``peer_timeout_s`` of that, each
  rank leaves naming the store's host and its last known step.
* Leaving: the message on stderr and in the rank's log, the line in ``$SD_TRAINING_PEER_LOST_FILE`` (the
  sbatch templates requeue on it), then :data:`~sd_training.run.preemption.EXITS` logs every thread's stack
  and ends the process with 75. Nothing is saved (the main thread may be inside a collective): the newest
  complete checkpoint stands. A process not started by ``train.py`` (a test, a notebook) only logs.
* A watcher that was itself not running (SIGSTOP and SIGCONT of the whole job, ``scontrol suspend``) judges
  nobody for that gap: it restarts its clock.
* A collective that fails at once because a peer's sockets closed (gloo, on a SIGKILLed peer) would end the
  survivor with code 1: :meth:`Heartbeat.judge` waits for the heartbeat's verdict first (a peer that left
  after its own error: code 1 as before; a silent one: 75). A stop signal ends that wait: the launcher saw
  the death itself (torchrun and srun SIGTERM the survivors) and restarts or ends the job.
* Stopping (:meth:`Heartbeat.stop`) joins both threads: one left inside a store call when the interpreter
  exits would abort the process once the store's host is gone.

The thread uses its own connection to the store (``Store.clone()``): a client shared with the main thread
would queue the beats behind the main thread's blocking ``get``/``wait`` (NCCL's communicator set-up).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from ..run import preemption

log = logging.getLogger(__name__)

DEFAULT_PEER_TIMEOUT_S = 300.0
PREFIX = "sd_training/heartbeat/"
LOST = "lost"
LEFT = "left"  # a counter: ranks that stopped beating on purpose
ROUND_OPS = 8  # store operations in one round of the beat thread (outside judging), at most


def interval_for(timeout_s: float) -> float:
    """Seconds between beats: five beats per bound (a late beat or two never trips it), at most 10 s."""
    return min(10.0, max(0.2, timeout_s / 5))


def store_host(env: dict[str, str] | None = None) -> str:
    """Who serves the c10d store, in words for the message."""
    env = os.environ if env is None else env
    addr = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"torchrun's agent at {addr}"
    return f"rank 0's process at {addr}"


def start(timeout_s: float, rank: int, world_size: int, requeue: bool = True) -> Heartbeat | None:
    """The heartbeat of this rank (a process group must be up), or None (one process, or ``timeout_s`` 0)."""
    if timeout_s <= 0 or world_size < 2 or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store().clone()
    except (RuntimeError, AttributeError, ValueError) as e:  # a store that cannot be cloned (file://)
        log.warning("no heartbeat between ranks (distributed.peer_timeout_s): this process group's store has no "
                    "connection of its own to give the heartbeat thread (%s)", e)
        return None
    beat = Heartbeat(dist.PrefixStore(PREFIX, store), rank, world_size, timeout_s, store_host(),
                     os.environ.get("SD_TRAINING_PEER_LOST_FILE") if requeue else None)
    beat.start()
    return beat


@contextlib.contextmanager
def watching(timeout_s: float, rank: int, world_size: int, requeue: bool = True):
    """The heartbeat (:func:`start`) around a run: yields ``follow(progress)`` (tell it how to read the step);
    an exception leaving the block is judged first (a collective that failed because a peer died ends with
    ``PEER_LOST_EXIT``, not 1), and the rank says how it left before the beat stops."""
    beat = start(timeout_s, rank, world_size, requeue)
    failed = True
    try:
        yield (beat.follow if beat is not None else (lambda progress: None))
        failed = False
    except BaseException as e:
        if beat is not None:
            beat.judge(e)
        raise
    finally:
        if beat is not None:
            beat.stop(failed=failed)


class Heartbeat:
    def __init__(self, store, rank: int, world_size: int, timeout_s: float, host_of_store: str,
                 peer_lost_file: str | None = None):
        self.store, self.rank, self.world = store, rank, world_size
        self.timeout_s, self.interval = float(timeout_s), interval_for(timeout_s)
        self.store_host, self.peer_lost_file = host_of_store, peer_lost_file
        self.op_timeout_s = max(1.0, self.interval)  # each store operation of the threads waits this long at most
        self.store.set_timeout(datetime.timedelta(seconds=self.op_timeout_s))
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.progress: Callable[[], int] = lambda: 0  # this rank's step (the Trainer's, once it exists)
        self.watched = (rank + 1) % world_size
        self.verdict: str | None = None  # the message, once a peer is lost
        self._known: dict[int, dict] = {}  # the last beat read of each rank
        self._seq = 0
        self._last_ok = time.monotonic()  # the end of the last round whose store operations all answered
        self._last_error: Exception | None = None
        self._once = threading.Lock()
        self._stop = threading.Event()
        self._judging = threading.Event()  # the main thread failed in a collective: look at every peer
        self._gone = threading.Event()  # a verdict, or a peer that left after its own error
        self._threads = [threading.Thread(target=self._run, name="heartbeat", daemon=True),
                         threading.Thread(target=self._supervise, name="heartbeat-store-watch", daemon=True)]

    def start(self) -> None:
        log.info("heartbeat: every %.1fs; rank %d watches rank %d; a rank silent for %.0fs "
                 "(distributed.peer_timeout_s) ends the job with exit code %d", self.interval, self.rank,
                 self.watched, self.timeout_s, preemption.PEER_LOST_EXIT)
        self._beat()  # the first beat before returning: a peer's first look finds it
        for t in self._threads:
            t.start()

    def follow(self, progress: Callable[[], int]) -> None:
        self.progress = progress

    # ------------------------------------------------------------------------ the main thread's calls
    def stop(self, failed: bool = False) -> None:
        """Stop beating and say so (a peer that left on purpose is not lost). The rank whose process serves
        the store keeps it up until every rank has said so (at most ``peer_timeout_s``), so that a slower
        peer's last beats do not fail as if the store's host had died. Bounded: the store may be gone."""
        if self._stop.is_set():
            return
        self._stop.set()
        # Both threads joined, each within one round of store operations (at most ROUND_OPS, each bounded by the
        # store's timeout): a thread still inside a store call when the interpreter exits aborts the process
        # ("terminate called without an active exception") once the store's host has gone.
        bound = ROUND_OPS * self.op_timeout_s + 1
        for t in self._threads:
            t.join(bound)
            if t.is_alive():
                log.warning("heartbeat: thread %s still in a store call after %.0fs", t.name, bound)

        def leave():
            self._beat(left="failed" if failed else "finished")
            self.store.add(LEFT, 1)
            if failed or self.rank != 0 or "agent" in self.store_host:
                return
            until = time.monotonic() + self.timeout_s
            while self.store.add(LEFT, 0) < self.world and time.monotonic() < until:
                time.sleep(0.1)

        try:
            preemption.within(self.timeout_s + 5, leave, "the other ranks to stop their heartbeats")
        except Exception as e:  # noqa: BLE001 (the store may be gone at the end; nothing to do about it)
            log.debug("heartbeat: leaving: %s", e)

    def judge(self, error: BaseException) -> None:
        """The main thread failed: when a collective failed (a peer's sockets closed), wait up to
        ``peer_timeout_s`` for the verdict, so that a dead peer ends this rank with 75 (the heartbeat's
        exit), not 1. Returns when a peer left after its own error, when no peer is lost, or at once for
        any other error, and at a stop signal (the launcher noticed the failure itself)."""
        if not _communication_error(error) or self._stop.is_set():
            return
        wait = self.timeout_s + 2 * self.interval
        log.warning("a collective failed (%s: %s); waiting up to %.0fs for the heartbeat to tell a lost peer "
                    "from an error", type(error).__name__, str(error)[:200], wait)
        preemption.EXITS.arm("failure", wait + preemption.FAILED_EXIT_S, preemption.EXIT_FAILED,
                             f"a collective failed ({type(error).__name__}) and the shutdown did not end", replace=True)
        self._judging.set()
        until = time.monotonic() + wait
        while not self._gone.is_set() and (left := until - time.monotonic()) > 0:
            if preemption.STOP_SIGNALLED.is_set():
                # The launcher saw the failure itself (torchrun and srun SIGTERM the survivors of a dead rank):
                # its restart or requeue is under way, and waiting out the bound would only be SIGKILLed.
                log.warning("a stop signal arrived while waiting for the heartbeat's verdict: leaving with the "
                            "collective's error")
                return
            self._gone.wait(min(0.2, left))

    # ------------------------------------------------------------------------------------ the threads
    def _beat(self, left: str | None = None) -> None:
        self._seq += 1
        value = {"seq": self._seq, "step": int(self.progress()), "host": self.host, "pid": self.pid}
        if left:
            value["left"] = left
        self.store.set(str(self.rank), json.dumps(value))

    def _read(self, rank: int) -> dict | None:
        if not self.store.check([str(rank)]):
            return None
        beat = json.loads(self.store.get(str(rank)))
        self._known[rank] = beat
        return beat

    def _run(self) -> None:
        """Beat, read ``lost`` and the watched rank; judge the watched rank's silence."""
        now = time.monotonic()
        seen_seq, seen_at, last_loop = None, now, now
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - last_loop > self.interval + self.timeout_s / 2:
                seen_at = now  # this thread was not running (the job suspended): judge from now on
            last_loop = now
            try:
                self._beat()
                if self.store.check([LOST]):
                    return self._leave(json.loads(self.store.get(LOST))["message"], reported=True)
                beat = self._read(self.watched)
                if self.rank != 0 and self.watched != 0:
                    self._read(0)  # rank 0's last step, for the message if its store goes
                if self._judging.is_set() and self._peer_failed():
                    return
                self._last_ok, self._last_error = time.monotonic(), None
            except Exception as e:  # noqa: BLE001 (the store's host may be gone: the supervisor judges it)
                self._last_error = e
                continue
            if beat is not None and beat.get("left"):
                continue  # it stopped beating on purpose (finished, or failed: its own error ends the job)
            if beat is not None and beat["seq"] != seen_seq:
                seen_seq, seen_at = beat["seq"], now
            elif now - seen_at >= self.timeout_s:
                return self._lost(beat, now - seen_at)

    def _supervise(self) -> None:
        """The store's host gone: the beat thread's operations fail, or block (a stopped server answers
        nothing, and a client waits for the store's own timeout, ``distributed.timeout_minutes``)."""
        last_loop = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - last_loop > self.interval + self.timeout_s / 2:
                self._last_ok = now  # this thread was not running (the job suspended)
            last_loop = now
            if self.verdict is not None or self._gone.is_set():
                return
            if now - self._last_ok >= self.timeout_s:
                return self._leave(self._store_lost(self._last_error, now - self._last_ok))

    def _peer_failed(self) -> bool:
        """While judging: a peer that left after an error of its own explains the failed collective."""
        for r in range(self.world):
            if r != self.rank and (self._read(r) or {}).get("left") == "failed":
                log.warning("rank %d left after an error of its own: this rank's failure is not a lost peer", r)
                self._gone.set()
                return True
        return False

    def _lost(self, beat: dict | None, silent_s: float) -> None:
        r = self.watched
        if beat is None:
            what = f"rank {r} never sent a heartbeat in {silent_s:.0f}s"
        else:
            what = (f"rank {r} on host {beat['host']} (pid {beat['pid']}) sent no heartbeat for {silent_s:.0f}s; "
                    f"its last step was {beat['step']} (as of that beat)")
        message = (f"peer lost: {what} (distributed.peer_timeout_s={self.timeout_s:g}). It died or is stopped "
                   "(SIGKILL, SIGSTOP, a frozen or unreachable node) without the launcher noticing.")
        try:
            self.store.compare_set(LOST, "", json.dumps({"message": message, "by": self.rank}))
        except Exception as e:  # noqa: BLE001 (the others then find out by themselves)
            log.warning("heartbeat: could not tell the other ranks: %s", e)
        self._leave(message)

    def _store_lost(self, error: Exception | None, silent_s: float) -> str:
        zero = self._known.get(0)
        step = f"; rank 0's last step was {zero['step']} (host {zero['host']})" if zero else ""
        why = f" ({type(error).__name__}: {str(error)[:160]})" if error is not None else " (no answer)"
        return (f"peer lost: the rendezvous store ({self.store_host}) has not answered for {silent_s:.0f}s"
                f"{why}{step} (distributed.peer_timeout_s="
                f"{self.timeout_s:g}). Its host died or is stopped without the launcher noticing.")

    def _leave(self, message: str, reported: bool = False) -> None:
        """Say it everywhere, leave the mark the sbatch templates requeue on, and end with 75."""
        with self._once:  # the beat thread and the supervisor may both get here
            if self.verdict is not None:
                return
            self.verdict = message
        who = f"rank {self.rank} on {self.host}"
        head = f"{who}: {message}" + (" (reported by another rank)" if reported else "")
        tail = (f" Ending with exit code {preemption.PEER_LOST_EXIT} (PEER_LOST_EXIT) so that the job is requeued; "
                "nothing is saved (this rank may be inside a collective): the newest complete checkpoint stands.")
        log.error("%s%s", head, tail)
        try:
            os.write(2, f"\n[sd_training] {head}{tail}\n".encode(errors="replace"))
        except OSError:
            pass
        if self.peer_lost_file:
            try:
                with open(self.peer_lost_file, "a") as f:
                    f.write(f"{time.strftime('%F %T')} {head}\n")
            except OSError as e:
                log.error("heartbeat: could not write %s (the sbatch templates requeue on it): %s", self.peer_lost_file, e)
        if not preemption.EXITS.enabled:
            log.error("heartbeat: not ending this process (it was not started by train.py)")
            self._gone.set()  # a judging main thread goes on
            return
        # (a judging main thread keeps waiting: the stacks below show where it failed)
        preemption.EXITS.arm("peer lost", 0, preemption.PEER_LOST_EXIT, message.rstrip("."), replace=True)


def _communication_error(error: BaseException) -> bool:
    """An error of a collective or of the store (a peer's sockets closed, a timeout), not of this rank's own."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("Connection reset", "Connection closed", "Broken pipe", "Connection refused", "gloo",
                            "NCCL", "timed out", "Timed out"))
