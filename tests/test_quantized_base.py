"""``model.adapter.base_quantization``: a LoRA on a quantised frozen base (sd_training.families.components.
quantized_base, quantized_base_store).

Per backend, on the tiny SD UNet with a LoRA on every quantised layer: the forward and one backward's LoRA
gradients equal the same LoRA on the dequantised reference (plain Linear layers holding the weights the
quantised ones compute with) within ``REFERENCE_TOL``; the base does not move over optimizer steps; the
stored layers reload bit for bit and a changed base or a damaged copy is quantised again. End to end: an SD
run with nf4 killed and resumed equals the straight run (the quantised base reloaded from the run folder),
its LoRA export loads on the full-precision pipeline in plain diffusers and changes the image; a Flux run
(torchao int8) on 2 DDP ranks trains the same adapter on both ranks; a Flux LoRA on a GGUF file trains and
its export loads on the bf16 pipeline; every other family's net quantises and takes its LoRA preset; the
refusals name their key."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import train_args
from helpers import max_diff

from sd_training.config import ConfigError
from sd_training.families.components import quantized_base as qb
from sd_training.families.components import quantized_base_store as store

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
BACKENDS = ("nf4", "int8", "int8_weight", "fp8_weight", "gguf")
# The quantised layers against plain Linear layers holding their dequantised weights, computing in fp32: the
# same products, summed in another order (torchao and bitsandbytes' int8 apply the row scale after the
# matmul). Measured on this UNet (max |diff| / max |reference|, the worst LoRA gradient by its own max): nf4
# and gguf 0 (both dequantise, then matmul), int8 9e-7 / 6e-6, int8_weight 8e-7 / 9e-6, fp8_weight 1e-6 /
# 7e-6. Under bf16 autocast the reordering costs bf16 roundings (torchao: 2e-2 forward); the runs below
# train under bf16.
REFERENCE_TOL = {"forward": 1e-5, "grad": 1e-4}


# ---------------------------------------------------------------------------------------------- helpers

def unet(pipeline) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(pipeline, subfolder="unet")


def block_layers(net) -> list[str]:
    from sd_training.families.unet_family import compile_units

    return qb.targets(compile_units(net), net)


def write_gguf(net, path, names) -> str:
    """``net``'s state as a GGUF file (diffusers' own names, so from_single_file needs no conversion), the
    Linear weights ``names`` in Q8_0 where their rows allow (32-wide blocks), the rest in fp32."""
    import gguf
    import numpy as np

    quantised = {f"{n}.weight" for n in names}
    writer = gguf.GGUFWriter(str(path), "sd_training_test")
    for key, value in net.state_dict().items():
        a = value.float().numpy()
        if key in quantised and a.shape[1] % 32 == 0:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(key, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(key, a.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def quantised_unet(pipeline, backend, tmp_path, dtype=torch.float32):
    """The tiny UNet with its block layers quantised by ``backend`` (gguf: read from a GGUF file), computing
    in ``dtype``."""
    from diffusers import UNet2DConditionModel

    net = unet(pipeline)
    names = block_layers(net)
    if backend == "gguf":
        path = write_gguf(net, tmp_path / "unet.gguf", names)
        net = qb.load_gguf(UNet2DConditionModel, path, str(pipeline), "unet", dtype, CPU)
        return net, [n for n, m in net.named_modules() if qb.is_quantized(m)]
    net.to(dtype)
    qb.quantize(net, names, backend, dtype, CPU)
    return net, names


def with_lora(net, names, use_dora=False):
    """A rank-4 LoRA (fp32, trained) on ``names``; B drawn too, so both factors get gradients."""
    from sd_training import adapters

    a = SimpleNamespace(dropout=0.0, use_dora=use_dora, init="gaussian")
    adapters.inject(net, adapters.lora_config(names, 4, None, a))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return net


def unet_step(net, bf16=False):
    """One forward (fp32, or under bf16 autocast) and backward: (output, the LoRA gradients by name)."""
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 4, 8, 8, generator=g)  # 2x2 in the mid block: its self-attention sees 4 tokens
    text = torch.randn(2, 8, net.config.cross_attention_dim, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = net(sample, torch.tensor([10, 600]), encoder_hidden_states=text).sample.float()
    out.pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def relative(a, b) -> float:
    return max_diff(a, b) / max(float(b.abs().max()), 1e-12)


def base_state(net) -> dict:
    """Every stored tensor of the quantised layers (and of the rest of the base), as plain tensors."""
    out = {}
    for name, m in net.named_modules():
        if qb.is_quantized(m) and not hasattr(m, "base_layer"):
            out[name] = qb.dequantized_weight(m)
    out.update({n: p.detach().clone() for n, p in net.named_parameters() if not p.requires_grad
                and type(p) is torch.nn.Parameter and type(p.data) is torch.Tensor})
    return out


# ---------------------------------------------------------------------------------------------- layers

@pytest.mark.parametrize("backend", BACKENDS + ("nf4+dora", "int8_weight+dora"))
def test_lora_on_the_quantised_base_equals_it_on_the_dequantised_reference_and_the_base_never_moves(
        tiny_pipeline, tmp_path, backend):
    backend, _, dora = backend.partition("+")
    net, names = quantised_unet(tiny_pipeline, backend, tmp_path)
    assert len(names) > 10
    stored, count = qb.stored_bytes(net)
    assert stored / count < (0.6 if backend == "nf4" else 1.1)  # bf16 would be 2
    full = qb.dequantized_weight(unet(tiny_pipeline).get_submodule(names[0]))
    assert max_diff(qb.dequantized_weight(net.get_submodule(names[0])), full) > 0  # it was quantised
    with_lora(net, names, use_dora=bool(dora))
    reference = qb.dequantized_copy(net)
    assert not any(qb.is_quantized(m) and not hasattr(m, "base_layer") for m in reference.modules())
    out, grads = unet_step(net)
    ref_out, ref_grads = unet_step(reference)
    assert relative(out, ref_out) < REFERENCE_TOL["forward"], relative(out, ref_out)
    assert grads.keys() == ref_grads.keys() and all("lora_" in n for n in grads)
    assert len(grads) == (3 if dora else 2) * len(names)  # A, B (and DoRA's magnitude) of every layer
    worst = max(relative(grads[n], ref_grads[n]) for n in grads)
    assert worst < REFERENCE_TOL["grad"], worst
    assert all(float(g.abs().max()) > 0 for g in grads.values())
    # Steps move the adapter (fp32) and nothing of the base
    before = base_state(net)
    lora = [p for n, p in net.named_parameters() if p.requires_grad]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    opt = torch.optim.AdamW(lora, lr=1e-2)
    start = [p.detach().clone() for p in lora]
    for _ in range(2):
        opt.step()
        opt.zero_grad()
        unet_step(net)
    assert max_diff(base_state(net), before, strict=True) == 0
    assert max(max_diff(p, s) for p, s in zip(lora, start)) > 1e-3


@pytest.mark.parametrize("backend", ("nf4", "int8", "int8_weight", "fp8_weight"))
def test_the_stored_base_reloads_bit_for_bit_and_a_changed_or_damaged_one_is_not_used(tiny_pipeline, tmp_path, backend):
    net = unet(tiny_pipeline).to(torch.bfloat16)
    names = block_layers(net)
    info = store.fingerprint(net, names, backend, torch.bfloat16)
    qb.quantize(net, names, backend, torch.bfloat16, CPU)
    folder = tmp_path / "quantized_base"
    store.save(folder, net, names, info)
    fresh = unet(tiny_pipeline).to(torch.bfloat16)
    assert store.usable(folder, store.fingerprint(fresh, names, backend, torch.bfloat16)) is None
    store.load(folder, fresh, names, backend, torch.bfloat16, CPU)
    qb.move_rest(fresh, torch.bfloat16, CPU)
    assert all(qb.is_quantized(fresh.get_submodule(n)) for n in names)
    assert max_diff(base_state(fresh), base_state(net), strict=True) == 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        x, t, text = torch.randn(1, 4, 4, 4), torch.tensor([5]), torch.randn(1, 8, 64)
        assert torch.equal(fresh(x, t, encoder_hidden_states=text).sample, net(x, t, encoder_hidden_states=text).sample)
    # Another base (one sampled weight changed), another backend, a damaged copy: quantised again
    other = unet(tiny_pipeline).to(torch.bfloat16)
    with torch.no_grad():
        other.get_submodule(names[3]).weight.view(-1)[0] += 1
    assert "another base" in store.usable(folder, store.fingerprint(other, names, backend, torch.bfloat16))
    alt = "nf4" if backend != "nf4" else "int8"
    assert "another base" in store.usable(folder, dict(info, backend=alt))
    data = bytearray((folder / store.WEIGHTS).read_bytes())
    data[-5] ^= 0xFF
    (folder / store.WEIGHTS).write_bytes(bytes(data))
    assert "CRC32" in store.usable(folder, info)


# The families not run end to end here: their tiny nets (the params their tiny pipelines use) quantise, and
# their LoRA preset lands on quantised layers.
def _tiny_nets():
    from sd_training.families import flux2, qwen_image_parts, sd3, sdxl, zimage

    return {
        "sdxl": ("UNet2DConditionModel", sdxl.TINY_SDXL_UNET),
        "sd3": ("SD3Transformer2DModel", sd3.TINY_SD3_TRANSFORMER),
        "zimage": ("ZImageTransformer2DModel", zimage.TINY_ZIMAGE_TRANSFORMER),
        "flux2_klein": ("Flux2Transformer2DModel", dict(flux2.TINY_FLUX2_TRANSFORMER, guidance_embeds=False)),
        "flux2_dev": ("Flux2Transformer2DModel", dict(flux2.TINY_FLUX2_TRANSFORMER, guidance_embeds=True)),
        "qwen_image": ("QwenImageTransformer2DModel", qwen_image_parts.TINY_QWEN_TRANSFORMER),
        # the edit families train Qwen-Image's transformer (their tiny pipelines use the same params)
        "qwen_image_edit": ("QwenImageTransformer2DModel", qwen_image_parts.TINY_QWEN_TRANSFORMER),
        "qwen_image_edit_plus": ("QwenImageTransformer2DModel", qwen_image_parts.TINY_QWEN_TRANSFORMER),
    }


@pytest.mark.parametrize("family", ["sdxl", "sd3", "zimage", "flux2_klein", "flux2_dev", "qwen_image", "qwen_image_edit"])
def test_every_family_net_quantises_and_its_lora_preset_wraps_the_quantised_layers(family):
    import diffusers

    from sd_training import adapters
    from sd_training.families.registry import FAMILIES

    assert set(FAMILIES) == set(_tiny_nets()) | {"sd", "flux"}  # a new family is added here (or run end to end)
    cls_name, params = _tiny_nets()[family]
    torch.manual_seed(0)
    net = getattr(diffusers, cls_name)(**params).to(torch.bfloat16)
    fam = FAMILIES[family]
    names = qb.targets(fam.compile_units(fam.__new__(fam), net), net)
    assert names, family
    qb.quantize(net, names, "nf4", torch.bfloat16, CPU)
    targets = adapters.resolve_targets(net, fam.adapter_presets, "attention", [], None, "model.adapter", family)
    adapters.inject(net, adapters.lora_config(targets, 2, None, SimpleNamespace(dropout=0.0, use_dora=False,
                                                                                 init="default")))
    wrapped = [n for n, m in net.named_modules() if hasattr(m, "base_layer") and qb.is_quantized(m.base_layer)]
    assert wrapped and set(wrapped) <= set(names), (family, wrapped[:3])
    assert all(p.requires_grad == ("lora_" in n) for n, p in net.named_parameters())


# ---------------------------------------------------------------------------------------------- refusals

REFUSALS = [
    ({"model.adapter.base_quantization": "nf4"}, "model.adapter.type is not set"),
    ({"model.adapter.type": "lora", "model.adapter.base_quantization": "nf4", "model.fp8": "true"}, "model.fp8"),
    ({"model.adapter.type": "lora", "model.adapter.base_quantization": "int8", "distributed.strategy": "fsdp"},
     "distributed.strategy=fsdp"),
    ({"model.adapter.type": "lora", "model.adapter.base_quantization": "nf4", "model.adapter.export_merged": "true"},
     "export_merged"),
    ({"model.adapter.type": "lora", "model.adapter.base_quantization": "gguf"}, "model.adapter.base_gguf"),
    ({"model.adapter.type": "lora", "model.adapter.base_gguf": "x.gguf"}, "model.adapter.base_gguf"),
    ({"model.adapter.type": "lora", "model.adapter.base_quantization": "int4"}, "model.adapter.base_quantization"),
    ({"model.adapter.type": "lora", "model.adapter.base_quantization": "gguf", "model.adapter.base_gguf": "x.gguf",
      "model.adapter.use_dora": "true"}, "use_dora"),
]


@pytest.mark.parametrize("over, words", REFUSALS)
def test_refusals_name_the_key(tmp_path, tiny_pipeline, shapes_shards, over, words):
    from sd_training import configure

    with pytest.raises(ConfigError, match="base_quantization|base_gguf") as e:
        configure.load(train_args(tmp_path, tiny_pipeline, shapes_shards, **over))
    assert words in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------- runs

def generate(pipe, **kw):
    """An image at the runs' 32 px: 2 steps, seed 3, in [0, 1]."""
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(prompt="a red circle on a blue background", height=32, width=32, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(3), output_type="np", **kw).images[0]


