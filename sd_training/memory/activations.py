"""One sample's activations (what autograd keeps for the backward), from a trained module's config alone:
the arithmetic of the architectures the families train. A family picks the estimate that fits its net
(``Family.sample_activation_elements``) and the memory plan multiplies it by the compute dtype's bytes
and the micro-batch (``memory.fit``); nothing here knows a family or builds a module (no torch).

Convolutional nets (diffusers' UNet2DConditionModel and AutoencoderKL layouts): elements per channel x
pixel of each level, fitted to the tensors these save (tiny, SD 1.x and 2.x widths; within 5% in fp32;
78-96% of them under bf16 autocast on an H200), memory-efficient attention assumed, the forward's
temporaries and the backward's gradients not counted: a lower bound of the peak.

Diffusion transformers: image tokens (latent pixels / patch^2, or packed 2x2 latents: ``image_tokens``; an
edit sample's references add as many each) and text tokens run through every block together (joint attention),
so one sample saves about ``K x S x D`` elements per block (S = image + text tokens, D = heads x head dim). K
was measured with autograd's saved-tensor hooks on diffusers' SD3Transformer2DModel and FluxTransformer2DModel
(fp32 on the CPU, parameters left out, memory-efficient attention assumed: the S x S probabilities of the math
kernel left out): 25.3-25.5 for a joint (two-stream) block with RMS q/k norms, 24.3-24.5 for Flux's
double-stream block and 21.2-21.3 for its single-stream block, at widths 64-128 and 64-256 image tokens, plus
0.3-2.2 outside the blocks. With gradient checkpointing diffusers keeps each block's inputs (S x D) and
recomputes one block at a time during the backward. Counted at the compute dtype's bytes, as the UNet estimate
is: a lower bound of the peak (some saved tensors stay fp32 under autocast; the forward's temporaries and the
backward's gradients are not counted). SD3.5-medium's dual-attention blocks (a second attention over the image
tokens) save more than the estimate says.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SampleShape:
    """What one training sample looks like to the estimate: ``resolution`` pixels a side, ``vae_factor``
    pixels per latent pixel, the VAE's ``latent_channels`` (None: not known before it is read), the
    ``text_tokens`` the net attends to beside the image and the ``references`` (edit training,
    ``dataset.params.references``), each at the target's size (``reference_crop`` aligned and center alike
    bring it there), whose tokens join the target's."""

    resolution: float
    vae_factor: int = 8
    latent_channels: int | None = None
    text_tokens: int = 77
    references: int = 0

    @property
    def latent(self) -> float:
        """Latent pixels a side."""
        return self.resolution / self.vae_factor


# ----------------------------------------------------------------------------------------------
# Convolutional nets: the UNet and the autoencoder.
# ----------------------------------------------------------------------------------------------

# Elements autograd saves per channel x pixel of a level, per block: fitted (least squares) to the saved
# tensors of diffusers' UNet2DConditionModel (tiny, SD 1.x and 2.x configs, 8-32 latent pixels, fp32,
# SDPA attention) and AutoencoderKL (tiny and SD's, 64-128 px): predictions within 5% of the measurement.
# On an H200 under bf16 autocast (flash attention), the estimate at 2 bytes per element was 78% (SD 1.5,
# 512 px, batch 1-4: 0.91 of 1.16-1.20 GiB per sample) and 96% (SDXL, 1024 px: 7.26 of 7.54 GiB) of what
# the forward kept beyond autocast's weight copies (some saved tensors stay fp32): a lower bound.
UNET_RESNET = 9.0  # per resnet block
UNET_TRANSFORMER = 33.0  # per transformer layer (self- and cross-attention, feed-forward)
VAE_BLOCK = 7.3  # AutoencoderKL: per resnet block of the encoder and decoder
# What gradient checkpointing keeps: diffusers checkpoints whole blocks, measured 0.16-0.19 of the above on
# the CPU (tiny, SD 1.x) and 0.09 (SDXL, 1024 px) to 0.25 (SD 1.5, 512 px) on an H200 in bf16: the lowest.
CHECKPOINTED = 0.08
UNET_DEFAULTS = dict(  # UNet2DConditionModel's defaults (SD 1.x's layout)
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    layers_per_block=2, transformer_layers_per_block=1, mid_block_type="UNetMidBlock2DCrossAttn",
)
VAE_DEFAULTS = dict(block_out_channels=(64,), layers_per_block=1)


