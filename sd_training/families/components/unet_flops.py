"""FLOPs per training image of the UNet families, counted on the meta device with ``speed.flops``'s
counter (its module doc has the conventions): one UNet forward and its forward + backward on one image's
meta inputs (as the family lays them out: ``Family.flop_inputs``; SDXL adds its pooled text and size
ids), the frozen VAE encoder and the CLIP text encoder. Configs (dicts) are built as diffusers'
``UNet2DConditionModel`` / ``AutoencoderKL`` and transformers' ``CLIPTextModel``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...outputs.export import unwrap
from ...speed.flops import StepFlops, count_flops, height_width, latent_size_of, meta_copy
from ...speed.flops import vae_encode_flops as _vae_encode_flops

# (the meta UNet, latent pixels (h, w), text tokens, batch) -> (args, kwargs) of its forward, on meta
UNetInputs = Callable[[torch.nn.Module, tuple[int, int], int, int], tuple[tuple, dict]]


def unet_inputs(unet: torch.nn.Module, latent_size, seq_len: int, batch: int) -> tuple[tuple, dict]:
    """A conditional UNet's forward arguments: noisy latents, timesteps, the text encoder's states."""
    cfg = unet.config
    h, w = height_width(latent_size)
    ctx_dim = cfg.encoder_hid_dim or cfg.cross_attention_dim
    args = (
        torch.empty(batch, cfg.in_channels, h, w, device="meta"),
        torch.zeros(batch, dtype=torch.long, device="meta"),
        torch.empty(batch, seq_len, ctx_dim, device="meta"),
    )
    return args, {}


def meta_unet(unet, gradient_checkpointing: bool = False) -> torch.nn.Module:
    """A meta copy of ``unet`` (a module, or a UNet2DConditionModel config) with SDPA attention."""
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0

    m = meta_copy(unet, UNet2DConditionModel)
    # xformers has no meta kernels; its FLOPs equal SDPA's, so SDPA is counted whatever the backend.
    m.set_attn_processor(AttnProcessor2_0())
    if gradient_checkpointing:
        m.enable_gradient_checkpointing()
    return m


def unet_forward_flops(unet, latent_size: int | tuple[int, int], seq_len: int = 77,
                       inputs: UNetInputs = unet_inputs) -> int:
    """FLOPs of one UNet forward for one image. ``unet``: a module or its config dict (UNet2DConditionModel).

    ``latent_size``: latent pixels (64 for SD 1.x at 512 px); ``seq_len``: text tokens (77 for CLIP).
    """
    m = meta_unet(unet).eval()
    args, kwargs = inputs(m, latent_size, seq_len, 1)
    with torch.no_grad():
        return count_flops(lambda: m(*args, **kwargs, return_dict=False))


def unet_train_flops(unet, latent_size, seq_len: int = 77, gradient_checkpointing: bool = False,
                     inputs: UNetInputs = unet_inputs) -> int:
    """FLOPs of the UNet's forward + backward for one image, as autograd runs it (with recomputation)."""
    m = meta_unet(unet, gradient_checkpointing).train()
    args, kwargs = inputs(m, latent_size, seq_len, 1)
    return count_flops(lambda: m(*args, **kwargs, return_dict=False)[0].sum().backward())


def vae_encode_flops(vae, resolution: int | tuple[int, int]) -> int:
    """FLOPs of the VAE encoder (with its quant conv) for one image: a module, or an AutoencoderKL config."""
    from diffusers import AutoencoderKL

    return _vae_encode_flops(vae, resolution, AutoencoderKL)


def text_encode_flops(text_encoder, seq_len: int = 77) -> int:
    """FLOPs of the text encoder for one caption of ``seq_len`` tokens (a module, or a CLIPTextConfig)."""
    from transformers import CLIPTextModel

    m = meta_copy(text_encoder, CLIPTextModel).eval()
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    with torch.no_grad():
        return count_flops(lambda: m(ids, return_dict=False))


def count_step_flops(
    models, resolution: int | tuple[int, int], gradient_checkpointing: bool = False, encode_images: bool = True,
    seq_len: int | None = None, inputs: UNetInputs = unet_inputs,
) -> StepFlops:
    """Count once at start-up for a ``Models`` (``sd_training.families.components.unet``) training at ``resolution`` px.

    ``encode_images=False`` when batches carry precomputed latents (the VAE does not run in the step);
    ``inputs``: the family's UNet forward arguments.
    """
    seq_len = seq_len or int(getattr(models.tokenizer, "model_max_length", 77))
    latent = latent_size_of(models.vae, resolution)
    unet = unwrap(models.unet)
    return StepFlops(
        unet_forward=unet_forward_flops(unet, latent, seq_len, inputs),
        unet_train=unet_train_flops(unet, latent, seq_len, gradient_checkpointing, inputs),
        vae_encode=vae_encode_flops(models.vae, resolution) if encode_images else 0,
        text_encode=text_encode_flops(models.text_encoder, seq_len),
    )


def model_flops_per_image(unet, latent_size: int | tuple[int, int], seq_len: int = 77) -> int:
    """Model FLOPs per training image: 3 x one UNet forward (dense convention, implementation-free)."""
    return 3 * unet_forward_flops(unet, latent_size, seq_len)


def hardware_flops_per_image(
    unet, latent_size: int | tuple[int, int], seq_len: int = 77, *, gradient_checkpointing: bool = False,
    vae=None, resolution: int | tuple[int, int] | None = None, text_encoder=None,
) -> int:
    """Hardware FLOPs per training image: UNet forward + backward as run (with recomputation when
    ``gradient_checkpointing``), plus the VAE encoder at ``resolution`` when ``vae`` is given (omit it for
    precomputed latents) and the text encoder when given."""
    total = unet_train_flops(unet, latent_size, seq_len, gradient_checkpointing)
    if vae is not None:
        if resolution is None:
            raise ValueError("hardware_flops_per_image: pass the image resolution with the vae")
        total += vae_encode_flops(vae, resolution)
    if text_encoder is not None:
        total += text_encode_flops(text_encoder, seq_len)
    return total
