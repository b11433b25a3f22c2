"""``model.block_swap`` (``sd_training.speed.block_swap``): blocks kept in host memory and streamed through
the device. The component is told a device (``cpu:0``) distinct from its host (``cpu``) and records each
move it makes, so the tests count what moves where and when: a UNet (sd) and a transformer (flux) give
gradients bit-identical to no swap with at most two swapped blocks on the device; runs of train.py with a
swap (full fine-tune with the optimizer in the backward and a CPU EMA; LoRA) end with the losses, weights and
optimizer state of the run without one, across a kill and resume; what cannot work is refused by name."""

import copy
import re
from pathlib import Path

import pytest
import torch
from conftest import train_args
from test_resume import assert_same, finish, kill_after_checkpoint, launch, losses

from sd_training.checkpoint import Checkpointer, complete_steps

from sd_training.config import ConfigError
from sd_training.speed.block_swap import BACKWARD, FORWARD, WINDOW, BlockSwap

DEVICE = torch.device("cpu", 0)  # the "device": a torch.device distinct from the host's, CPU tensors either way


LORA_KEYS = {"model.adapter.type": "lora", "model.adapter.rank": 4}
IN_BACKWARD = {"optimizer.in_backward": "true", "optimizer.params.max_grad_norm": "null"}


# ---------------------------------------------------------------------------------------------- the component
def unet_case(family_pipeline):
    from diffusers import UNet2DConditionModel

    from sd_training.families.unet_family import swap_units

    net = UNet2DConditionModel.from_pretrained(Path(family_pipeline("sd")) / "unet")
    g = torch.Generator().manual_seed(0)
    c = net.config
    x = dict(sample=torch.randn(2, c.in_channels, 4, 4, generator=g), timestep=torch.tensor([10, 500]),
             encoder_hidden_states=torch.randn(2, 7, c.cross_attention_dim, generator=g))
    return net, swap_units, lambda m: m(**x).sample, ("conv_in.",)


def flux_case(family_pipeline):
    from diffusers import FluxTransformer2DModel

    from sd_training.families.components.transformer import transformer_blocks

    net = FluxTransformer2DModel.from_pretrained(Path(family_pipeline("flux")) / "transformer")
    g = torch.Generator().manual_seed(0)
    c = net.config
    x = dict(hidden_states=torch.randn(2, 4, c.in_channels, generator=g),
             encoder_hidden_states=torch.randn(2, 3, c.joint_attention_dim, generator=g),
             pooled_projections=torch.randn(2, c.pooled_projection_dim, generator=g),
             timestep=torch.tensor([0.2, 0.9]), img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(3, 3),
             guidance=torch.tensor([3.5, 3.5]) if c.guidance_embeds else None)
    return net, transformer_blocks, lambda m: m(**x, return_dict=False)[0], ("x_embedder.",)


def train_step(net, call):
    net.zero_grad(set_to_none=True)
    out = call(net)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", [unet_case, flux_case], ids=["sd_unet", "flux_transformer"])
@pytest.mark.parametrize("trained", [True, False], ids=["full", "frozen_base"])
def test_gradients_equal_no_swap_and_two_blocks_at_most_are_on_the_device(family_pipeline, case, trained):
    net, units_of, call, head = case(family_pipeline)
    net.enable_gradient_checkpointing()
    if not trained:  # an adapter's case: the swapped weights are frozen, something before them trains
        for name, p in net.named_parameters():
            p.requires_grad_(name.startswith(head))
    # Both fresh copies: loaded weights sit at odd offsets in the file's buffer, and CPU kernels' results
    # depend on the alignment (the swap keeps each weight's, sd_training.speed.block_swap.alike).
    net, ref = copy.deepcopy(net), copy.deepcopy(net)
    units = units_of(net)
    n = len(units) - 1  # all but the first
    swap = BlockSwap(units, n, DEVICE, swap_trained=trained)
    swapped = [t for s in swap.slots for t in s.owners]
    assert len(swapped) == sum(1 for u in units[1:] for p in u.parameters() if trained or not p.requires_grad)
    for step in range(2):
        want_out, want = train_step(ref, call)
        swap.moves.clear()
        out, got = train_step(net, call)
        assert torch.equal(out, want_out) and want.keys() == got.keys() and want, step
        for name in want:
            assert torch.equal(got[name], want[name]), name
        # Each swapped block came in once for the forward and once for the backward, and went out after each;
        # in the backward a trained block's weights were copied back to the host.
        for phase in (FORWARD, BACKWARD):
            ins = [m.block for m in swap.moves if m.phase == phase and m.direction == "in"]
            outs = [m for m in swap.moves if m.phase == phase and m.direction == "out"]
            assert sorted(ins) == list(range(1, len(units))), (phase, ins)
            assert sorted(m.block for m in outs) == list(range(1, len(units))), phase
            assert all((m.bytes > 0) == (trained and phase == BACKWARD) for m in outs), outs
        forward = [m.block for m in swap.moves if m.phase == FORWARD and m.direction == "in"]
        backward = [m.block for m in swap.moves if m.phase == BACKWARD and m.direction == "in"]
        assert forward == sorted(forward) and backward == sorted(backward, reverse=True)  # in order, ahead of use
        assert swap.max_resident <= WINDOW and swap.resident == 0
        # Between steps every swapped tensor is its host buffer (the same buffer every step).
        assert all(t.data_ptr() == h.data_ptr() for s in swap.slots for t, h in zip(s.owners, s.hosts))
        with torch.no_grad():  # a weight update in place, as the optimizer makes it: the host copy is the weight
            for p, q in zip(net.parameters(), ref.parameters()):
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
                    q.sub_(0.1 * q.grad)
    swap.moves.clear()
    with torch.no_grad():  # validation and samples: a forward without gradients streams the same way
        assert torch.equal(call(net), call(ref))
    assert len(swap.moves) == 2 * n and swap.resident == 0


