"""Exact resume: N steps straight == k steps, process killed, restarted, N-k steps (bit-identical)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest
import torch
from conftest import descendants, kill_tree, train_args
from helpers import alive

from sd_training.checkpoint import Checkpointer, complete_steps

ROOT = Path(__file__).resolve().parents[1]
N = 6  # checkpoints at 3 and 6: killed after 3, the restart trains 4-6


def args_for(tmp_path, pipeline, shards, name, **kw):
    base = {
        "experiment.num_examples_to_see": 4 * N,
        "experiment.checkpoint_every": 3,
        "experiment.keep_last_checkpoints": 10,
        "experiment.sample_per_prompt": 0,
        "dataset.params.resampled": "false",
        "model.use_ema": "true",
        "model.ema.decay": 0.9,
        # 32 px (4x4 latents): a quarter of the convolutions' work at 64 px. bf16 autocast on a CPU without
        # AVX-512 BF16 runs them in ATen's slow reference kernels (a tiny UNet step 19x the fp32 one).
        "dataset.params.resolution": 32,
    }
    base.update(kw)
    return train_args(tmp_path, pipeline, shards, name=name, **base)


def launch(tmp_path, args, nproc=1, fresh=False):
    """``python train.py`` (``nproc`` ranks: as torchrun starts them), forked from a process that has imported
    torch and diffusers (tests/forked.py); ``fresh``: a new interpreter (a test of what happens while it
    imports)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "train.py"), *args]
    if fresh:
        return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return forked.popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        start_new_session=True, nproc=nproc)


def finish(p, timeout=600):
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-4000:]
    return out


def kill_after_checkpoint(p, ckpt_root: Path, step: int, timeout=600):
    """SIGKILL the whole process group as soon as checkpoint ``step`` is complete."""
    deadline = time.time() + timeout
    while step not in complete_steps(ckpt_root):
        assert p.poll() is None, p.stdout.read()[-4000:]
        assert time.time() < deadline
        time.sleep(0.02)
    tree = descendants(p.pid)
    kill_tree(p.pid)  # torchrun and the trainers it started in sessions of their own
    p.wait()
    # The ranks (orphans once their launcher is gone) may still be exiting on a loaded machine, rank 0 still
    # holding the run folder's lock: the next start would be refused. Wait until each has exited.
    gone_by = time.time() + 60
    while any(alive(pid) for pid in tree):
        assert time.time() < gone_by, [pid for pid in tree if alive(pid)]
        time.sleep(0.02)


def final_state(run: Path):
    """Plain files (DDP) or the DCP shards (FSDP), read back as full tensors."""
    folder = run / "checkpoints" / f"step_{N:08d}"
    shared, _, ts = Checkpointer.load(folder, 0)
    if (folder / "sharded").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(folder / "sharded"), str(folder.parent / "full.pt"))
        shared.update(torch.load(folder.parent / "full.pt", weights_only=False))
    return shared, ts


def assert_same(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (path, sorted(set(a) ^ set(b))[:5])
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a} != {b}"


