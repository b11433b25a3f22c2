"""LoRA runs resume exactly and distribute: a LoRA run killed after a checkpoint and resumed ends
bit-identical to one that was never killed (one process, and FSDP2 on 2 ranks with the frozen base
sharded), EMA of the adapters included, and the base weights in its checkpoints never change. The FSDP
run's checkpoint also resumes on 1 rank (elastic resume) and trains every later step on the same samples."""

import shutil

import pytest
import torch
from helpers import largest, max_diff
from test_elastic import steps_keys
from test_resume import N, args_for, assert_same, finish, kill_after_checkpoint, launch, losses

from sd_training.checkpoint import complete_steps

pytestmark = pytest.mark.slow

LORA = {"model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.alpha": 8,
        "experiment.checkpoint_async": "false", "experiment.record_sample_keys": "true"}
GLOBAL_BATCH = 4
# The 2-rank FSDP run resumed on 1 rank against the uninterrupted 2-rank run: the same samples, noise and
# timesteps; FSDP2 casts every parameter to bf16 for compute (the fp32 adapters too) and reduces over 2 ranks,
# one process leaves the adapters to autocast and sums 2 micro-batches: bf16-level differences (as
# test_elastic's bf16 bounds).
ELASTIC_TOL = {"lora": 3e-3, "ema": 1e-3, "loss": 2e-3}


def final_state(run):
    from test_resume import final_state as full

    return full(run)


@pytest.mark.parametrize("nproc, strategy, elastic", [
    (1, "ddp", None),
    pytest.param(2, "fsdp", 1, marks=pytest.mark.distributed),  # and the killed run resumed on 1 rank
])
def test_lora_kill_and_resume_is_bit_identical_and_the_base_never_moves(tmp_path, tiny_pipeline, shapes_shards,
                                                                       nproc, strategy, elastic):
    kw = {**LORA, "distributed.strategy": strategy, "system.batch_size": GLOBAL_BATCH // nproc, "system.workers": 1,
          "model.mixed_precision": "bf16"}
    finish(launch(tmp_path, args_for(tmp_path, tiny_pipeline, shapes_shards, "straight", **kw), nproc))
    resumed = args_for(tmp_path, tiny_pipeline, shapes_shards, "resumed", **kw)
    run = tmp_path / "runs" / "resumed"
    kill_after_checkpoint(launch(tmp_path, resumed, nproc), run / "checkpoints", 3)
    first = complete_steps(run / "checkpoints")
    assert max(first) < N, first  # the killed run left steps for the restart to train
    if elastic:  # the killed run, as it was, resumes on another rank count below
        shutil.copytree(run, tmp_path / "elastic" / "resumed")
    assert "resumed from" in finish(launch(tmp_path, resumed, nproc))
    a, ta = final_state(tmp_path / "runs" / "straight")
    b, tb = final_state(run)
    assert ta["step"] == tb["step"] == N
    net = next(k for k in ("unet", "transformer") if k in a)
    for name in (net, "ema", "optimizer", "lr_scheduler"):
        assert_same(a[name], b[name], name)
    la, lb = losses(tmp_path / "runs" / "straight"), losses(run)
    for s in range(max(first) + 1, N + 1):
        assert la[s] == lb[s], (s, la[s], lb[s])
    # The base weights are the pipeline's, bit for bit in the precision they are kept in (bf16 here, except
    # under FSDP2, which keeps one dtype per unit: fp32); only lora_ parameters moved.
    from diffusers import UNet2DConditionModel

    base = UNet2DConditionModel.from_pretrained(tiny_pipeline, subfolder="unet").state_dict()
    weights = a[net]
    lora = sorted(k for k in weights if "lora_" in k)
    assert lora, sorted(weights)[:5]
    for k, v in weights.items():
        if "lora_" in k:
            continue
        plain = k.replace(".base_layer", "")
        assert plain in base, k
        assert torch.equal(v, base[plain].to(v.dtype)), k
    # The EMA holds the adapters only (the shadow's entries under one process, DCP's under fsdp).
    shadow = a["ema"]["shadow"] if "shadow" in a["ema"] else a["ema"]
    assert sorted(shadow) == lora and all(shadow[k].dtype == torch.float32 for k in lora)
    if elastic:
        resume_elsewhere(tmp_path, tiny_pipeline, shapes_shards, kw, nproc, elastic, a, la, net)


def resume_elsewhere(tmp_path, pipeline, shards, kw, nproc, ranks, straight, straight_losses, net):
    """The killed run resumed on ``ranks`` ranks with the same global batch (more micro-batches per rank)
    trains every step on the uninterrupted run's samples, and ends at its adapters, EMA and losses."""
    per_rank = GLOBAL_BATCH // nproc
    accumulation = nproc // ranks
    args = args_for(tmp_path, pipeline, shards, "resumed", **{
        **kw, "system.batch_size": per_rank, "system.gradient_accumulation": accumulation,
        "experiment.log_dir": str(tmp_path / "elastic")})
    run = tmp_path / "elastic" / "resumed"
    finish(launch(tmp_path, args, ranks))
    log = (run / "train.log").read_text()
    assert f"resumed on {ranks} rank(s)" in log and "approximate" not in log, log[-3000:]
    want = steps_keys(tmp_path / "runs" / "straight", GLOBAL_BATCH)
    assert sorted(want) == list(range(1, N + 1)) and steps_keys(run, GLOBAL_BATCH) == want
    b, tb = final_state(run)
    assert tb["step"] == N
    ema = b["ema"]["shadow"] if "shadow" in b["ema"] else b["ema"]
    pairs = {"lora": ({k: v for k, v in straight[net].items() if "lora_" in k},
                      {k: v for k, v in b[net].items() if "lora_" in k}),
             "ema": (straight["ema"], ema)}
    # fsdp on one rank writes DCP shards too (the EMA's scalars in ema_meta); a plain run, full tensors.
    assert b.get("ema_meta", b["ema"])["num_updates"] == straight["ema_meta"]["num_updates"] == N
    for name, (x, y) in pairs.items():
        diff, scale = max_diff(x, y, strict=True), largest(x)
        print(f"{name}: max abs difference {diff:.3g} (largest magnitude {scale:.3g})")
        assert diff <= ELASTIC_TOL[name], f"{name} differs by {diff:.3g} > {ELASTIC_TOL[name]}"
    got = losses(run)
    assert sorted(got) == sorted(straight_losses)
    for s, loss in straight_losses.items():
        assert abs(got[s] - loss) <= ELASTIC_TOL["loss"] * abs(loss), (s, got[s], loss)
