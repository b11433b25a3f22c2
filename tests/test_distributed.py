"""Real multi-process torch.distributed (gloo): DDP equals one process on the same samples."""

import os
import socket
import sys
from pathlib import Path

import forked
import pytest
import torch
from conftest import train_args
from helpers import max_diff

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(tmp_path, nproc, pipeline, shards, out, *more, **overrides):
    """``nproc`` processes train the run ``out`` (its final parameters are returned, its initial ones are in
    ``out``.init.pt), then, in the same processes, each ``(out, overrides)`` of ``more`` (one start-up)."""
    argv = []
    for o, kw in ((out, overrides), *more):
        argv += ["--"] * bool(argv) + [str(o), *train_args(tmp_path, pipeline, shards, name=f"w{nproc}_{o.stem}", **kw)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, str(HERE / "dist_worker.py"), *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(HERE / "dist_worker.py"), *argv]
    res = forked.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)  # forked: no imports
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return torch.load(out)


# Gradients all-reduced in bf16 (half the traffic) against fp32 in one process. Tolerance: bf16 keeps 8
# mantissa bits, so each reduced gradient is off by up to 2^-8 relative; Adam normalises the update, so a
# weight can move by up to lr x that relative error per step: 3 steps x 1e-3 x 2^-8 x 2 (two ranks'
# roundings) ~ 2.4e-5, plus the fp32 order effects (1e-4 allowed). The fp32 reduction stays within 1e-5.
BF16_REDUCE = {
    "ddp": {"distributed.grad_reduce_dtype": "bf16", "distributed.bucket_cap_mb": 1, "distributed.static_graph": "true"},
    "fsdp": {"distributed.grad_reduce_dtype": "bf16", "distributed.fsdp_unit": "block",
             "distributed.reshard_after_forward": "false"},
}


@pytest.mark.distributed
@pytest.mark.slow
# CPU offload is checked on Flux (the offload path is the strategy's, whatever the family; the SD case took
# 143 s of the suite's time).
# DDP for each family alone (1 rank x 8 == 2 ranks x 4 == 2 ranks x 2 x 2 micro-batches): test_family_conformance.
@pytest.mark.parametrize("strategy, family", [("ddp", "sd"), ("fsdp", "sd"), ("ddp", "sdxl+text_encoders"),
                                              ("ddp", "sd3+text_encoders"), ("fsdp_offload", "flux"), ("ddp", "sd+lora"),
                                              ("fsdp", "sdxl+lora")])
def test_two_ranks_equal_one_rank_double_batch(tmp_path, request, shapes_shards, strategy, family):
    """Also for SDXL (two text encoders, size conditioning), SD3 (both CLIPs trained under DDP), Flux, and
    for FSDP with the shards offloaded to the CPU (CPUOffloadPolicy; the optimizer steps there). For SD under
    DDP and FSDP, also with gradients reduced in bf16 (see BF16_REDUCE)."""
    base = family.split("+")[0]
    pipeline = request.getfixturevalue("tiny_pipeline" if base == "sd" else f"{base}_pipeline")
    # A larger Adam epsilon keeps near-zero gradients (whose fp32 rounding differs with the summation
    # order) from turning into full-size updates of different sign.
    common = {"optimizer.params.learning_rate": 1e-3, "lr_scheduler.params.warmup_length": 0, "optimizer.params.epsilon": 1e-4,
              "distributed.strategy": strategy.removesuffix("_offload")}
    if strategy.endswith("_offload"):
        common["distributed.fsdp_cpu_offload"] = "true"
    if family.endswith("+text_encoders"):  # both SDXL encoders under DDP too (no unused parameters)
        common["model.text_encoder.train"] = "true"
    if family.endswith("+lora"):  # only the adapters train (the frozen base sharded under FSDP)
        common.update({"model.adapter.type": "lora", "model.adapter.rank": 4})
    one = run_worker(tmp_path, 1, pipeline, shapes_shards, tmp_path / "one.pt", **{"system.batch_size": 8}, **common)
    init = torch.load(tmp_path / "one.init.pt")  # the same model before the steps (adapters included)
    # Then, in the same 2 processes (one start-up): 2 ranks x 2 micro-batches x 2 images (accumulation with
    # no_sync across ranks), and for SD 2 ranks x 4 images with gradients reduced in bf16.
    more = [(tmp_path / "acc.pt", {"system.batch_size": 2, "system.gradient_accumulation": 2, **common})]
    if family == "sd":
        more.append((tmp_path / "bf16.pt", {"system.batch_size": 4, **common, **BF16_REDUCE[strategy]}))
    two = run_worker(tmp_path, 2, pipeline, shapes_shards, tmp_path / "two.pt", *more, **{"system.batch_size": 4},
                     **common)
    acc = torch.load(tmp_path / "acc.pt")
    moved = max_diff(one, init)
    assert moved > 1e-4  # the steps changed the weights, so equality below is meaningful
    # Tolerance: the same math summed in a different order (fp32), three AdamW steps at lr 1e-3.
    assert max_diff(one, two) < 1e-5, max_diff(one, two)
    assert max_diff(one, acc) < 1e-5, max_diff(one, acc)
    if family == "sd":
        bf16 = torch.load(tmp_path / "bf16.pt")
        assert max_diff(one, bf16) < 1e-4, max_diff(one, bf16)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("env, backend, words", [
    ({"SLURM_GPUS_ON_NODE": "8"}, "auto", "SLURM_GPUS_ON_NODE=8 asks for GPUs"),
    ({"SLURM_TRES_PER_TASK": "cpu=6,gres/gpu=1"}, "auto", "asks for GPUs"),
    ({}, "nccl", "distributed.dist_backend=nccl asks for GPUs"),
])
def test_auto_device_without_a_gpu_where_one_was_meant_is_an_error(monkeypatch, env, backend, words):
    from sd_training.config import ConfigError
    from sd_training.distributed import SLURM_GPU_VARS, pick_device

    for var in SLURM_GPU_VARS + ("SLURM_TRES_PER_TASK", "SLURM_JOB_GRES"):
        monkeypatch.delenv(var, raising=False)
    assert pick_device("auto", 0, backend="auto").type == "cpu"  # nothing asks for a GPU: the CPU is fine
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=words):
        pick_device("auto", 0, backend=backend)
    with pytest.raises(ConfigError, match="system.device=cuda but no GPU is visible"):
        pick_device("cuda", 0)
    assert pick_device("cpu", 0, backend=backend).type == "cpu"  # explicit CPU is the user's choice


def test_system_tf32_sets_both_cuda_math_flags_and_the_mfu_peak_follows():
    """system.tf32 sets TF32 for matmuls and convolutions on a CUDA device (the flags exist without a GPU);
    on the CPU nothing changes; MFU counts fp32 against the TF32 peak exactly when TF32 is on."""
    from sd_training.config.schema import SystemConfig
    from sd_training.distributed import configure_math
    from sd_training.speed.flops import precision_key

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        assert SystemConfig().tf32 is True
        configure_math(torch.device("cuda", 0), False)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
        assert precision_key("no") == "fp32"
        configure_math(torch.device("cpu"), True)  # the CPU has no TF32: left alone
        assert torch.backends.cuda.matmul.allow_tf32 is False
        configure_math(torch.device("cuda", 0), True)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
        assert precision_key("no") == "tf32" and precision_key(torch.bfloat16) == "bf16"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