def losses(run: Path):
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("nproc, strategy, workers, precision, resampled", [
    (1, "ddp", 0, "no", False),
    # 1 rank, 2 loader workers, bf16: every family in test_family_conformance (test_kill_and_resume_is_bit_identical).
    pytest.param(2, "ddp", 1, "no", False, marks=pytest.mark.distributed),
    # 3 workers on a rank that holds 2 of the 4 shards: more workers than shards (resampled mode).
    pytest.param(2, "fsdp", 3, "bf16", True, marks=pytest.mark.distributed),
])
def test_kill_and_resume_is_bit_identical(tmp_path, tiny_pipeline, shapes_shards, nproc, strategy, workers, precision,
                                          resampled):
    bs = 4 // nproc
    kw = {"system.batch_size": bs, "distributed.strategy": strategy, "system.workers": workers,
          "model.mixed_precision": precision, "dataset.params.resampled": str(resampled).lower()}
    straight = args_for(tmp_path, tiny_pipeline, shapes_shards, "straight", **kw)
    finish(launch(tmp_path, straight, nproc))

    resumed = args_for(tmp_path, tiny_pipeline, shapes_shards, "resumed", **kw)
    run = tmp_path / "runs" / "resumed"
    kill_after_checkpoint(launch(tmp_path, resumed, nproc), run / "checkpoints", 3)
    first = complete_steps(run / "checkpoints")
    assert max(first) < N, first  # the killed run left steps for the restart to train
    out = finish(launch(tmp_path, resumed, nproc))
    assert "resumed from" in out
    a, ta = final_state(tmp_path / "runs" / "straight")
    b, tb = final_state(run)
    for name in ("unet", "ema", "optimizer", "lr_scheduler"):
        assert_same(a[name], b[name], name)
    # The exported pipeline holds the final weights.
    from diffusers import UNet2DConditionModel

    exported = UNet2DConditionModel.from_pretrained(run / "current_pipeline" / "unet").state_dict()
    raw = a["unet"] if strategy == "ddp" else a["unet"]
    for k, v in exported.items():
        assert torch.equal(v, raw[k].to(v.dtype)), k
    assert ta["step"] == tb["step"] == N and ta["images_seen"] == tb["images_seen"] == 4 * N
    # The restarted run logged the same losses for the steps it re-did or continued.
    la, lb = losses(tmp_path / "runs" / "straight"), losses(run)
    for s in range(max(first) + 1, N + 1):
        assert la[s] == lb[s], (s, la[s], lb[s])


