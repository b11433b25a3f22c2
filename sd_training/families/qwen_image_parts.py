"""Qwen-Image's pieces as ``QwenImagePipeline`` (and diffusers' ``train_dreambooth_lora_qwen_image.py``) make
them: the latents of ``AutoencoderKLQwenImage``, their 2x2 packing, the image shapes the transformer's RoPE
takes, the prompt template, and the tiny offline tokenizer and Qwen2.5-VL of the tiny pipeline.

* Latents: the VAE is a 3-D (video) VAE: an image is one frame, [B, 3, 1, H, W]. Its posterior is normalised
  per channel with the config's ``latents_mean`` / ``latents_std``, ``(z - mean) * (1 / std)`` (the example's
  expression; the pipeline decodes ``z / (1 / std) + mean``). The families keep latents [B, C, h, w] (the frame
  axis dropped: latent shards and the memory plan expect 4-D latents): :class:`QwenLatentVAE` is the view that
  the family's ``models.vae``, what the one VAE encode (``components.vae``) and ``scripts/precompute_latents.py`` read, its posterior already in
  the transformer's units (scaling factor 1, shift 0) and its config naming ``latent_channels`` and the
  spatial levels (``block_out_channels``) that generic code reads of a VAE.
* Tokens: ``QwenImagePipeline._pack_latents`` (2x2 patches row by row, [B, h/2 * w/2, 4C]) and
  ``_unpack_latents``; ``img_shapes`` ``[[(1, h/2, w/2)]] * B`` as the pipeline passes them.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from ..speed.flops import count_flops, height_width, meta_copy

# QwenImagePipeline.__init__'s prompt_template_encode and prompt_template_encode_start_idx (the template's
# prefix is 34 tokens of Qwen2.5-VL's tokenizer; the tiny tokenizer below spells it in 34 too).
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
PREFIX_TOKENS = 34

# -- latents --------------------------------------------------------------------------------------------------


def _stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents_mean, 1 / latents_std) [1, C, 1, 1, 1] float32, as the example computes them."""
    c = vae.config
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1)
    return mean, inv_std


class QwenPosterior:
    """The VAE's posterior in the transformer's units, one frame dropped: what ``components.vae.encode`` reads."""

    def __init__(self, view: "QwenLatentVAE", dist):
        self.view, self.dist = view, dist

    def _norm(self, z: torch.Tensor, std_only: bool = False) -> torch.Tensor:
        mean, inv_std = self.view.latents_mean, self.view.latents_inv_std
        z = z.float()
        return (z * inv_std if std_only else (z - mean) * inv_std).squeeze(2)

    @property
    def mean(self) -> torch.Tensor:
        return self._norm(self.dist.mean)

    @property
    def std(self) -> torch.Tensor:
        return self._norm(self.dist.std, std_only=True)

    def sample(self, generator=None) -> torch.Tensor:
        return self._norm(self.dist.sample(generator=generator))


class QwenLatentVAE(torch.nn.Module):
    """``AutoencoderKLQwenImage`` as 4-D images and latents (see the module): ``encode(pixels [B, 3, H, W])
    .latent_dist`` is normalised, [B, C, h, w]. The per-channel statistics are buffers, so the latent shards'
    VAE fingerprint (its state dict) covers them."""

    def __init__(self, vae):
        from diffusers.configuration_utils import FrozenDict

        super().__init__()
        self.vae = vae
        c = vae.config
        mean, inv_std = _stats(vae)
        self.register_buffer("latents_mean", mean.to(vae.device))
        self.register_buffer("latents_inv_std", inv_std.to(vae.device))
        # block_out_channels: one entry per spatial level (2 ** (levels - 1) pixels per latent), what generic
        # code reads of a VAE (latent shards' info, FLOPs)
        self.config = FrozenDict({**c, "latent_channels": c.z_dim, "in_channels": c.input_channels,
                                  "block_out_channels": tuple(c.base_dim * m for m in c.dim_mult),
                                  "scaling_factor": 1.0, "shift_factor": 0.0})

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    def encode(self, pixels: torch.Tensor):
        return SimpleNamespace(latent_dist=QwenPosterior(self, self.vae.encode(pixels.unsqueeze(2)).latent_dist))


def vae_factor(vae) -> int:
    """Pixels per latent (``QwenImagePipeline.vae_scale_factor``: 2 ** len(temperal_downsample))."""
    return 2 ** len(vae.config.temperal_downsample)


