"""Issue 24's speed levers on the CPU: channels-last (model.channels_last) gives the default layout's loss
and gradients; regional compilation (model.compile_scope) and the compiler's cache (model.compile_cache,
sd_training.compile_cache); bench_step's --compile / --channels-last / --profile flags."""

from __future__ import annotations

import pytest
import torch
from conftest import train_args

from sd_training.config import ConfigError
from sd_training.config.checks import load
from sd_training.families import registry
from sd_training.families.unet_components import uses_channels_last

pytestmark = pytest.mark.usefixtures("one_thread")

CL = torch.channels_last


def family_for(tmp_path, pipeline, shards, **overrides):
    overrides = {"model.vae.latent_sampling": "mean", **overrides}  # no posterior draw: both see the same latents
    cfg = load(train_args(tmp_path, pipeline, shards, **overrides))
    return cfg, registry.create(cfg, torch.device("cpu"), cfg.system.seed, True)


def batch_of(family, pixels: bool, n=2):
    g = torch.Generator().manual_seed(0)
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


@pytest.mark.parametrize("which", ["sd", "sdxl"])
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
    # bf16 autocast, from latents: channels-last is as close to the fp32 gradients as the default layout is
    # (measured: 9% of the largest entry, both; each other within 5%)
    batch, fixed = batch_of(default, pixels=False)
    _, fp32 = loss_and_grads(default, batch, fixed, None)
    want_loss, want = loss_and_grads(default, batch, fixed, torch.bfloat16)
    got_loss, got = loss_and_grads(cl, batch, fixed, torch.bfloat16)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=2e-3)
    assert max_error(got, fp32) < 1.3 * max_error(want, fp32) + 1e-3
    assert max_error(got, want) < 0.1


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