def finish_stopped(p, timeout=600):
    """A run stopped by a signal and not requeued exits 75 (EX_TEMPFAIL), never 0."""
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 75, out[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.faults
def test_signal_to_the_whole_process_group_with_loader_workers_saves_then_exits(tmp_path, tiny_pipeline, shapes_shards,
                                                                                sig):
    """SLURM's scancel/preemption/time limit (SIGTERM) and Ctrl-C (SIGINT) reach every process of the job,
    the loader workers included: the workers must survive them, the main process saves at the step
    boundary and exits 75 (stopped, not requeued: not under SLURM); a restart finishes the run."""
    total = 12  # the signal lands at step 3 or 4: the run is far from its end (a bf16 step is ~1 s here)
    args = args_for(tmp_path, tiny_pipeline, shapes_shards, "term", **{
        "experiment.checkpoint_every": 1000, "experiment.num_examples_to_see": 4 * total, "system.workers": 2,
        "model.mixed_precision": "bf16", "dataset.params.resolution": 32})
    run = tmp_path / "runs" / "term"
    p = launch(tmp_path, args)
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
        assert p.poll() is None and time.time() < deadline
        time.sleep(0.05)
    os.killpg(p.pid, sig)  # the trainer and its two loader workers
    out = finish_stopped(p)
    assert "stopped at step" in out and f"by {sig.name}" in out and "killed by signal" not in out
    assert "not requeued: exit code 75" in out
    steps = complete_steps(run / "checkpoints")
    assert len(steps) == 1 and 3 <= steps[0] < total  # saved at the step boundary after the signal
    out = finish(launch(tmp_path, args))
    assert "resumed from" in out and "at step %d" % steps[0] in out
    assert complete_steps(run / "checkpoints")[-1] == total


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (Linux: /proc/PID/status SigCgt)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except FileNotFoundError:
        pass
    return False


@pytest.mark.slow
@pytest.mark.faults
def test_signal_during_set_up_is_kept_and_stops_before_the_first_step(tmp_path, tiny_pipeline, shapes_shards):
    """The handler is installed before the imports and the model loading: a SIGTERM that arrives while
    the run is still setting up stops it before the first step (no training, nothing to save), with the
    exit code of a stopped run rather than death by signal (143)."""
    args = args_for(tmp_path, tiny_pipeline, shapes_shards, "early")
    p = launch(tmp_path, args, fresh=True)
    deadline = time.time() + 60
    while not _catches(p.pid, signal.SIGTERM):
        assert p.poll() is None and time.time() < deadline
        time.sleep(0.005)
    p.send_signal(signal.SIGTERM)  # within milliseconds of start: imports and set-up are still ahead
    out = finish_stopped(p)
    assert "stop requested during set-up (SIGTERM)" in out
    assert "step 1/" not in out and complete_steps(tmp_path / "runs" / "early" / "checkpoints") == []


KILL_DURING_SAVE = r"""
import os, signal, sys, torch
from sd_training import checkpoint
root, kill_at = sys.argv[1], int(sys.argv[2])
ck = checkpoint.Checkpointer(root, keep_last=1)
calls = {"n": 0}
real_save = torch.save
def save(*a, **k):
    calls["n"] += 1
    if calls["n"] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(*a, **k)
torch.save = save
ck.save(2, {"unet": {"w": torch.full((1000,), 2.0)}, "optimizer": {"s": 2}}, {"rng": 2, "data": 2}, {"step": 2}, "c: 2", rank=0)
"""


@pytest.mark.faults
def test_sigkill_at_any_point_of_a_save_keeps_previous_checkpoint(tmp_path):
    root = tmp_path / "ck"
    Checkpointer(root, keep_last=1).save(
        1, {"unet": {"w": torch.full((1000,), 1.0)}, "optimizer": {"s": 1}}, {"rng": 1, "data": 1}, {"step": 1}, "c: 1", rank=0)
    # torch.save is called once per file: rank file, unet, optimizer. Kill before each, and after all. Each
    # save is a process forked from one that imported torch once (tests/forked.py), killed by a real SIGKILL.
    for kill_at in (1, 2, 3, 4):
        res = forked.run([sys.executable, "-c", KILL_DURING_SAVE, str(root), str(kill_at)], capture_output=True,
                         timeout=300)
        latest = Checkpointer(root).latest()
        if kill_at <= 3:
            assert res.returncode == -signal.SIGKILL
            assert latest.name == "step_00000001"
            shared, per_rank, ts = Checkpointer.load(latest, 0)
            assert torch.equal(shared["unet"]["w"], torch.full((1000,), 1.0)) and ts == {"step": 1}
        else:  # the save completed: step 2 is the newest and step 1 was retired (keep_last=1)
            assert res.returncode == 0, res.stderr
            assert latest.name == "step_00000002"
            assert complete_steps(root) == [2]


class _RunsCode:
    """Unpickling this writes a file: the stand-in for a pickle that runs code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "ran"))


@pytest.mark.faults
def test_checkpoints_load_only_their_own_files_and_only_tensors(tmp_path):
    root = tmp_path / "ck"
    folder = Checkpointer(root, keep_last=1).save(
        1, {"unet": {"w": torch.ones(3)}, "optimizer": {"step": 1}}, {"rng": {"a": torch.zeros(2)}, "data": {"i": 3}},
        {"step": 1}, "c: 1", rank=0)
    marker = tmp_path / "ran.txt"
    torch.save(_RunsCode(marker), folder / "stray.pt")  # a file the checkpoint does not list: never opened
    shared, per_rank, state = Checkpointer.load(folder, 0)
    assert set(shared) == {"unet", "optimizer"} and state == {"step": 1} and per_rank["data"] == {"i": 3}
    torch.save({"state": _RunsCode(marker)}, folder / "optimizer.pt")  # a listed file that would run code
    with pytest.raises(RuntimeError, match=r"optimizer\.pt holds objects other than tensors"):
        Checkpointer.load(folder, 0)
    assert not marker.exists()


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MiB filesystem (tmpfs); skipped where this process may not mount one."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.faults
def test_a_full_disk_is_named_and_keeps_the_previous_checkpoint(small_disk):
    from sd_training.checkpoint import CheckpointWriteError, check_writable
    from sd_training.config import ConfigError

    root = small_disk / "ck"
    Checkpointer(root, keep_last=1).save(1, {"unet": {"w": torch.ones(1000)}}, {"rng": 1}, {"step": 1}, "c: 1", rank=0)
    with pytest.raises(CheckpointWriteError, match="no space left on the device"):
        Checkpointer(root, keep_last=1).save(2, {"unet": {"w": torch.ones(2_000_000)}}, {"rng": 2}, {"step": 2}, "c: 2",
                                             rank=0)
    assert complete_steps(root) == [1] and Checkpointer.load(root / "step_00000001", 0)[2] == {"step": 1}
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(ConfigError, match="Read-only file system"):
        check_writable(root)
