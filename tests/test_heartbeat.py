"""A dead or stopped peer ends the job for a requeue (sd_training/distributed/heartbeat.py).

Two ranks are started directly with the env:// variables (no torchrun, no srun: no launcher notices a rank's
death), rank 0 serving the store. A rank SIGSTOPped or SIGKILLed after a checkpoint ends its survivor with
exit code 75 within distributed.peer_timeout_s (+ one beat and some slack for a loaded machine), with a
message naming the rank, its host and its last step, and the line the sbatch templates requeue on; both
ranks started again after the SIGSTOP (the requeued job) resume from the newest complete checkpoint and finish. A save that
sleeps longer than the bound does not trip it.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import forked
import pytest
import torch.distributed as dist
from conftest import train_args

from sd_training.checkpoint import complete_steps
from sd_training.distributed.heartbeat import PREFIX, Heartbeat, interval_for
from sd_training.run import preemption
from sd_training.run.preemption import PEER_LOST_EXIT

pytestmark = [pytest.mark.distributed, pytest.mark.faults]

ROOT = Path(__file__).resolve().parents[1]
BOUND = 5.0  # distributed.peer_timeout_s of these runs
SLACK = 10.0  # a loaded 2-core machine: logging the stacks, the exit
STEPS = 8


def run_args(tmp_path, pipeline, shards, name, **kw):
    return train_args(tmp_path, pipeline, shards, name=name, **{
        "experiment.num_examples_to_see": 2 * STEPS,
        "experiment.checkpoint_every": 2,
        "experiment.keep_last_checkpoints": 10,
        "experiment.checkpoint_async": "false",
        "experiment.sample_per_prompt": 0,
        "system.batch_size": 1,
        "dataset.params.resolution": 32,
        "dataset.params.resampled": "false",
        "distributed.peer_timeout_s": BOUND,
        **kw,
    })


def start_ranks(tmp_path, args, tag, world=2, code=None):
    """``world`` processes of ``train.py`` (or of ``-c code``), each told its rank by RANK/WORLD_SIZE alone:
    nothing watches them but themselves. Their output in ``tmp_path/<tag>_rank<N>.out``."""
    port = forked._free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "SD_TRAINING_PEER_LOST_FILE": str(tmp_path / "peer-lost")}
        cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, str(ROOT / "train.py"), *args]
        with open(tmp_path / f"{tag}_rank{r}.out", "w") as out:
            procs.append(forked.popen(cmd, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def output(tmp_path, tag, rank):
    return (tmp_path / f"{tag}_rank{rank}.out").read_text()


def wait_for_checkpoint(procs, ckpts: Path, step: int, timeout=300):
    deadline = time.time() + timeout
    while step not in complete_steps(ckpts):
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        assert time.time() < deadline, "no checkpoint"
        time.sleep(0.02)


def end(p):
    try:
        os.kill(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(60)


def wait_all(procs, timeout=300) -> list[int]:
    """The exit codes of ``procs``; any still running after ``timeout`` is killed (and the wait fails)."""
    try:
        return [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            end(p)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "SIGKILL"])
def test_a_lost_peer_ends_the_survivor_with_75_and_the_requeued_job_resumes(tmp_path, tiny_pipeline, shapes_shards, sig):
    args = run_args(tmp_path, tiny_pipeline, shapes_shards, "lost")
    run = tmp_path / "runs" / "lost"
    ranks = start_ranks(tmp_path, args, "first")
    try:
        wait_for_checkpoint(ranks, run / "checkpoints", 2)
        t0 = time.monotonic()
        os.kill(ranks[1].pid, sig)
        code = ranks[0].wait(BOUND + interval_for(BOUND) + SLACK + 30)
        took = time.monotonic() - t0
    finally:
        for p in ranks:
            end(p)
    out = output(tmp_path, "first", 0)
    assert code == PEER_LOST_EXIT, out[-3000:]
    # Silent for the bound: from its last beat (up to one beat before the signal) to the verdict.
    assert BOUND - interval_for(BOUND) - 0.5 <= took <= BOUND + interval_for(BOUND) + SLACK, (took, out[-3000:])
    m = re.search(rf"peer lost: rank 1 on host {re.escape(socket.gethostname())} \(pid {ranks[1].pid}\) sent no "
                  r"heartbeat for \d+s; its last step was (\d+)", out)
    assert m, out[-3000:]
    # As of its last beat, up to a beat (1 s) before the signal: steps of 32 px are faster than beats, so a beat
    # sent before step 1 may be the last one (seen once on an idle machine).
    assert 0 <= int(m.group(1)) <= STEPS
    assert "exit code 75" in out and "Where each thread was" in out, out[-3000:]  # the survivor's stacks
    assert "rank 1 on host" in (tmp_path / "peer-lost").read_text()  # what the sbatch templates requeue on
    if sig == signal.SIGKILL:
        return  # the requeued job is the same after either: started again once (below), after SIGSTOP
    saved = max(complete_steps(run / "checkpoints"))
    codes = wait_all(start_ranks(tmp_path, args, "requeued"))  # the requeued job: both ranks again
    out = output(tmp_path, "requeued", 0)
    assert codes == [0, 0], out[-3000:]
    assert f"resumed from {run / 'checkpoints'}" in out and f"at step {saved} " in out, out[-3000:]
    assert max(complete_steps(run / "checkpoints")) == STEPS


# Rank 1's checkpoint save sleeps twice the bound (a slow file system): its heartbeat thread keeps beating,
# rank 0 waits in the next collective, and the run finishes.
SLOW_SAVE = f"""
import runpy, sys, time, os
from sd_training.checkpoint import CheckpointManager
save = CheckpointManager.save
def slow_save(self, *a, **k):
    if os.environ["RANK"] == "1" and self.state.step == 2:
        time.sleep({2 * BOUND})
    return save(self, *a, **k)