def in_backward_optimizer(net, name):
    from sd_training.config.schema import OptimizerConfig, OptimizerParams
    from sd_training.optim import build_optimizer, param_groups

    cfg = OptimizerConfig(name=name, in_backward=True, params=OptimizerParams(max_grad_norm=None))
    return build_optimizer(param_groups(net, 0.01, True), cfg, torch.device("cpu"), 1e-3)


@pytest.mark.parametrize("optimizer, compiled", [("adamw8bit", False), ("adamw", True)],
                         ids=["adamw8bit_in_backward", "per_block_compile"])
def test_a_full_fine_tune_updates_in_the_backward_as_without_swap(family_pipeline, optimizer, compiled):
    """Each swapped block is updated in the backward while it is on the device (8-bit AdamW's state made
    there too), its new weights copied back to its host buffers; per-block compile (the hooks run eagerly
    beside each block's graph) trains the same weights as eager code without swap."""
    from conftest import counting_backend

    net, units_of, call, _ = flux_case(family_pipeline)
    net.enable_gradient_checkpointing()
    net, ref = copy.deepcopy(net), copy.deepcopy(net)
    units = units_of(net)
    swap = BlockSwap(units, len(units), DEVICE)
    graphs = []
    if compiled:
        torch._dynamo.reset()
        backend, graphs = counting_backend()
        for unit in units:
            unit.compile(backend=backend)
    opts = [in_backward_optimizer(m, optimizer) for m in (net, ref)]
    swap.follow_optimizer(opts[0])
    for step in range(3):
        for m, opt in zip((net, ref), opts):
            call(m).square().mean().backward()
            opt.in_backward.grad_norm()  # as the Trainer's step reads it (a fresh count for the next backward)
            opt.step()  # (the updates ran in the backward: this finds no gradient)
            opt.zero_grad(set_to_none=True)
        assert swap.resident == 0 and swap.max_resident <= WINDOW
        assert all(p.grad is None for p in net.parameters())
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (step, name)
    assert not compiled or graphs  # the blocks ran as graphs
    moved = [s for s in opts[0].state.values() if "state1" in s or "exp_avg" in s]
    assert len(moved) == sum(1 for p in net.parameters())


def test_the_plan_counts_the_swapped_weights_and_the_two_in_flight(family_pipeline):
    from sd_training.speed.block_swap import plan

    net, units_of, _, _ = unet_case(family_pipeline)
    units = units_of(net)
    sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    got = plan(units, 5)
    assert (got.swapped, got.blocks) == (sum(sizes[-5:]), len(units))
    assert got.in_flight == sum(sorted(sizes[-5:])[-2:]) < got.swapped
    for p in net.parameters():  # an adapter's run: only the frozen weights swap
        p.requires_grad_(False)
    trained = next(units[-1].parameters()).requires_grad_(True)
    assert plan(units, 5, swap_trained=False).swapped == got.swapped - trained.numel()
    assert plan(units, 0) == type(got)(0, 0, len(units))


def test_a_trained_block_that_checkpointing_does_not_recompute_is_named():
    net = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(3)))
    BlockSwap(list(net), 1, DEVICE)
    with pytest.raises(RuntimeError, match="swapped block 2 \\(Linear\\) got its gradient while the block was in host"):
        net(torch.ones(1, 2)).sum().backward()


def test_the_counts_and_weights_it_cannot_move_are_refused_by_name():
    import bitsandbytes as bnb

    net = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(3)))
    for n in (0, 4):
        with pytest.raises(ConfigError, match="'model.block_swap' is %d, but the net has 3 blocks" % n):
            BlockSwap(list(net), n, DEVICE)
    net[2] = bnb.nn.Linear8bitLt(2, 2, has_fp16_weights=False)
    with pytest.raises(ConfigError, match="cannot move the Int8Params weights of block 2 \\(Linear8bitLt\\)"):
        BlockSwap(list(net), 1, DEVICE)


