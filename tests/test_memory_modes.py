"""The single-GPU memory modes (issue 24): FSDP2 and its CPU offload in a process group of one,
optimizer-in-backward (``optimizer.in_backward``) and 8-bit AdamW (bitsandbytes).

- In one process (fixed batches, noise and timesteps): each mode's steps equal the ordinary one-process
  step's (in_backward: bit for bit, AdamW, Adafactor and 8-bit AdamW, with the LR warming up; FSDP2 on one
  rank, with and without offload and in_backward: within fp32 summation noise, as fsdp against ddp).
- Through train.py, bf16, a loader worker: a run killed after a checkpoint and resumed ends bit-identical to
  one never killed (in_backward's per-parameter updates of 8-bit AdamW's state; FSDP2 + offload on one
  rank with its sharded checkpoints), and exports the final weights.
- On two ranks: FSDP2 with in_backward equals one process at the doubled batch.
- Refusals name the key: in_backward with accumulation, clipping, fp16 or DDP on several ranks; adamw8bit
  without an importable bitsandbytes.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch
import helpers
from conftest import train_args

from sd_training import distributed
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.loop import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_bnb = pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed")
STEPS = 3
NO_CLIP = {"optimizer.params.max_grad_norm": "null"}


def trainer(tmp_path, pipeline, shards, name, one_rank_group=False, **kw):
    cfg = load(train_args(tmp_path, pipeline, shards, name=name, **{"experiment.sample_per_prompt": 0, **kw}))
    t = Trainer(cfg, distributed.setup("cpu", one_rank_group=one_rank_group))
    t.setup()
    return t


def train_steps(t: Trainer, steps: int = STEPS, batch: int = 2) -> dict:
    """``steps`` optimizer steps on fixed latents, noise and timesteps; the net's full weights after them. Batch 2:
    bf16 convolutions' backward on this CPU costs in proportion to the batch (ATen's slow kernels)."""
    g = torch.Generator().manual_seed(1234)
    tok = t.family.tokenizers
    ids = tok([f"a shape number {i}" for i in range(batch)], padding="max_length", max_length=tok.model_max_length,
              truncation=True, return_tensors="pt").input_ids
    channels = int(t.models.vae.config.latent_channels)
    norms = []
    for _ in range(steps):
        t.micro_step({"input_ids": ids, "latents": torch.randn(batch, channels, 8, 8, generator=g),
                       "noise": torch.randn(batch, channels, 8, 8, generator=g),
                       "timesteps": torch.randint(0, 1000, (batch,), generator=g)}, sync=True)
        norms.append(float(t.optimizer_step()))
    t.trackers.close()
    plain = t.strategy.plain_copy(t.net, torch.device("cpu"))
    return {"weights": {k: v.detach().clone() for k, v in plain.state_dict().items()}, "norms": norms}


def max_diff(a: dict, b: dict) -> float:
    return helpers.max_diff(a, b, strict=True)  # the same keys (and dtypes) on both sides


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", pytest.param("adamw8bit", marks=needs_bnb)])
def test_in_backward_equals_the_ordinary_step(tmp_path, tiny_pipeline, shapes_shards, optimizer):
    """bf16 autocast; the LR warms up over the steps (lr_scheduler.params.warmup_length=2), so the schedule
    reaches the per-parameter updates. The same gradients, the same per-tensor updates: bit for bit."""
    kw = {"optimizer.name": optimizer, "model.mixed_precision": "bf16", **NO_CLIP}
    ordinary = trainer(tmp_path, tiny_pipeline, shapes_shards, "ordinary", **kw)
    init = {k: v.detach().clone() for k, v in ordinary.net.state_dict().items()}
    a = train_steps(ordinary)
    t = trainer(tmp_path, tiny_pipeline, shapes_shards, "in_backward", **kw, **{"optimizer.in_backward": "true"})
    assert len(t.optimizer.in_backward.handles) == sum(p.requires_grad for p in t.net.parameters())
    b = train_steps(t)
    assert max_diff(a["weights"], init) > 1e-4  # the steps moved the weights
    assert max_diff(a["weights"], b["weights"]) <= 1e-7, max_diff(a["weights"], b["weights"])
    # The logged gradient norm is the ordinary step's (computed as each gradient arrived), no gradient is left.
    assert b["norms"] == pytest.approx(a["norms"], rel=1e-5) and all(n > 0 for n in b["norms"])
    assert all(p.grad is None for p in t.net.parameters())
    # The optimizer state (what checkpoints hold) is the ordinary optimizer's, entry for entry.
    from test_resume import assert_same

    assert_same(ordinary.optimizer.state_dict(), t.optimizer.state_dict(), "optimizer")


def test_fsdp_on_one_rank_equals_the_plain_step(tmp_path, tiny_pipeline, shapes_shards):
    """A process group of one: FSDP2 shards every unit over one rank (its CPU offload too, and with
    in_backward) and trains as the plain module does, within fp32 summation-order noise (the tolerance
    of fsdp against ddp in test_distributed)."""
    kw = {"optimizer.params.epsilon": 1e-4, "lr_scheduler.params.warmup_length": 0, **NO_CLIP}
    plain = trainer(tmp_path, tiny_pipeline, shapes_shards, "plain", **kw)
    assert plain.strategy.name == "single"
    init = {k: v.detach().clone() for k, v in plain.net.state_dict().items()}
    want = train_steps(plain)["weights"]
    assert max_diff(want, init) > 1e-4
    for name, more in [("fsdp", {}), ("offload", {"distributed.fsdp_cpu_offload": "true"}),
                       ("offload_in_backward", {"distributed.fsdp_cpu_offload": "true", "optimizer.in_backward": "true"})]:
        try:
            t = trainer(tmp_path, tiny_pipeline, shapes_shards, name, one_rank_group=True,
                        **{"distributed.strategy": "fsdp", **kw, **more})
            assert t.info.has_group and t.info.world_size == 1 and t.strategy.name == "fsdp"
            p = next(t.net.parameters())
            assert type(p).__name__ == "DTensor" and p.to_local().device.type == "cpu"
            assert t.strategy.plan_name == ("fsdp_offload" if "offload" in name else "fsdp")
            got = train_steps(t)["weights"]
        finally:
            distributed.teardown()
        assert max_diff(want, got) < 1e-5, (name, max_diff(want, got))


def test_refusals_name_the_key(tmp_path, tiny_pipeline, shapes_shards, monkeypatch):
    def refused(**kw):
        with pytest.raises(ConfigError) as e:
            load(train_args(tmp_path, tiny_pipeline, shapes_shards, **kw))
        return str(e.value)

    ib = {"optimizer.in_backward": "true"}
    assert "optimizer.params.max_grad_norm=null" in refused(**ib)  # the default clips at 1.0
    for kw, words in [({"system.gradient_accumulation": 2}, "gradient accumulation"),
                      ({"system.global_batch_size": 8}, "gradient accumulation"),
                      ({"model.mixed_precision": "fp16"}, "fp16")]:
        message = refused(**ib, **NO_CLIP, **kw)
        assert "'optimizer.in_backward'" in message and words in message, message
    load(train_args(tmp_path, tiny_pipeline, shapes_shards, **ib, **NO_CLIP))  # accepted as it stands
    from sd_training.optim import build_optimizer, check_in_backward

    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, **ib, **NO_CLIP)).optimizer
    with pytest.raises(ConfigError, match="'optimizer.in_backward' cannot work with distributed.strategy=ddp on 2"):
        check_in_backward(cfg, "ddp", 2, 1)
    with pytest.raises(ConfigError, match="'optimizer.in_backward' cannot work with gradient accumulation"):
        check_in_backward(cfg, "single", 1, 2)
    check_in_backward(cfg, "fsdp", 2, 1)
    check_in_backward(cfg, "single", 1, 1)
    # 8-bit AdamW where bitsandbytes cannot be imported: refused naming the key and the package.
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    cfg8 = load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"optimizer.name": "adamw8bit"})).optimizer
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    with pytest.raises(ConfigError, match="optimizer.name=adamw8bit needs bitsandbytes.*pip install bitsandbytes"):
        build_optimizer(groups, cfg8, torch.device("cpu"), 1e-3)


# A killed and resumed run against one never killed, through train.py (bf16, a loader worker). The
# per-parameter updates of in_backward run 8-bit AdamW where bitsandbytes is installed (its state resumes
# exactly too), else AdamW (the test above shows their state is the ordinary step's).
RESUMED = {
    "in_backward": {"optimizer.in_backward": "true", **NO_CLIP, **({"optimizer.name": "adamw8bit"} if HAS_BNB else {})},
    "fsdp_offload": {"distributed.strategy": "fsdp", "distributed.fsdp_cpu_offload": "true"},
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_backward", "fsdp_offload"])
def test_kill_and_resume_is_bit_identical(tmp_path, tiny_pipeline, shapes_shards, mode):
    from test_resume import N, args_for, assert_same, final_state, finish, kill_after_checkpoint, launch, losses

    from sd_training.checkpoint import complete_steps

    kw = {"system.batch_size": 4, "system.workers": 1, "model.mixed_precision": "bf16", **RESUMED[mode]}
    out = finish(launch(tmp_path, args_for(tmp_path, tiny_pipeline, shapes_shards, "straight", **kw)))
    resumed = args_for(tmp_path, tiny_pipeline, shapes_shards, "resumed", **kw)
    run = tmp_path / "runs" / "resumed"
    kill_after_checkpoint(launch(tmp_path, resumed), run / "checkpoints", 3)
    first = complete_steps(run / "checkpoints")
    assert max(first) < N, first  # the killed run left steps for the restart to train
    assert "resumed from" in finish(launch(tmp_path, resumed))
    a, ta = final_state(tmp_path / "runs" / "straight")
    b, tb = final_state(run)
    for name in ("unet", "ema", "optimizer", "lr_scheduler"):
        assert_same(a[name], b[name], name)
    assert ta["step"] == tb["step"] == N
    la, lb = losses(tmp_path / "runs" / "straight"), losses(run)
    for s in range(max(first) + 1, N + 1):
        assert la[s] == lb[s], (s, la[s], lb[s])
    if mode == "fsdp_offload":  # FSDP2 in one process: sharded checkpoints, the one-rank group said so
        assert (run / "checkpoints" / f"step_{N:08d}" / "sharded").is_dir()
        assert re.search(r"fsdp_offload .*<- this run", out), out[-3000:]  # the plan's row: FSDP2 with offload
    states = list(a["optimizer"]["state"].values())
    if mode == "in_backward" and HAS_BNB:  # 8-bit moments (bitsandbytes' blockwise state, in a dict of its own)
        assert any(torch.is_tensor(v) and v.dtype == torch.uint8 for s in states for d in s.values()
                   if isinstance(d, dict) for v in d.values())
    elif mode == "in_backward":
        assert {"exp_avg", "exp_avg_sq", "step"} <= set(states[0])
    from diffusers import UNet2DConditionModel

    exported = UNet2DConditionModel.from_pretrained(run / "current_pipeline" / "unet").state_dict()
    for k, v in exported.items():
        assert torch.equal(v, a["unet"][k].to(v.dtype)), k


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_two_ranks_with_in_backward_equal_one_process(tmp_path, tiny_pipeline, shapes_shards):
    """FSDP2 runs each shard's update once its gradient is reduce-scattered: 2 ranks x batch 4 with in_backward
    equal 1 process x batch 8 with the ordinary step (fp32, test_distributed's tolerance)."""
    from helpers import max_diff as diff
    from test_distributed import run_worker

    common = {"optimizer.params.learning_rate": 1e-3, "lr_scheduler.params.warmup_length": 0,
              "optimizer.params.epsilon": 1e-4, **NO_CLIP}
    one = run_worker(tmp_path, 1, tiny_pipeline, shapes_shards, tmp_path / "one.pt", **{"system.batch_size": 8}, **common)
    two = run_worker(tmp_path, 2, tiny_pipeline, shapes_shards, tmp_path / "two.pt",
                     **{"system.batch_size": 4, "distributed.strategy": "fsdp", "optimizer.in_backward": "true"}, **common)
    init = torch.load(tmp_path / "one.init.pt")
    assert diff(one, init) > 1e-4
    assert diff(one, two) < 1e-5, diff(one, two)


def test_the_memory_plan_counts_one_tensor_of_gradients_in_backward():
    """optimizer.in_backward frees each gradient once its parameter is updated: the plan's gradients are the
    largest trained tensor's (fp32), under every strategy; 8-bit AdamW's state is 2 bytes a parameter."""
    from sd_training.memory.plan import GIB, memory_plan

    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    n = sum(p.numel() for p in net.parameters())
    plan = {ib: memory_plan(net, [], "adamw8bit", 1, False, False, 2, None, "layer", in_backward=ib) for ib in (0, 1)}
    ordinary, in_backward = plan[False][0], plan[True][0]
    assert ordinary.strategy == "ddp" and ordinary.gradients * GIB == n * 4 and ordinary.optimizer * GIB == n * 2
    assert in_backward.gradients * GIB == 64 * 32 * 4 and in_backward.weights == ordinary.weights
    assert in_backward.total == pytest.approx(ordinary.total - (n - 64 * 32) * 4 / GIB)


def test_checkpoint_shape_checks_pass_optimizer_state_of_its_own_shape(tmp_path):
    """Adafactor's factored moments (a row and a column per matrix) are not shaped like their parameter:
    a checkpoint holding them passes the shape check, which still catches a moment of the wrong shape."""
    from transformers.optimization import Adafactor

    from sd_training.checkpoint.integrity import CheckpointDamaged
    from sd_training.checkpoint.model_state import check_optimizer_shapes

    net = torch.nn.Linear(8, 4)
    opt = Adafactor(net.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
    net(torch.randn(2, 8)).sum().backward()
    opt.step()
    osd = opt.state_dict()
    assert {"exp_avg_sq_row", "exp_avg_sq_col"} <= set(osd["state"][0])
    check_optimizer_shapes(tmp_path / "optimizer.pt", osd, opt, net)
    osd["state"][1]["exp_avg_sq"] = torch.zeros(5)  # the bias's moment, of another model's shape
    with pytest.raises(CheckpointDamaged, match="holds 'exp_avg_sq' of shape \\(5,\\) for parameter bias"):
        check_optimizer_shapes(tmp_path / "optimizer.pt", osd, opt, net)
