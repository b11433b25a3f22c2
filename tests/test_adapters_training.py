"""model.adapter with the training features around it: the EMA holds only the adapters (their parameter count)
and is exported as base + EMA'd adapters, equal to the EMA recomputed from the checkpointed weights of every step;
validation, sample grids and eval images run with the adapter applied; gradient checkpointing and compile give
the LoRA step of plain eager execution with the base frozen. Tiny SD runs under bf16 autocast on the CPU."""

import copy
import json

import numpy as np
import pytest
import torch
from helpers import args_with, run_trainer
from PIL import Image

from sd_training import adapters
from sd_training.checkpoint import Checkpointer
from sd_training.configure import load
from sd_training.families import registry as families

pytestmark = pytest.mark.usefixtures("one_thread")
LORA = {"model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.alpha": 8}
DECAY = 0.9


args = args_with({"dataset.params.resolution": 32, "experiment.num_examples_to_see": 8, "model.mixed_precision": "bf16",
                  **LORA})


def lora_params(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters() if "lora_" in n}


def test_ema_holds_only_the_adapters_and_exports_base_plus_ema_adapters(tiny_pipeline, shapes_shards, tmp_path):
    """3 steps with the EMA, a checkpoint after each, validation, raw and EMA sample grids, eval images."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    cfg = load(args(tmp_path, tiny_pipeline, shapes_shards, **{
        "experiment.num_examples_to_see": 12, "experiment.checkpoint_every": 1, "experiment.keep_last_checkpoints": 10,
        "experiment.checkpoint_async": "false", "experiment.save_every": 3, "experiment.sample_from": "both",
        "experiment.num_eval_images": 2, "experiment.eval_caption_file": str(prompts),
        "validation.path": shapes_shards, "validation.num_batches": 1,
        "model.use_ema": "true", "model.ema.decay": DECAY, "optimizer.params.learning_rate": 1e-2}))
    fam = families.create(cfg, torch.device("cpu"), cfg.system.seed, True)
    adapters.apply(cfg, fam, torch.bfloat16)
    start = lora_params(fam.net)  # the run's adapter before any step (drawn from the run's seed)
    t = run_trainer(cfg)
    run = t.run_dir.root

    # The EMA is the adapters' only: their parameter count, their names, fp32.
    trained = {n: p for n, p in t.net.named_parameters() if p.requires_grad}
    shadow = dict(t.ema.shadow.named_parameters())
    assert sum(p.numel() for p in shadow.values()) == sum(p.numel() for p in trained.values()) > 0
    assert shadow.keys() == trained.keys() == start.keys() and not list(t.ema.shadow.buffers())
    assert all(p.dtype == torch.float32 for p in shadow.values())

    # The EMA recomputed from the raw adapters the checkpoints hold after each step equals the checkpointed
    # and the exported EMA; the raw export holds the raw adapters.
    ema = dict(start)
    for step in (1, 2, 3):
        shared, _, ts = Checkpointer.load(run / "checkpoints" / f"step_{step:08d}", 0)
        assert ts["step"] == step
        ema = {n: torch.lerp(e, shared["unet"][n], 1 - DECAY) for n, e in ema.items()}
        saved = shared["ema"]["shadow"]
        assert saved.keys() == ema.keys()
        for n in ema:
            torch.testing.assert_close(saved[n], ema[n], rtol=0, atol=1e-7)
    raw = lora_params(t.net)
    exported = {}
    for kind in ("raw", "ema"):
        fresh = families.create(cfg, torch.device("cpu"), cfg.system.seed, True)
        adapters.load_lora(adapters.apply(cfg, fresh, torch.bfloat16), str(t.run_dir.pipeline(None, ema=kind == "ema")))
        exported[kind] = lora_params(fresh.net)
    assert all(torch.equal(exported["ema"][n], saved[n]) for n in saved)
    assert all(torch.equal(exported["raw"][n], raw[n]) for n in raw)
    assert max(float((raw[n] - saved[n]).abs().max()) for n in raw) > 1e-4  # the EMA lags the raw adapters

    # Validation, sample grids and eval images ran with the adapter applied: the validation loss moved although
    # the base is frozen (same images, noise and timesteps; the adapter is a no-op at step 0), and the raw and
    # EMA grids differ only by their adapters.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}
    assert sorted(val) == [0, 3] and val[3] != val[0], val
    grids = [np.asarray(Image.open(t.run_dir.sample_grid(3, suffix)), dtype=np.float32) for suffix in ("", "_raw")]
    assert np.abs(grids[0] - grids[1]).max() > 0
    assert len(list(t.run_dir.eval_images(3).glob("*.png"))) == 2


def one_step(cfg, compile_backend=None):
    """One LoRA step of a fresh family (the run's seed, the adapters in fp32, the base in bf16) under bf16
    autocast with fixed noise and timesteps: the loss and every trained parameter's gradient."""
    from sd_training.build import compile_model

    torch.manual_seed(0)
    fam = families.create(cfg, torch.device("cpu"), cfg.system.seed, True)
    ad = adapters.apply(cfg, fam, torch.bfloat16)
    modules = [fam.net, *ad.encoders.values()]
    with torch.no_grad():  # lora_B starts at zero: move it, so the gradients of lora_A are not zero either
        for n, p in [(n, p) for m in modules for n, p in m.named_parameters() if "lora_B" in n]:
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
    model = fam.loss_module
    if compile_backend is not None:
        model = compile_model(model, fam, fam.net, backend=compile_backend)
    g = torch.Generator().manual_seed(5)
    ids = fam.models.tokenizer(["a red circle", "a blue square"], padding="max_length", max_length=77,
                               return_tensors="pt").input_ids
    batch = {"latents": torch.randn(2, 4, 8, 8, generator=g), "input_ids": ids}
    fixed = {"noise": torch.randn(2, 4, 8, 8, generator=g), "timesteps": torch.tensor([10, 900])}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    loss = fam.loss(model, batch, autocast, fixed).loss
    loss.backward()
    grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(modules) for n, p in m.named_parameters()
             if p.requires_grad}
    frozen = [n for m in modules for n, p in m.named_parameters() if not p.requires_grad and p.grad is not None]
    return loss.item(), grads, frozen, fam