# ---------------------------------------------------------------------------------------------- refusals
SWAP = {"model.block_swap": 2, "model.gradient_checkpointing": "true"}
REFUSED = [  # (what is set besides SWAP, words of the reason)
    ({"distributed.strategy": "fsdp", **LORA_KEYS}, "distributed.strategy=fsdp: FSDP already shards"),
    ({"model.gradient_checkpointing": "false", **LORA_KEYS}, "would keep every block's device weights"),
    ({}, "a full fine-tune without optimizer.in_backward"),
    ({**IN_BACKWARD, "model.use_ema": "true"}, "an EMA on the device in a full fine-tune"),
    ({**LORA_KEYS, "model.compile": "true", "model.compile_mode": "reduce-overhead"}, "CUDA graphs replay"),
    ({**LORA_KEYS, "model.adapter.export_merged": "true"}, "model.adapter.export_merged: the merged copy"),
]


@pytest.mark.parametrize("over, why", REFUSED, ids=["fsdp", "no_checkpointing", "full_no_in_backward",
                                                    "device_ema", "cuda_graphs", "export_merged"])
def test_what_cannot_work_is_refused_at_config_load(tmp_path, tiny_pipeline, shapes_shards, over, why):
    from sd_training.configure import load

    with pytest.raises(ConfigError, match=r"^'model.block_swap' cannot work with .*" + re.escape(why)):
        load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{**SWAP, **over}))


def test_a_negative_count_is_refused(tmp_path, tiny_pipeline, shapes_shards):
    from sd_training.configure import load

    with pytest.raises(ConfigError, match="model.block_swap"):
        load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{**SWAP, **LORA_KEYS, "model.block_swap": -1}))


def test_more_blocks_than_the_net_has_and_ddp_ranks_are_refused_at_start_up(tmp_path, tiny_pipeline, shapes_shards):
    from sd_training.configure import load
    from sd_training.families import registry
    from sd_training.speed.block_swap import install

    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{**SWAP, **LORA_KEYS, "model.block_swap": 18}))
    family = registry.create(cfg, torch.device("cpu"), 0, True)
    with pytest.raises(ConfigError, match="'model.block_swap' is 18, but the unet has 17 blocks that can swap"):
        install(cfg, family, family.net, DEVICE, 1, "single")
    cfg.model.block_swap = 2
    with pytest.raises(ConfigError, match=r"distributed.strategy=ddp on 2 rank\(s\) under torchrun: DDP broadcasts"):
        install(cfg, family, family.net, DEVICE, 2, "ddp")
    assert install(cfg, family, family.net, DEVICE, 1, "single").first == 15


# ---------------------------------------------------------------------------------------------- runs
STEPS, CKPT = 4, 2
FULL = {**IN_BACKWARD, "model.use_ema": "true", "model.ema.device": "cpu", "model.ema.decay": 0.9}
LORA = LORA_KEYS
RUNS = [("sd", FULL, 12), ("flux", LORA, 2)]  # (family, mode, blocks swapped: sd's UNet has 17, flux's 2)


def run_args(tmp_path, pipeline, shards, name, swap, **kw):
    return train_args(tmp_path, pipeline, shards, name=name, **{
        "model.gradient_checkpointing": "true", "model.block_swap": swap, "dataset.params.resolution": 32,
        "system.batch_size": 2, "experiment.num_examples_to_see": 2 * STEPS, "experiment.checkpoint_every": CKPT,
        "experiment.keep_last_checkpoints": 10, "experiment.sample_per_prompt": 0,
        "dataset.params.resampled": "false", **kw})


def final(run: Path) -> dict:
    return Checkpointer.load(run / "checkpoints" / f"step_{STEPS:08d}", 0)[0]


@pytest.mark.slow
@pytest.mark.parametrize("family, mode, swap", RUNS, ids=["sd_full", "flux_lora"])
def test_a_swapped_run_killed_and_resumed_ends_as_the_run_without_swap(tmp_path, family_pipeline, shapes_shards,
                                                                       family, mode, swap):
    pipeline = family_pipeline(family)
    finish(launch(tmp_path, run_args(tmp_path, pipeline, shapes_shards, "plain", 0, **mode)))
    args = run_args(tmp_path, pipeline, shapes_shards, "swapped", swap, **mode)
    run = tmp_path / "runs" / "swapped"
    kill_after_checkpoint(launch(tmp_path, args), run / "checkpoints", CKPT)
    assert max(complete_steps(run / "checkpoints")) < STEPS
    out = finish(launch(tmp_path, args))
    assert "resumed from" in out and f"model.block_swap: {swap} of" in out
    plain = tmp_path / "runs" / "plain"
    assert losses(run) == losses(plain) and len(losses(run)) == STEPS
    a, b = final(plain), final(run)
    assert a.keys() == b.keys() >= {"optimizer", "lr_scheduler"}
    for key in a:  # the net (and EMA), the optimizer state, the schedule: bit for bit
        assert_same(a[key], b[key], key)
