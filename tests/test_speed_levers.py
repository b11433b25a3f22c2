"""Issue 24's speed levers on the CPU: channels-last (model.channels_last) gives the default layout's loss
and gradients; regional compilation (model.compile_scope) and the compiler's cache (model.compile_cache,
sd_training.speed.compile_cache); bench_step's --compile / --channels-last / --profile flags."""

from __future__ import annotations

import pytest
import torch
from conftest import counting_backend, train_args

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families import registry
from sd_training.families.components.unet import uses_channels_last

pytestmark = pytest.mark.usefixtures("one_thread")

CL = torch.channels_last


def family_for(tmp_path, pipeline, shards, **overrides):
    overrides = {"model.vae.latent_sampling": "mean", **overrides}  # no posterior draw: both see the same latents
    cfg = load(train_args(tmp_path, pipeline, shards, **overrides))
    return cfg, registry.create(cfg, torch.device("cpu"), cfg.system.seed, True)


def batch_of(family, pixels: bool, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = family.models.tokenizer(["a red circle"] * n, padding="max_length", max_length=77,
                                  return_tensors="pt").input_ids
    out = {"input_ids": ids}
    if getattr(family.models, "tokenizer_2", None) is not None:
        out["input_ids_2"] = family.models.tokenizer_2(["a red circle"] * n, padding="max_length", max_length=77,
                                                       return_tensors="pt").input_ids
    if pixels:
        out["pixel_values"] = torch.rand(n, 3, 64, 64, generator=g) * 2 - 1
    else:
        out["latents"] = torch.randn(n, 4, 8, 8, generator=g)
    fixed = {"noise": torch.randn(n, 4, 8, 8, generator=g), "timesteps": torch.tensor([10, 700])}
    return out, fixed


def loss_and_grads(family, batch, fixed, dtype):
    family.net.zero_grad(set_to_none=True)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)
    out = family.loss(family.loss_module, batch, autocast, fixed)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in family.net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("which", ["sd", pytest.param("sdxl", marks=pytest.mark.slow)])  # SDXL: 35 s under load
def test_channels_last_gives_the_default_layouts_loss_and_gradients(tmp_path, request, shapes_shards, which):
    """The UNet (and the VAE) in channels-last, latents and noisy latents too: the loss and every gradient
    equal the default (NCHW) layout's, in fp32 (to float rounding) and under bf16 autocast (to bf16's)."""
    pipeline = request.getfixturevalue("tiny_pipeline" if which == "sd" else "sdxl_pipeline")
    default_cfg, default = family_for(tmp_path, pipeline, shapes_shards, name="a")
    assert default_cfg.model.channels_last == "auto" and not uses_channels_last(default_cfg.model, torch.device("cpu"))
    assert uses_channels_last(default_cfg.model, torch.device("cuda"))  # auto: on for the UNet on CUDA
    _, cl = family_for(tmp_path, pipeline, shapes_shards, name="b", **{"model.channels_last": "true"})
    conv_weights = [m.weight for m in cl.net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert conv_weights and all(w.is_contiguous(memory_format=CL) for w in conv_weights)
    assert not cl.net.conv_in.weight.is_contiguous()  # (a 1x1 kernel is both)
    vae_conv = cl.models.vae.encoder.conv_in.weight
    assert vae_conv.is_contiguous(memory_format=CL) and not vae_conv.is_contiguous()
    assert not default.net.conv_in.weight.is_contiguous(memory_format=CL)
    # fp32, from pixels (the VAE in channels-last too): equal to float rounding (measured 1.8e-5 of each
    # gradient's largest entry)
    batch, fixed = batch_of(default, pixels=True)
    assert cl.latents(batch).is_contiguous(memory_format=CL)  # the UNet's input follows its layout
    want_loss, want = loss_and_grads(default, batch, fixed, None)
    got_loss, got = loss_and_grads(cl, batch, fixed, None)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys() and len(got) > 20
    assert max_error(got, want) < 2e-4
    assert got["conv_in.weight"].is_contiguous(memory_format=CL)  # gradients in the weights' layout
    # bf16 autocast, from latents: channels-last is as close to the fp32 gradients as the default layout is.
    # The largest error over a net's parameters is an extreme value of bf16 rounding, and which layout wins
    # on one batch depends on the CPU's bf16 kernels (SDXL, batch 0 on one machine: 12.5% vs 7.8%, each
    # other within 10.5%; batches 1, 2: 8.8% vs 9.9%, 7.4% vs 6.2%): the errors are averaged over 3 batches.
    errors = {"channels_last": [], "default": [], "mutual": []}
    for seed in range(3):
        batch, fixed = batch_of(default, pixels=False, seed=seed)
        _, fp32 = loss_and_grads(default, batch, fixed, None)
        want_loss, want = loss_and_grads(default, batch, fixed, torch.bfloat16)
        got_loss, got = loss_and_grads(cl, batch, fixed, torch.bfloat16)
        torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=2e-3)
        errors["channels_last"].append(max_error(got, fp32))
        errors["default"].append(max_error(want, fp32))
        errors["mutual"].append(max_error(got, want))
    mean = {k: sum(v) / len(v) for k, v in errors.items()}
    assert mean["channels_last"] < 1.3 * mean["default"] + 1e-3, errors
    assert mean["mutual"] < 0.1, errors