CheckpointManager.save = slow_save
sys.argv = [{str(ROOT / "train.py")!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_save_longer_than_the_bound_does_not_trip_it(tmp_path, tiny_pipeline, shapes_shards):
    args = run_args(tmp_path, tiny_pipeline, shapes_shards, "slow", **{"experiment.num_examples_to_see": 2 * 4})
    ranks = start_ranks(tmp_path, args, "slow", code=SLOW_SAVE)
    t0 = time.monotonic()
    codes = wait_all(ranks)
    out = output(tmp_path, "slow", 0)
    assert codes == [0, 0], out[-3000:]
    assert time.monotonic() - t0 > 2 * BOUND  # the sleep happened
    assert "peer lost" not in out + output(tmp_path, "slow", 1)
    assert not (tmp_path / "peer-lost").exists()


# ------------------------------------------------------------------ heartbeats alone (no training), bound 2 s
# A process with the store's server (rank 0, as env:// gives it) and rank 0's heartbeat; it prints its verdict.
RANK_PROCESS = """
import sys, time
import torch.distributed as dist
from sd_training.distributed.heartbeat import PREFIX, Heartbeat
rank, port, bound, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
beat = Heartbeat(dist.PrefixStore(PREFIX, store.clone()), rank, 2, bound, "rank 0's process")
beat.start()
print("beating", flush=True)
time.sleep(seconds)
print("verdict:", beat.verdict, flush=True)
beat.stop()
"""


def rank_process(tmp_path, rank, port, bound, seconds):
    return forked.popen([sys.executable, "-c", RANK_PROCESS, str(rank), str(port), str(bound), str(seconds)],
                        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_line(p, text, timeout=120):
    deadline = time.time() + timeout
    for line in p.stdout:
        if text in line:
            return
        assert time.time() < deadline
    raise AssertionError(f"{p.args[:3]} ended before {text!r}")


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "SIGKILL"])
def test_the_store_host_lost_is_a_lost_peer_named_with_its_address(tmp_path, sig):
    """Rank 0's process serves the store: stopped, the store's answers time out; killed, its connections
    close. Either way rank 1 (here, in this process) names it within the bound."""
    bound, port = 2.0, forked._free_port()
    zero, one = rank_process(tmp_path, 0, port, bound, 300), None
    try:
        wait_line(zero, "beating")
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
        one = Heartbeat(dist.PrefixStore(PREFIX, store.clone()), 1, 2, bound, f"rank 0's process at 127.0.0.1:{port}")
        one.start()
        time.sleep(2 * bound)
        assert one.verdict is None  # rank 0 beats: nothing to say
        os.kill(zero.pid, sig)
        t0 = time.monotonic()
        while one.verdict is None and time.monotonic() - t0 < bound + 3 * one.interval + SLACK:
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        end(zero)
        if one is not None:
            one.stop()  # its threads end (they would beat at a dead store for the rest of this worker's life)
    assert one.verdict is not None, "no verdict"
    assert f"the rendezvous store (rank 0's process at 127.0.0.1:{port}) has not answered" in one.verdict
    assert "rank 0's last step was 0" in one.verdict
    assert bound - one.interval <= took <= bound + 2 * one.interval + SLACK, took


def test_a_suspended_job_judges_nobody_and_a_finished_rank_is_not_lost(tmp_path):
    """Both ranks stopped together for three bounds (``scontrol suspend``) and continued: each watcher was
    not running either, so nobody is judged lost; then rank 1 finishes first and leaves, rank 0 goes on
    beating alone past the bound: a rank that left on purpose is not lost."""
    bound, port = 1.5, forked._free_port()
    ranks = [rank_process(tmp_path, 0, port, bound, 5 * bound + 3)]
    wait_line(ranks[0], "beating")
    ranks.append(rank_process(tmp_path, 1, port, bound, 3 * bound))
    try:
        wait_line(ranks[1], "beating")
        for p in ranks:
            os.kill(p.pid, signal.SIGSTOP)
        time.sleep(3 * bound)
        for p in ranks:
            os.kill(p.pid, signal.SIGCONT)
        outs = [p.communicate(timeout=120)[0] for p in ranks]
    finally:
        for p in ranks:
            end(p)
    assert [p.returncode for p in ranks] == [0, 0], outs
    for out in outs:
        assert "verdict: None" in out and "peer lost" not in out, out


def test_a_failed_collective_after_a_peers_own_error_is_not_a_lost_peer():
    """Rank 1 fails with an error of its own and says so as it leaves; rank 0's collective then fails
    ("Connection reset by peer"): its judge returns within a beat or two, with no verdict (exit code 1,
    as before), instead of waiting out the bound."""
    bound = 4.0
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    beats = [Heartbeat(dist.PrefixStore(PREFIX, server.clone()), r, 2, bound, "rank 0's process") for r in (0, 1)]
    for b in beats:
        b.start()
    beats[1].stop(failed=True)
    t0 = time.monotonic()
    beats[0].judge(RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer"))
    took = time.monotonic() - t0
    beats[0].stop(failed=True)
    assert beats[0].verdict is None
    assert took < bound, took


def test_a_stop_signal_ends_the_wait_for_a_verdict():
    """torchrun and srun SIGTERM the survivors of a dead rank: a survivor whose collective failed while its
    peer went silent (its verdict is a bound away) leaves at once with the collective's error, where it
    waited until the launcher SIGKILLed it 30 s later."""
    bound = 60.0
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    beats = [Heartbeat(dist.PrefixStore(PREFIX, server.clone()), r, 2, bound, "rank 0's process") for r in (0, 1)]
    beats[0].start()
    beats[1]._beat()  # rank 1 beat once, then went silent (killed)
    flag = preemption.StopFlag().install()
    try:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        beats[0].judge(RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer"))
        took = time.monotonic() - t0
    finally:
        flag.uninstall()
        preemption.STOP_SIGNALLED.clear()
        beats[0].stop(failed=True)
    assert flag.signal_name == "SIGTERM" and beats[0].verdict is None
    assert 0.9 <= took < 5, took