def vae_encode_flops(vae, resolution) -> int:
    """FLOPs of one image's encode (a frame of ``resolution`` pixels), counted on a meta copy."""
    m = meta_copy(vae).eval()
    h, w = height_width(resolution)
    x = torch.empty(1, vae.config.input_channels, 1, h, w, device="meta")
    with torch.no_grad():
        return count_flops(lambda: m.encode(x).latent_dist.mode())


# -- tokens ---------------------------------------------------------------------------------------------------
def _pipe():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline


def tokens(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h/2 * w/2, 4C] (``_pack_latents``; one frame has the layout of none)."""
    b, c, h, w = latents.shape
    return _pipe()._pack_latents(latents, b, c, h, w)


def untokens(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The transformer's output -> [B, C, h, w] (``_unpack_latents`` at 1 pixel per latent, the frame dropped)."""
    _, _, h, w = shape
    return _pipe()._unpack_latents(out, h, w, 1).squeeze(2)


def img_shapes(latents: torch.Tensor) -> list:
    """The RoPE's image shapes: one frame of h/2 x w/2 patches per sample, as ``QwenImagePipeline.__call__``."""
    b, _, h, w = latents.shape
    return [[(1, h // 2, w // 2)]] * b


def front_padded(states: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_get_qwen_prompt_embeds`` + ``encode_prompt``: each sample's real tokens first, zero-padded to the batch's
    longest, with the mask (long) ; None when every token is real (``encode_prompt`` drops it then)."""
    lengths = mask.sum(1).tolist()
    n = max(max(lengths), 1)
    real = [s[m] for s, m in zip(states, mask.to(states.device))]
    out = torch.stack([torch.cat([r, r.new_zeros(n - len(r), r.shape[1])]) for r in real])
    keep = (torch.arange(n, device=states.device)[None] < torch.tensor(lengths, device=states.device)[:, None]).long()
    return out, None if bool(keep.all()) else keep


# -- the tiny pipeline's tokenizer ----------------------------------------------------------------------------
# The template's words, so its prefix is 34 tokens as with Qwen2.5-VL's tokenizer.
TEMPLATE_WORDS = ("system", "user", "assistant", "Describe", "the", "image", "by", "detailing", "color", "shape",
                  "size", "texture", "quantity", "text", "spatial", "relationships", "of", "objects", "and",
                  "background")
# Qwen2.5-VL's chat template for text messages (the default system message); the pipeline formats its own
# template instead, but a saved tokenizer folder carries one.
QWEN25_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_qwen_image_tokenizer(folder: str | os.PathLike):
    """The tiny Qwen tokenizer (``components.llm_tokenizers``' vocabulary) + the template's words as whole tokens
    (as in Qwen2.5-VL's large vocabulary), with Qwen2.5-VL's chat template."""
    from .components.llm_tokenizers import build_qwen_tokenizer

    words = [s for w in TEMPLATE_WORDS for s in (w, "\u0120" + w)]  # the word and " word"
    return build_qwen_tokenizer(folder, 2048, QWEN25_VL_CHAT_TEMPLATE, words)


# The tiny Qwen2.5-VL: a 2-layer 32-wide text model (mrope sections of its 8-channel heads' 4 frequencies) and
# the smallest vision tower the config takes (it stays unused: prompts are text).
TINY_QWEN25_VL_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                           rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                           rope_theta=1000000.0)
TINY_QWEN25_VL_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                             fullatt_block_indexes=[0])


def tiny_qwen25_vl(tokenizer):
    """A random-weight ``Qwen2_5_VLForConditionalGeneration`` of the sizes above for ``tokenizer`` (torch's RNG)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = dict(vocab_size=len(tokenizer), bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    config = Qwen2_5_VLConfig(text_config={**TINY_QWEN25_VL_TEXT, **ids}, vision_config=TINY_QWEN25_VL_VISION, **ids)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


# The tiny VAE: 4 spatial levels (8 px per latent, as the real one), 4 latent channels with per-channel
# statistics that are not the identity, so the normalisation is exercised.
TINY_QWEN_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
                     latents_mean=[0.3, -0.2, 0.1, -0.4], latents_std=[1.5, 0.8, 2.0, 1.2])
# The tiny transformer: 2 dual-stream blocks of 2 heads x 16 channels (RoPE axes 8 + 4 + 4).
TINY_QWEN_TRANSFORMER = dict(patch_size=2, in_channels=4 * TINY_QWEN_VAE["z_dim"], out_channels=TINY_QWEN_VAE["z_dim"],
                             num_layers=2, attention_head_dim=16, num_attention_heads=2,
                             joint_attention_dim=TINY_QWEN25_VL_TEXT["hidden_size"], guidance_embeds=False,
                             axes_dims_rope=(8, 4, 4))
