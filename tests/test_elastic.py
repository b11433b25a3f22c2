"""Elastic resume: a run killed and resumed on other rank counts trains on the same samples, step by step,
and ends where the uninterrupted run ends (issue 13).

The run: 6 optimizer steps of a global batch of 12 (``system.global_batch_size``) from 12 canonical readers,
EMA, loader workers. The reference trains on 4 ranks without a stop. The elastic run starts on 4 ranks
(DDP), is SIGKILLed after the checkpoint of step 2, resumes on 2 ranks under FSDP (6 micro-batches of 1 per
rank and step instead of 3), is SIGKILLed after step 4 and finishes on 3 ranks under DDP (4 per rank and step).
"""

from pathlib import Path

import pytest
from elastic_runs import drop_checkpoints_after, elastic_args, full_checkpoint, steps_keys
from helpers import largest, max_diff
from test_resume import finish, kill_after_checkpoint, launch, losses

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 6
GLOBAL_BATCH = 12
# Largest absolute difference allowed between the final states, and the relative loss difference per step.
# fp32: the same samples with the same per-sample noise and timesteps give the same gradients up to the order
# in which 12 micro-batch gradients are summed (3 per rank x 4 ranks, 6 x 2, 4 x 3) and FSDP's reduce-scatter
# sums them: a few fp32 ulps at the weights' magnitude of ~1 (measured 1.2e-7 under DDP throughout, 2.4e-7 UNet,
# 1.2e-7 EMA, 4e-9 optimizer moments with FSDP in the middle segment).
# Other samples, noise or timesteps would differ in every weight by about a learning rate (1e-3) per step; the
# per-step key sets, compared exactly below, catch other samples regardless.
TOL = {"no": {"unet": 1e-6, "ema": 1e-6, "optimizer": 1e-7, "loss": 1e-5}}


def args(tmp_path, pipeline, shards, name, workers, precision="bf16", strategy="ddp"):
    return elastic_args(tmp_path, pipeline, shards, name, STEPS, GLOBAL_BATCH, **{
        "system.workers": workers, "dataset.params.canonical_readers": 12, "model.mixed_precision": precision,
        "distributed.strategy": strategy})


def kill_at(p, run: Path, step: int) -> None:
    """SIGKILL once checkpoint ``step`` is complete; the next start resumes from ``step``."""
    kill_after_checkpoint(p, run / "checkpoints", step)
    drop_checkpoints_after(run, step)


def final(run: Path) -> dict:
    shared, ts = full_checkpoint(run, STEPS)
    assert ts["step"] == STEPS and ts["images_seen"] == STEPS * GLOBAL_BATCH
    return shared


# One run (fp32, where the states must agree to a few ulps) that switches the strategy at each restart too.
# bf16 (autocast, FSDP's bf16 gathers and reductions) changes no sample, noise or timestep: the elastic data
# path is the same; bf16 checkpoints resharded across strategies and rank counts are test_reshard's (bit for
# bit), bf16 kill-and-resume under FSDP with loader workers test_resume's (bit-identical).
@pytest.mark.parametrize("precision, strategies", [("no", ("ddp", "fsdp", "ddp"))])
def test_killed_run_resumed_on_2_then_3_ranks_trains_on_the_same_samples(tmp_path, tiny_pipeline, shapes_shards,
                                                                         precision, strategies):
    ref_run = tmp_path / "runs" / "ref"
    finish(launch(tmp_path, args(tmp_path, tiny_pipeline, shapes_shards, "ref", 1, precision, strategies[0]), nproc=4))

    run = tmp_path / "runs" / "elastic"
    first, second, third = (args(tmp_path, tiny_pipeline, shapes_shards, "elastic", w, precision, s)
                            for w, s in zip((1, 2, 2), strategies))
    kill_at(launch(tmp_path, first, nproc=4), run, 2)
    kill_at(launch(tmp_path, second, nproc=2), run, 4)
    out = finish(launch(tmp_path, third, nproc=3))
    log = (run / "train.log").read_text()
    assert "resumed on 3 rank(s) x 2 worker(s) from a checkpoint of 2 rank(s) x 2 worker(s) (12 canonical readers)" \
           "; global batch 12 = 1 x 4 accumulation x 3 ranks" in log, out[-3000:]
    assert "approximate" not in log

    expected = steps_keys(ref_run, GLOBAL_BATCH)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert steps_keys(run, GLOBAL_BATCH) == expected

    # Same samples and the same per-sample noise and timesteps: only the order in which gradients are summed
    # differs (4, 6 or 4 micro-batches per rank, all-reduced over 4, 2 or 3 ranks).
    a, b = final(ref_run), final(run)
    for name in ("unet", "ema", "optimizer"):
        diff, scale = max_diff(a[name], b[name], strict=True), largest(a[name])
        print(f"{name}: max abs difference {diff:.3g} (largest magnitude {scale:.3g})")
        assert diff <= TOL[precision][name], f"{name} differs by {diff:.3g} > {TOL[precision][name]}"
    ref_losses, got = losses(ref_run), losses(run)
    assert sorted(got) == sorted(ref_losses)
    for s in ref_losses:
        print(f"step {s}: loss {got[s]:.6f} (reference {ref_losses[s]:.6f})")
        assert abs(got[s] - ref_losses[s]) <= TOL[precision]["loss"] * abs(ref_losses[s]), (s, ref_losses[s])