def max_error(got: dict, want: dict) -> float:
    """The largest error over the parameters, each relative to its gradient's largest entry."""
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)).item() for n in want)


def test_channels_last_keeps_its_old_boolean_values(tmp_path, tiny_pipeline, shapes_shards):
    for value, want in (("true", "on"), ("false", "off"), ("on", "on"), ("off", "off"), ("auto", "auto")):
        cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"model.channels_last": value}))
        assert cfg.model.channels_last == want
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards), yaml_text="model:\n  channels_last: true\n")
    assert cfg.model.channels_last == "on" and uses_channels_last(cfg.model, torch.device("cpu"))
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards), yaml_text="model:\n  channels_last: false\n")
    assert not uses_channels_last(cfg.model, torch.device("cuda"))
    with pytest.raises(ConfigError, match="channels_last"):
        load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"model.channels_last": "sometimes"}))


def test_channels_last_auto_passes_where_on_is_refused(tmp_path, tiny_pipeline, shapes_shards):
    """A transformer family and the autoencoder stage refuse model.channels_last=on; auto is off there."""
    args = train_args(tmp_path, tiny_pipeline, shapes_shards, **{"model.train_target": "vae", "model.use_ema": "false"})
    cfg = load(args)
    assert not uses_channels_last(cfg.model, torch.device("cuda"))
    with pytest.raises(ConfigError, match="channels_last"):
        load(args + ["model.channels_last=on"])


def test_resuming_with_another_layout_or_compile_scope_is_not_a_change():
    from sd_training.checkpoint.resume_config import config_changes

    saved = "model:\n  channels_last: false\n"
    free, _, refused = config_changes(saved, {"model": {"channels_last": "auto", "compile_scope": "whole"}})
    assert refused == [] and len(free) == 2


# ---------------------------------------------------------------- regional compilation (model.compile_scope)