@pytest.mark.slow
def test_sd_nf4_run_resumes_exactly_on_its_stored_base_and_its_lora_loads_on_the_full_precision_pipeline(
        tmp_path, tiny_pipeline, shapes_shards):
    """Killed after its first checkpoint and restarted, an nf4 LoRA run (bf16, EMA) ends bit-identical to the
    straight run, reloading its quantised base from the run folder; its checkpoints hold the adapter only; its
    LoRA export loads on the plain bf16 pipeline with load_lora_weights and changes the image."""
    import numpy as np
    from diffusers import DiffusionPipeline
    from test_resume import N, args_for, assert_same, final_state, finish, kill_after_checkpoint, launch, losses

    from sd_training import adapters
    from sd_training.checkpoint import complete_steps

    kw = {"model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.base_quantization": "nf4",
          "model.mixed_precision": "bf16", "optimizer.params.learning_rate": 1e-2,
          "experiment.checkpoint_async": "false"}
    straight = finish(launch(tmp_path, args_for(tmp_path, tiny_pipeline, shapes_shards, "straight", **kw)))
    assert "quantised now" in straight
    resumed = args_for(tmp_path, tiny_pipeline, shapes_shards, "resumed", **kw)
    run = tmp_path / "runs" / "resumed"
    kill_after_checkpoint(launch(tmp_path, resumed, 1), run / "checkpoints", 3)
    assert max(complete_steps(run / "checkpoints")) < N
    out = finish(launch(tmp_path, resumed, 1))
    assert "resumed from" in out and "reloaded from" in out and "quantised now" not in out, out[-3000:]
    a, ta = final_state(tmp_path / "runs" / "straight")
    b, tb = final_state(run)
    assert ta["step"] == tb["step"] == N
    for name in ("unet", "ema", "optimizer", "lr_scheduler"):
        assert_same(a[name], b[name], name)
    assert a["unet"] and all("lora_" in k for k in a["unet"]), sorted(a["unet"])[:3]  # the adapter only
    la, lb = losses(tmp_path / "runs" / "straight"), losses(run)
    assert all(la[s] == lb[s] for s in range(4, N + 1)), (la, lb)
    stored = [(tmp_path / "runs" / r / "quantized_base" / store.WEIGHTS).read_bytes() for r in ("straight", "resumed")]
    assert stored[0] == stored[1]  # the same quantisation of the same base
    # The export: a plain LoRA file on the full-precision base
    export = tmp_path / "runs" / "straight" / "current_pipeline"
    assert (export / adapters.LORA_FILE).is_file()
    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline, dtype=torch.bfloat16)
    before = generate(pipe)
    pipe.load_lora_weights(str(export))
    loaded = {k: v for k, v in pipe.unet.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(a["unet"])
    after = generate(pipe)
    assert np.abs(after - before).max() > 1e-2, np.abs(after - before).max()


@pytest.mark.slow
@pytest.mark.distributed
def test_flux_int8_weight_lora_on_two_ddp_ranks_trains_the_same_adapter_on_both(tmp_path, flux_pipeline, shapes_shards):
    import os
    import sys
    from pathlib import Path

    import forked

    args = train_args(tmp_path, flux_pipeline, shapes_shards, name="ddp", **{
        "model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.base_quantization": "int8_weight",
        "model.mixed_precision": "bf16", "dataset.params.resolution": 32, "system.batch_size": 2,
        "experiment.num_examples_to_see": 12, "experiment.sample_per_prompt": 0, "model.t5.max_length": 16})
    out = tmp_path / "adapter"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={forked._free_port()}", str(Path(__file__).parent / "quantized_worker.py"), str(out), *args]
    res = forked.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
                     timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "int8_weight" in res.stdout + res.stderr and "quantised now" in res.stdout + res.stderr
    ranks = [torch.load(f"{out}.rank{r}.pt") for r in (0, 1)]
    assert ranks[0] and all("lora_" in k for k in ranks[0])
    assert max_diff(ranks[0], ranks[1], strict=True) == 0
    assert max(float(v.abs().max()) for k, v in ranks[0].items() if "lora_B" in k) > 0  # it trained


@pytest.mark.slow
def test_flux_lora_on_a_gguf_file_trains_and_its_export_loads_on_the_full_precision_pipeline(
        tmp_path, flux_pipeline, shapes_shards):
    """The transformer read from a GGUF file (Q8_0 block layers) instead of the pipeline's weights; the LoRA
    trains, checkpoints hold it alone, and plain diffusers loads it on the bf16 pipeline to another image."""
    import numpy as np
    from diffusers import DiffusionPipeline, FluxTransformer2DModel
    from helpers import run_trainer

    from sd_training import adapters, configure
    from sd_training.families.components.transformer import transformer_blocks

    full = FluxTransformer2DModel.from_pretrained(flux_pipeline, subfolder="transformer")
    path = write_gguf(full, tmp_path / "flux.gguf", qb.targets(transformer_blocks(full), full))
    cfg = configure.load(train_args(tmp_path, flux_pipeline, shapes_shards, name="gguf", **{
        "model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.base_quantization": "gguf",
        "model.adapter.base_gguf": path, "model.mixed_precision": "bf16", "dataset.params.resolution": 32,
        "experiment.num_examples_to_see": 12, "experiment.checkpoint_every": 3, "experiment.sample_per_prompt": 0,
        "optimizer.params.learning_rate": 1e-2, "model.t5.max_length": 16}))
    t = run_trainer(cfg)
    quantised = [n for n, m in t.net.named_modules() if qb.is_quantized(m) and not hasattr(m, "base_layer")]
    assert len(quantised) >= 10 and type(t.net.get_submodule(quantised[0])).__name__ == "GGUFLinear"
    assert not (t.run_dir.quantized_base).exists()  # the file is the stored base
    from sd_training.checkpoint import Checkpointer

    shared, _, _ = Checkpointer.load(t.run_dir.checkpoints / "step_00000003", 0)
    assert shared["transformer"] and all("lora_" in k for k in shared["transformer"])
    pipe = DiffusionPipeline.from_pretrained(flux_pipeline, dtype=torch.bfloat16)
    before = generate(pipe, max_sequence_length=16)
    pipe.load_lora_weights(str(t.run_dir.root / "current_pipeline"))
    assert any("lora_" in k for k in pipe.transformer.state_dict())
    after = generate(pipe, max_sequence_length=16)
    assert np.abs(after - before).max() > 1e-3, np.abs(after - before).max()
    assert (t.run_dir.root / "current_pipeline" / adapters.LORA_FILE).is_file()


def test_a_lokr_or_loha_on_a_quantised_base_is_refused_naming_both_keys(tiny_pipeline, shapes_shards, tmp_path):
    from sd_training.config import ConfigError
    from sd_training.configure import load

    for kind in ("lokr", "loha"):
        with pytest.raises(ConfigError, match=f"base_quantization=nf4' with model.adapter.type={kind}"):
            load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{
                "model.adapter.type": kind, "model.adapter.base_quantization": "nf4"}))


def test_the_start_up_plan_counts_a_torchao_weight_at_its_stored_bytes():
    """torchao's quantised weights report their logical dtype (bf16: 2 bytes); the plan counts their inner
    tensors (1 byte per weight and a scale per row), as components.quantized_base.stored_bytes measures them."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from sd_training.memory.plan import tensor_bytes

    layer = torch.nn.Sequential(torch.nn.Linear(256, 512)).to(torch.bfloat16)
    quantize_(layer, Int8WeightOnlyConfig())
    w = layer[0].weight
    assert w.element_size() == 2 and w.scale.numel() == 512
    assert tensor_bytes(w) == 256 * 512 * 1 + 512 * w.scale.element_size()  # int8 weights, a scale per row
