"""Restarts inside a job (issue 26): under ``torchrun --max-restarts 1`` one rank is SIGKILLed mid-training
(as the OOM killer or a bad node would); torchrun restarts the group, which resumes from the newest
checkpoint and finishes: exit 0, the final step reached, every step logged once.

What makes it work: the survivor notices the dead peer at once (gloo: "Connection reset by peer"; blocked
in a collective it exits 10 s after torchrun's SIGTERM) and ends its shutdown promptly; the restarted
ranks keep their store keys apart from the dead attempt's (``distributed.attempt_store``); the killed
rank's loader worker dies with it (``PR_SET_PDEATHSIG``) and holds no lock, and the restarted rank 0
takes the dead holder's lock over with a line in the log.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import descendants, kill_tree, train_args
from test_distributed import free_port

from sd_training.checkpoint import Checkpointer, complete_steps

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.faults, pytest.mark.distributed]
STEPS = 6


def stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the name (state, ppid, ...), or None for a process that is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields


def ranks_of(launcher: int) -> dict[int, int]:
    """RANK -> pid of the trainers torchrun started (its children; loader workers are their children)."""
    found = {}
    for pid in descendants(launcher):
        fields = stat(pid)
        if fields is None or int(fields[1]) != launcher:
            continue
        try:
            env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        except OSError:
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = pid
    return found


def children_of(pid: int) -> list[int]:
    return [p for p in descendants(pid) if (fields := stat(p)) is not None and int(fields[1]) == pid]


def test_a_rank_killed_under_torchrun_max_restarts_comes_back_resumed_and_finishes(tmp_path, tiny_pipeline,
                                                                                   shapes_shards):
    args = train_args(tmp_path, tiny_pipeline, shapes_shards, name="r", **{
        "experiment.num_examples_to_see": 4 * STEPS, "system.batch_size": 2, "experiment.checkpoint_every": 2,
        "experiment.keep_last_checkpoints": 10, "experiment.sample_per_prompt": 0, "dataset.params.resolution": 32,
        "system.workers": 1})
    run = tmp_path / "runs" / "r"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(ROOT / "train.py"), *args]
    p = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not complete_steps(run / "checkpoints"):
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()[-4000:]
            time.sleep(0.05)
        ranks = ranks_of(p.pid)
        assert sorted(ranks) == [0, 1], ranks
        victim, survivor = ranks[0], ranks[1]  # rank 0: it holds the run folder's lock and has a loader worker
        workers = children_of(victim)
        newest = complete_steps(run / "checkpoints")[-1]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        watch, gone = [survivor, *workers], {}  # pid -> seconds after the kill it was gone
        while len(gone) < len(watch) and time.monotonic() - killed < 60:
            for pid in watch:
                if pid not in gone and stat(pid) is None:
                    gone[pid] = round(time.monotonic() - killed, 2)
            time.sleep(0.02)
        out, _ = p.communicate(timeout=300)
        took = time.monotonic() - killed
    finally:
        kill_tree(p.pid)
    print(f"survivor exited {gone.get(survivor)}s after the kill, the victim's workers "
          f"{[gone.get(w) for w in workers]}s; the job ended {took:.0f}s after the kill")
    assert p.returncode == 0, out[-5000:]
    # The survivor ended by itself, well before torchrun's 30 s SIGKILL; the victim's worker died with it.
    assert gone.get(survivor) is not None and gone[survivor] < 20, (gone, out[-5000:])
    assert workers and all(gone.get(w) is not None and gone[w] < 2 for w in workers), (gone, workers)
    # Restarted, resumed from the newest checkpoint (or a newer one completed after the kill was decided), finished.
    assert "resumed from" in out, out[-5000:]
    resumed_at = int(out.split("resumed from", 1)[1].split(" at step ", 1)[1].split()[0])
    assert resumed_at >= newest, (resumed_at, newest)
    assert "run folder lock: its last holder" in out and "taken over" in out
    assert complete_steps(run / "checkpoints")[-1] == STEPS
    Checkpointer.load(run / "checkpoints" / f"step_{STEPS:08d}", 0)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))  # continuous, each step once
    assert took < 240, took