def unet_step(net, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, 8, generator=g)
    hidden = torch.randn(2, 77, net.config.cross_attention_dim, generator=g)
    added = None
    if net.config.addition_embed_type == "text_time":  # SDXL: pooled text and size conditioning
        added = {"text_embeds": torch.randn(2, net.config.projection_class_embeddings_input_dim
                                             - 6 * net.config.addition_time_embed_dim, generator=g),
                 "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)}
    out = net(x, torch.tensor([10, 500]), hidden, added_cond_kwargs=added, return_dict=False)[0]
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("which", ["sd", pytest.param("sdxl", marks=pytest.mark.slow)])  # SDXL: 35 s under load
def test_unet_blocks_compile_one_by_one_in_place_and_equal_eager(request, which):
    """compile_scope=blocks: each ResNet and attention block of the UNet is compiled on its own, in place; the blocks of one shape share a graph; outputs and gradients equal eager. (A counting
    backend: what dynamo hands the compiler, no code generation.)"""
    import types

    from diffusers import UNet2DConditionModel

    from sd_training.build import compile_model
    from sd_training.families.unet_family import compile_units

    torch._dynamo.reset()
    pipeline = request.getfixturevalue("tiny_pipeline" if which == "sd" else "sdxl_pipeline")
    net = UNet2DConditionModel.from_pretrained(pipeline, subfolder="unet")
    want_out, want = unet_step(net)
    backend, graphs = counting_backend()
    family = types.SimpleNamespace(compile_units=compile_units, net_name="unet")
    assert compile_model(net, family, net, "blocks", backend=backend) is net  # not replaced
    units = compile_units(net)
    kinds = {type(u).__name__ for u in units}
    assert kinds == {"ResnetBlock2D", "Transformer2DModel"}, kinds
    assert all(u._compiled_call_impl is not None for u in units)
    assert not any(m._compiled_call_impl is not None for m in (net, net.conv_in, net.down_blocks[0]))
    got_out, got = unet_step(net)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    n_graphs = len(graphs)
    assert 2 <= n_graphs < len(units)  # shared by the blocks of one shape (forward graphs; backward by AOT)
    unet_step(net, seed=2)
    assert len(graphs) == n_graphs  # new values, same shapes: no recompilation


def test_whole_scope_compiles_the_wrapped_module_as_one_graph():
    import types

    from sd_training.build import compile_model
    from sd_training.families.unet_family import compile_units

    torch._dynamo.reset()
    backend, graphs = counting_backend()
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.SiLU())
    family = types.SimpleNamespace(compile_units=compile_units, net_name="unet")
    out = compile_model(model, family, model, "whole", backend=backend)
    assert isinstance(out, torch._dynamo.eval_frame.OptimizedModule)
    out(torch.randn(1, 4, 4, 4))
    assert len(graphs) == 1


def test_compile_scope_is_a_checked_key(tmp_path, tiny_pipeline, shapes_shards):
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards))
    assert cfg.model.compile_scope == "auto" and cfg.model.compile_cache is None
    with pytest.raises(ConfigError, match="compile_scope"):
        load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"model.compile_scope": "everything"}))


# ---------------------------------------------------------------- the compiler's cache (model.compile_cache)