def test_gradient_checkpointing_gives_the_lora_step_without_it(tiny_pipeline, shapes_shards, tmp_path):
    text = {"model.adapter.text_encoders.train": "true"}
    want, want_grads, frozen, _ = one_step(load(args(tmp_path, tiny_pipeline, shapes_shards, **text)))
    cfg = load(args(tmp_path, tiny_pipeline, shapes_shards, **text, **{"model.gradient_checkpointing": "true"}))
    loss, grads, frozen_ckpt, fam = one_step(cfg)
    assert fam.net.is_gradient_checkpointing
    assert not frozen and not frozen_ckpt  # the base gets no gradient
    assert grads.keys() == want_grads.keys() and any("text" not in k and "lora_A" in k for k in grads)
    # The checkpointed blocks recompute their forward in the backward pass: the same ops on the same values.
    assert loss == pytest.approx(want, rel=1e-6)
    for n, g in grads.items():
        assert float(g.abs().max()) > 0, n
        torch.testing.assert_close(g, want_grads[n], rtol=1e-5, atol=1e-7)


def test_compiled_lora_step_equals_eager_and_the_base_stays_frozen():
    """model.compile's path (build.compile_model) with the SD3 family's units (each transformer block compiled
    in place) on a tiny SD3 transformer carrying the family's attention LoRA, dynamo's graphs run as they are
    (no code generation, as in test_compile_units; a whole SD UNet took 47 s to trace here): the LoRA layers
    trace into the blocks' graphs, the bf16 step equals eager and the base gets no gradient."""
    from test_compile_units import counting_backend, family_with, forward, tiny_sd3

    from sd_training.build import compile_model
    from sd_training.families.options import AdapterConfig
    from sd_training.families.components.transformer import ADAPTER_PRESETS
    from sd_training.families.components.transformer import transformer_blocks

    def step(net):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward(net)
        out.float().square().mean().backward()
        return out, {n: p.grad for n, p in net.named_parameters() if p.grad is not None}

    net = tiny_sd3()
    # Two of the preset's layer kinds (tracing cost grows with the adapted layers): the image and text streams.
    targets = [n for n in adapters.resolve_targets(net, ADAPTER_PRESETS, "attention", [], None, "k", "transformer")
               if n.endswith((".to_q", ".add_k_proj"))]
    net.to(torch.bfloat16)
    adapters.inject(net, adapters.lora_config(targets, 4, 8, AdapterConfig(type="lora")))
    with torch.no_grad():  # lora_B starts at zero: move it, so the gradients of lora_A are not zero either
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
    eager = copy.deepcopy(net)
    want, want_grads = step(eager)
    torch._dynamo.reset()
    backend, graphs = counting_backend()
    try:
        compile_model(torch.nn.ModuleDict({"transformer": net}), family_with(transformer_blocks), net, backend=backend)
        got, grads = step(net)
    finally:
        torch._dynamo.reset()
    assert graphs and all(b._compiled_call_impl is not None for b in transformer_blocks(net))
    assert any("lora_A" in n for g in graphs for n, _ in g.named_parameters()) or any(
        "lora" in g.code for g in graphs)  # the adapters are inside the compiled graphs
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert grads.keys() == want_grads.keys() and all("lora_" in n for n in grads) and len(grads) == 2 * len(targets)
    for n, g in grads.items():
        torch.testing.assert_close(g, want_grads[n], rtol=1e-5, atol=1e-7)
