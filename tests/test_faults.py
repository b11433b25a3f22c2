"""Fault injection: kill -9 at many points of checkpoint saves and pipeline exports, in one run folder,
restart after each, and the run still ends at its final step with every step logged once, a loadable
checkpoint and a loadable pipeline, and nothing of it lost. The other faults (signals, stalls, bombs,
bad values, full disks, a second run, a changed config) have their own tests marked ``faults``; the
summary at the end of the pytest run counts them all (``pytest -m faults`` runs only these)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import forked
import pytest
import torch
from conftest import train_args

from sd_training.checkpoint import Checkpointer, complete_steps

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.faults

# Runs train.py again and again in one folder, each time with every file write of a save or export counted
# (torch.save, safetensors files, directory renames); at write number N the run kills itself with SIGKILL,
# mid-save. Each run is a process forked from one that imported torch and diffusers once (tests/forked.py; a
# fresh interpreter would spend ~10 s of CPU importing them again for each of the 12 runs): it runs train.py's
# main as ``python train.py`` does and dies by a real SIGKILL.
KILLER = r"""
import os, runpy, signal, sys
import safetensors.torch
import torch
train_py, kill_at, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
count = [0]
def counted(fn):
    def wrapper(*a, **k):
        count[0] += 1
        if count[0] == kill_at:
            sys.stdout.write(f"KILLED at write {kill_at} ({fn.__name__})\n")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*a, **k)
    wrapper.__name__ = fn.__name__
    return wrapper
torch.save = counted(torch.save)
safetensors.torch.save_file = counted(safetensors.torch.save_file)
os.replace = counted(os.replace)
sys.argv = [train_py, *args]
runpy.run_path(train_py, run_name="__main__")  # exits (SystemExit) with the run's code
"""


def run_until_killed(args: list[str], point: int, cwd: Path, env: dict) -> tuple[int, str]:
    """One run of the chain: its exit code (-9 when it killed itself) and its output."""
    res = forked.run([sys.executable, "-c", KILLER, str(ROOT / "train.py"), str(point), *args], cwd=cwd, env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    return res.returncode, res.stdout


# Points of the chain: each restart dies at its n-th write; the writes of one checkpoint and one export
# number about 15, so these fall into checkpoint files, the COMPLETE rename, retention, the pipeline
# files and the pipeline swap of different saves.
KILL_POINTS = [1, 2, 4, 6, 8, 11, 14, 17, 21, 26, 31, 37]
TOTAL = 16


def test_kill_9_at_many_points_of_saves_and_exports_loses_nothing(tmp_path, tiny_pipeline, shapes_shards):
    args = train_args(tmp_path, tiny_pipeline, shapes_shards, name="chain", **{
        "experiment.num_examples_to_see": 2 * TOTAL, "system.batch_size": 2, "experiment.checkpoint_every": 2,
        "experiment.save_every": 4, "experiment.keep_last_checkpoints": 2, "experiment.keep_checkpoint_every": 8,
        "experiment.sample_per_prompt": 0, "dataset.params.resolution": 32, "model.use_ema": "true",
        "dataset.params.resampled": "false"})
    run = tmp_path / "runs" / "chain"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed, seen_steps = 0, set()
    for point in KILL_POINTS:
        code, out = run_until_killed(args, point, tmp_path, env)
        if code == 0:
            break  # the run finished before this point: the chain is over
        assert code == -9 and f"KILLED at write {point}" in out, out[-3000:]
        killed += 1
        # After every kill: the newest complete checkpoint loads, and checkpoints never go backwards.
        steps = complete_steps(run / "checkpoints")
        if steps:
            Checkpointer.load(run / "checkpoints" / f"step_{steps[-1]:08d}", 0)
            assert steps[-1] >= max(seen_steps, default=0)
            seen_steps.update(steps)
        # An export that existed stays loadable: the swap is atomic or repaired at start-up.
    assert killed >= 10, killed
    res = forked.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, timeout=300, env=env,
                     capture_output=True, text=True)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, TOTAL + 1)), steps  # every step logged once, none missing
    assert complete_steps(run / "checkpoints")[-1] == TOTAL and 8 in complete_steps(run / "checkpoints")
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(run / "current_pipeline", local_files_only=True)
    final = Checkpointer.load(run / "checkpoints" / f"step_{TOTAL:08d}", 0)[0]["unet"]
    for k, v in pipe.unet.state_dict().items():
        assert torch.equal(v, final[k].to(v.dtype)), k
    assert not list(run.glob("*.old")) and not list(run.glob("*.tmp"))