ROUND = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from sd_training.speed.compile_cache import CompileCache
torch.set_num_threads(1)
cache = CompileCache(sys.argv[1], torch.device("cpu"))
loaded = cache.load()
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
m.compile()
opt = torch.optim.SGD(m.parameters(), lr=0.1)
cache.save_after_first_step(opt)
for _ in range(2):
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
print(json.dumps({"loaded": loaded, "entries": cache.loaded, "saved": cache.saved_bytes,
                  "hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def run_round(tmp_path, name: str) -> dict:
    """One process compiling a small module with inductor, from an empty inductor cache (a fresh machine)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor_{name}"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", ROUND, str(tmp_path / "cache")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(torch.compiler, "save_cache_artifacts"), reason="torch < 2.7: no cache artifacts")
def test_a_second_run_on_a_fresh_machine_loads_the_compiled_graphs(tmp_path):
    """The first run compiles (inductor, C++ on the CPU) and saves its artifacts after its first optimizer
    step; the second, with an empty inductor cache as on a new machine, loads them before compiling and
    every graph is a cache hit (forward and backward), none compiled again."""
    first = run_round(tmp_path, "a")
    assert first["loaded"] is False and first["saved"] > 0 and first["misses"] >= 2 and first["hits"] == 0
    second = run_round(tmp_path, "b")
    assert second["loaded"] is True and second["entries"].get("inductor", 0) >= 2
    assert second["hits"] >= 2 and second["misses"] == 0


def test_the_cache_is_skipped_where_torch_lacks_it_or_the_file_is_bad(tmp_path, monkeypatch, caplog):
    from sd_training.speed.compile_cache import artifact_file, for_run

    cache = for_run(None, tmp_path / "run", torch.device("cpu"), is_main=True)
    assert cache.path == artifact_file(tmp_path / "run" / "compile_cache", torch.device("cpu"))
    assert cache.path.name.startswith("torch-") and cache.path.name.endswith("-cpu.bin")
    assert cache.load() is False  # nothing saved yet
    cache.path.parent.mkdir(parents=True)
    cache.path.write_bytes(b"not a cache")
    with caplog.at_level("WARNING"):
        assert cache.load() is False
    assert "could not be loaded" in caplog.text
    shared = for_run(str(tmp_path / "shared"), tmp_path / "run", torch.device("cpu"), is_main=False)
    assert shared.path.parent == tmp_path / "shared" and shared.save() is False  # only rank 0 saves
    monkeypatch.delattr(torch.compiler, "save_cache_artifacts", raising=False)
    monkeypatch.delattr(torch.compiler, "load_cache_artifacts", raising=False)
    assert cache.load() is False and cache.save() is False


def test_the_trainer_loads_the_cache_before_compiling_and_saves_after_its_first_step(tmp_path, tiny_pipeline,
                                                                                     shapes_shards, caplog):
    """Wiring, without compiling (torch.compile compiles at the first call): model.compile loads the cache
    at set-up and hooks the save to the first optimizer step, beside the checkpoints' own hook (a hook that
    removed itself there broke the optimizer's iteration over its hooks: seen on an H200). compile_scope
    auto is the family's: the whole UNet, each block of a transformer."""
    from sd_training import distributed
    from sd_training.families.base import Family
    from sd_training.families.sd import StableDiffusion
    from sd_training.loop import Trainer

    folder = tmp_path / "shared_cache"
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards,
                          **{"model.compile": "true", "model.compile_cache": str(folder)}))
    t = Trainer(cfg, distributed.setup("cpu"))
    with caplog.at_level("INFO"):
        t.setup()
    assert f"no compile cache at {folder}" in caplog.text
    assert "the whole unet compiled as one graph" in caplog.text
    assert StableDiffusion.compile_scope_auto == "whole" and Family.compile_scope_auto == "blocks"
    hooks = list(t.optimizer._optimizer_step_post_hooks.values())
    assert any(getattr(h, "__qualname__", "").startswith("CompileCache") for h in hooks) and len(hooks) >= 2
    for _ in range(2):
        t.optimizer.step()  # no gradients: only the hooks run
    t.trackers.close()


# ---------------------------------------------------------------- bench_step's flags

TINY_SD_UNET = ('{"block_out_channels": [8, 16], "layers_per_block": 1, "norm_num_groups": 8, '
                '"cross_attention_dim": 32, "attention_head_dim": 2, "sample_size": 8, '
                '"down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"]}')


def run_bench_step(tmp_path, *flags) -> dict:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_step.py"
    spec = importlib.util.spec_from_file_location("bench_step", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.main(["--out", str(tmp_path / "bench.json"), "--threads", "1", *flags])


TINY_TEXT = '{"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4, "projection_dim": 32}'


@pytest.mark.slow  # a minute on the shared CPU (two trainers, 4 steps and a profile each)
def test_bench_step_sd_rows_with_levers_baseline_and_profile(tmp_path):
    """--sd-only --sd-baseline --channels-last on --profile on the CPU: an eager NCHW row, then one with
    channels-last and its speed-up, each with its warm-up and a profile whose kinds add up to the whole."""
    out = run_bench_step(tmp_path, "--sd-only", "--sd-unet", TINY_SD_UNET, "--sd-text-encoder", TINY_TEXT, "--sd-resolutions", "64", "--sd-batch", "2",
                         "--sd-steps", "2", "--channels-last", "on", "--sd-baseline", "--profile", "--profile-steps", "1")
    assert "overhead" not in out and out["levers"]["channels_last"] == "on"
    first, levers = out["sd1_unet"]
    assert first["variant"] == "eager_nchw" and first["channels_last"] is False and first["compile"] == "none"
    assert first["compile_mode"] == "default" and out["levers"]["compile_mode"] == "default"
    assert levers["channels_last"] is True and levers["speedup_vs_first"] > 0
    for row in (first, levers):
        assert row["first_step_s"] > 0 and row["warmup_s"] >= row["first_step_s"] and row["compile_warmup_s"] is None
        kinds = row["profile"]["kinds"]
        assert abs(sum(k["share"] for k in kinds.values()) - 1) < 1e-6
        assert {"convolutions", "GEMMs", "norms", "optimizer"} <= set(kinds), kinds
        assert kinds["convolutions"]["share"] > 0.02


def test_kernel_kinds_classify_the_h100_profiles_kernel_names():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from kernel_kinds import kind_of

    assert kind_of("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>") == "layout transposes"
    assert kind_of("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc") == "convolutions"
    assert kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert kind_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "GEMMs"
    assert kind_of("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>") == "norms"
    assert kind_of("void at::native::multi_tensor_apply_kernel<FusedAdamWMathFunctor>") == "optimizer"
    assert kind_of("triton_poi_fused_add_silu_3") == "element-wise"
    assert kind_of("aten::mkldnn_convolution") == "convolutions" and kind_of("aten::addmm") == "GEMMs"
    assert kind_of("Optimizer.step: aten::mul_") == "optimizer"


# ---------------------------------------------------------------- model.fp8 (torchao float8 training)


@pytest.mark.slow  # 45 s wall on the shared CPU (imports torchao and diffusers models; 14 s CPU)
def test_fp8_converts_the_transformer_blocks_linear_layers():
    """model.fp8: the Linear layers inside the transformer blocks become torchao's Float8Linear (the same
    parameters, names and values: checkpoints and exports unchanged); embeddings and the final projection
    stay; the converted net trains (emulated on the CPU) close to the fp32 one (e4m3 has 3 mantissa bits)."""
    pytest.importorskip("torchao")
    from diffusers import SD3Transformer2DModel
    from torchao.float8.float8_linear import Float8Linear

    from sd_training.speed import fp8
    from sd_training.families.components.transformer import transformer_blocks

    def build():
        torch.manual_seed(0)
        return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                     caption_projection_dim=32, pooled_projection_dim=16, pos_embed_max_size=8)

    def step(net):
        g = torch.Generator().manual_seed(1)
        out = net(hidden_states=torch.randn(2, 4, 8, 8, generator=g), encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
                  pooled_projections=torch.randn(2, 16, generator=g), timestep=torch.tensor([10.0, 500.0]),
                  return_dict=False)[0]
        out.square().mean().backward()
        return out.detach()

    ref, net = build(), build()
    names = {n: p.clone() for n, p in net.named_parameters()}
    n = fp8.convert(transformer_blocks(net), torch.device("cpu"))
    converted = [m for m in net.modules() if isinstance(m, Float8Linear)]
    assert n == len(converted) > 0
    assert all(any(m is c for b in transformer_blocks(net) for m in b.modules()) for c in converted)
    assert not isinstance(net.proj_out, Float8Linear) and not isinstance(net.context_embedder, Float8Linear)
    assert {k: v for k, v in net.named_parameters()}.keys() == names.keys()
    assert all(torch.equal(p, names[k]) for k, p in net.named_parameters())
    want, got = step(ref), step(net)
    assert ((got - want).norm() / want.norm()).item() < 0.15
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for m in converted for p in m.parameters())


def test_fp8_is_refused_with_an_adapter_or_without_torchao(monkeypatch):
    from sd_training.speed import fp8

    with pytest.raises(ConfigError, match="model.adapter"):
        fp8.check(adapter=True) if fp8.importlib.util.find_spec("torchao") else pytest.skip("no torchao")
    monkeypatch.setattr(fp8.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="needs torchao"):
        fp8.check(adapter=False)
