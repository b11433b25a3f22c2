"""LoRA runs resume exactly and distribute: a LoRA run killed after a checkpoint and resumed ends
bit-identical to one that was never killed (one process, and FSDP2 on 2 ranks with the frozen base
sharded), and the base weights in its checkpoints never change."""

import pytest
import torch
from test_resume import N, args_for, assert_same, finish, kill_after_checkpoint, launch, losses

from sd_training.checkpoint import complete_steps

pytestmark = pytest.mark.slow

LORA = {"model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.alpha": 8,
        "experiment.checkpoint_async": "false"}


def final_state(run):
    from test_resume import final_state as full

    return full(run)


@pytest.mark.parametrize("nproc, strategy", [(1, "ddp"), pytest.param(2, "fsdp", marks=pytest.mark.distributed)])
def test_lora_kill_and_resume_is_bit_identical_and_the_base_never_moves(tmp_path, tiny_pipeline, shapes_shards,
                                                                       nproc, strategy):
    kw = {**LORA, "distributed.strategy": strategy, "system.batch_size": 4 // nproc, "system.workers": 1,
          "model.mixed_precision": "bf16"}
    finish(launch(tmp_path, args_for(tmp_path, tiny_pipeline, shapes_shards, "straight", **kw), nproc))
    resumed = args_for(tmp_path, tiny_pipeline, shapes_shards, "resumed", **kw)
    run = tmp_path / "runs" / "resumed"
    kill_after_checkpoint(launch(tmp_path, resumed, nproc), run / "checkpoints", 3)
    first = complete_steps(run / "checkpoints")
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
    lora = [k for k in weights if "lora_" in k]
    assert lora, sorted(weights)[:5]
    for k, v in weights.items():
        if "lora_" in k:
            continue
        plain = k.replace(".base_layer", "")
        assert plain in base, k
        assert torch.equal(v, base[plain].to(v.dtype)), k
