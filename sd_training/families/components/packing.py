"""2x2 latent packing: a [B, C, h, w] latent grid as the [B, h/2 * w/2, 4C] token sequence a Flux-style
transformer takes, with the (0, row, column) position ids of the packed grid and all-zero text ids, as
``FluxPipeline`` makes them (its static helpers, so the packing is the pipeline's by construction). The
token count is what a resolution-dependent flow-matching shift reads.
"""

from __future__ import annotations

import torch


def text_ids(states: torch.Tensor) -> torch.Tensor:
    """The text tokens' position ids: zeros [L, 3], as ``FluxPipeline.encode_prompt`` makes them."""
    return torch.zeros(states.shape[1], 3, device=states.device, dtype=states.dtype)


def image_ids(latents: torch.Tensor) -> torch.Tensor:
    """The packed image tokens' position ids [h/2 * w/2, 3]: (0, row, column) of the 2x2-patch grid."""
    from diffusers import FluxPipeline

    b, _, h, w = latents.shape
    return FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, latents.dtype)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h/2 * w/2, 4C] (``FluxPipeline._pack_latents``)."""
    from diffusers import FluxPipeline

    b, c, h, w = latents.shape
    return FluxPipeline._pack_latents(latents, b, c, h, w)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h/2 * w/2, 4C] -> [B, C, h, w] (``FluxPipeline._unpack_latents`` in latent units)."""
    from diffusers import FluxPipeline

    return FluxPipeline._unpack_latents(tokens, h, w, 1)


def image_seq_len(latents: torch.Tensor) -> int:
    """Packed image tokens of these latents: what Flux's resolution shift reads."""
    return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)