def _per_block(value, n: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def _layers(value) -> int:
    """transformer_layers_per_block entries may be lists (one per layer of a block: SDXL refiner-style)."""
    return max(value) if isinstance(value, (list, tuple)) else int(value)


def unet_activation_elements(config: dict, latent: float) -> float:
    """Elements one sample saves for the backward in a UNet2DConditionModel (``config``: its config.json or
    model.unet.params; missing keys take diffusers' defaults) at ``latent`` x ``latent`` latent pixels."""
    c = {**UNET_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    widths = list(c["block_out_channels"])
    levels = len(widths)
    down, up = list(c["down_block_types"]), list(c["up_block_types"])
    lpb = _per_block(c["layers_per_block"], levels)
    tl = [_layers(v) for v in _per_block(c["transformer_layers_per_block"], levels)]
    total = 0.0
    for level, width in enumerate(widths):
        area = width * (latent / 2**level) ** 2
        n_down, n_up = lpb[level], list(reversed(lpb))[levels - 1 - level] + 1
        attn_down = "Attn" in str(down[level]) if level < len(down) else False
        attn_up = "Attn" in str(up[levels - 1 - level]) if levels - 1 - level < len(up) else False
        total += area * (UNET_RESNET * (n_down + n_up)
                         + UNET_TRANSFORMER * tl[level] * (n_down * attn_down + n_up * attn_up))
    area = widths[-1] * (latent / 2 ** (levels - 1)) ** 2
    if c.get("mid_block_type"):
        total += area * (2 * UNET_RESNET + UNET_TRANSFORMER * tl[-1] * ("Attn" in str(c["mid_block_type"])))
    return total


def vae_activation_elements(config: dict, resolution: float) -> float:
    """Elements one sample saves for the backward in an AutoencoderKL (encoder and decoder trained) at
    ``resolution`` x ``resolution`` pixels."""
    c = {**VAE_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    widths, lpb = list(c["block_out_channels"]), int(c["layers_per_block"])
    total = sum(w * (resolution / 2**level) ** 2 * (2 * lpb + 1) for level, w in enumerate(widths))
    area = widths[-1] * (resolution / 2 ** (len(widths) - 1)) ** 2
    return VAE_BLOCK * (total + 4 * area)


def convolutional(elements: float, checkpointing: bool) -> float:
    """What a UNet or an autoencoder keeps of ``elements`` with gradient checkpointing (whole blocks)."""
    return elements * (CHECKPOINTED if checkpointing else 1.0)


def activation_bytes(config: dict, kind: str, resolution: int, compute_bytes: int, checkpointing: bool,
                     vae_factor: int = 8) -> float:
    """Bytes one sample's activations take in a convolutional net (a rough estimate, lower than the peak).
    ``kind``: ``unet`` (at ``resolution / vae_factor`` latent pixels) or ``vae`` (at ``resolution``);
    ``compute_bytes``: 2 under bf16/fp16 autocast, 4 in fp32."""
    if kind == "vae":
        elements = vae_activation_elements(config, resolution)
    else:
        elements = unet_activation_elements(config, resolution / vae_factor)
    return convolutional(elements, checkpointing) * compute_bytes


# ----------------------------------------------------------------------------------------------
# Diffusion transformers: joint attention over image and text tokens.
# ----------------------------------------------------------------------------------------------

JOINT_BLOCK = 25.0  # elements per token x width saved by a joint (two-stream) block
SINGLE_BLOCK = 21.0  # by a single-stream block (Flux)
OUTSIDE = 2.0  # embeddings, final norm and projection


def image_tokens(conf: dict, latent_h: float, latent_w: float, latent_channels: int) -> float:
    """Image tokens of ``latent_h x latent_w`` latents: the transformer's patches (``patch_size``) of the
    latents as it takes them (``in_channels`` / ``latent_channels`` latent pixels packed per input vector,
    4 for Flux's 2x2 packing)."""
    patch = int(conf.get("patch_size") or 1)
    return latent_h * latent_w * latent_channels / (patch * patch * int(conf.get("in_channels") or latent_channels))


def transformer_activation_elements(conf: dict, image: float, text: float, checkpointing: bool) -> float:
    """Elements one sample saves for the backward (see the module doc): ``image`` and ``text`` tokens
    through ``num_layers`` joint blocks and ``num_single_layers`` single-stream ones."""
    width = int(conf["num_attention_heads"]) * int(conf["attention_head_dim"])
    joint, single = int(conf.get("num_layers") or 0), int(conf.get("num_single_layers") or 0)
    per_token = (JOINT_BLOCK * joint + SINGLE_BLOCK * single) if not checkpointing else (
        joint + single + max(JOINT_BLOCK if joint else 0.0, SINGLE_BLOCK if single else 0.0))
    return (image + text) * width * (per_token + OUTSIDE)


def transformer_sample_elements(conf: dict, sample: SampleShape, checkpointing: bool,
                                latent_channels: int) -> float:
    """:func:`transformer_activation_elements` of one ``sample``: its latents as the transformer's tokens
    (``latent_channels``: the VAE's when ``sample`` does not know them), as many again for each of its
    references (their latents, of the target's size, run through every block beside the target's: Flux
    Kontext's, FLUX.2's, Qwen-Image-Edit's), and its text tokens."""
    channels = sample.latent_channels or latent_channels
    tokens = image_tokens(conf, sample.latent, sample.latent, channels) * (1 + sample.references)
    return transformer_activation_elements(conf, tokens, sample.text_tokens, checkpointing)
