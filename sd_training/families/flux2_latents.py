"""FLUX.2's latents, as its pipelines make them: ``AutoencoderKLFlux2``'s posterior in 2x2 patches
(``_patchify_latents``), each of the 4C patch channels normalised with the VAE's batch-norm running statistics
(``_encode_vae_image``), the patches packed row by row into tokens (``_pack_latents``) with their 4-axis
position ids (``_prepare_latent_ids``), the text tokens' ids (``_prepare_text_ids``), and reference images
(``image=[...]``) as ``prepare_image_latents`` hands them to the transformer (:func:`reference_tokens`). The pipelines' own
static helpers do the reshaping, so the layout is theirs by construction.

The families keep latents unpatchified ([B, C, h, w]: the VAE's channels and 8x grid, as latent shards and the
memory plan expect): the same numbers as the pipeline's [B, 4C, h/2, w/2] in another order.
:class:`NormalizedVAE` is the view of the VAE that the one VAE encode (``components.vae``) and latent shards
(``scripts/precompute_latents.py``) read: its posterior is already in these units.
"""

from __future__ import annotations

import torch

# The tiny pipelines' VAE: 8 latent channels (the real one has 32) x 4 patch positions = the transformer's 32
# input channels; four levels, 8 px per latent as the real one.
TINY_FLUX2_VAE = dict(block_out_channels=(32, 32, 64, 64), layers_per_block=1, latent_channels=8, norm_num_groups=32,
                      sample_size=64, use_quant_conv=True, use_post_quant_conv=True)


def tiny_flux2_vae(scaling_factor: float | None = None):
    """The tiny pipelines' ``AutoencoderKLFlux2`` (torch's RNG), with batch-norm statistics that are not the
    identity, so the normalisation is exercised."""
    from diffusers import AutoencoderKLFlux2

    if scaling_factor is not None:
        raise ValueError("FLUX.2's VAE normalises latents with its batch-norm statistics: it has no scaling factor")
    vae = AutoencoderKLFlux2(**TINY_FLUX2_VAE)
    vae.bn.running_mean.normal_(0.0, 0.5)
    vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


# -- latents: the pipelines' own static helpers, so the layout is theirs by construction -------------------
def _pipe():
    from diffusers import Flux2Pipeline

    return Flux2Pipeline


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, 4C, h/2, w/2] (``Flux2Pipeline._patchify_latents``)."""
    return _pipe()._patchify_latents(latents)


def unpatchify(patches: torch.Tensor) -> torch.Tensor:
    """[B, 4C, h/2, w/2] -> [B, C, h, w] (``Flux2Pipeline._unpatchify_latents``)."""
    return _pipe()._unpatchify_latents(patches)


def bn_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) [1, 4C, 1, 1] float32 of the VAE's batch norm over the patchified latents: what the pipeline
    normalises latents with (``sqrt(running_var + batch_norm_eps)``)."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).float()
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).float() + vae.config.batch_norm_eps)
    return mean, std


def normalize(vae, latents: torch.Tensor, std_only: bool = False) -> torch.Tensor:
    """The VAE's latents [B, C, h, w] (float32) in the transformer's units, unpatchified; ``std_only``: a
    posterior std (divided by the batch norm's std, not shifted)."""
    mean, std = bn_stats(vae)
    patches = patchify(latents.float())
    out = patches / std.to(patches.device) if std_only else (patches - mean.to(patches.device)) / std.to(patches.device)
    return unpatchify(out)


class NormalizedPosterior:
    """The VAE's posterior in the transformer's units (:func:`normalize`): what ``components.vae.encode`` reads."""

    def __init__(self, vae, dist):
        self.vae, self.dist = vae, dist

    @property
    def mean(self) -> torch.Tensor:
        return normalize(self.vae, self.dist.mean)

    @property
    def std(self) -> torch.Tensor:
        return normalize(self.vae, self.dist.std, std_only=True)

    def sample(self, generator=None) -> torch.Tensor:
        return normalize(self.vae, self.dist.sample(generator=generator))


class NormalizedVAE(torch.nn.Module):
    """``AutoencoderKLFlux2`` as the one VAE encode (``components.vae``), latent shards
    (``scripts/precompute_latents.py``) and their checks see it: ``encode(pixels).latent_dist`` is already in
    the transformer's units, so its ``scaling_factor`` is 1 and its ``shift_factor`` 0 (the normalisation
    is per channel, by the batch norm's statistics, which the VAE's fingerprint covers)."""

    def __init__(self, vae):
        from diffusers.configuration_utils import FrozenDict

        super().__init__()
        self.vae = vae
        self.config = FrozenDict({**vae.config, "scaling_factor": 1.0, "shift_factor": 0.0})

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    def encode(self, pixels: torch.Tensor):
        from types import SimpleNamespace

        return SimpleNamespace(latent_dist=NormalizedPosterior(self.vae, self.vae.encode(pixels).latent_dist))


def tokens(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> the transformer's tokens [B, h/2 * w/2, 4C] (patchify, ``_pack_latents``)."""
    return _pipe()._pack_latents(patchify(latents))


def untokens(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The transformer's output [B, h/2 * w/2, 4C] -> [B, C, h, w] (the inverse of :func:`tokens`)."""
    b, c, h, w = shape
    return unpatchify(out.permute(0, 2, 1).reshape(b, 4 * c, h // 2, w // 2))


def image_ids(latents: torch.Tensor) -> torch.Tensor:
    """(t, row, column, layer) ids [B, h/2 * w/2, 4] of the patches (``_prepare_latent_ids``)."""
    b, c, h, w = latents.shape
    return _pipe()._prepare_latent_ids(latents.new_empty(b, 4 * c, h // 2, w // 2, device="meta")).to(latents.device)


def text_ids(states: torch.Tensor) -> torch.Tensor:
    """(0, 0, 0, l) ids [B, L, 4] of the text tokens (``_prepare_text_ids``)."""
    return _pipe()._prepare_text_ids(states).to(states.device)


# The pipelines' ``_prepare_image_ids`` default: the k-th reference image (0: the first) sits at time coordinate
# 10 + 10k, apart from the target's patches (t = 0) and from every other reference.
REFERENCE_TIME_SCALE = 10


def reference_tokens(references: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference images' latents (each [B, C, h, w] in the transformer's units, any size on the 16 px grid) as
    ``prepare_image_latents`` gives them to the transformer: each patchified and packed row by row, all
    concatenated along the sequence in order ([B, sum_k h_k/2 * w_k/2, 4C]), and their ids [B, same, 4]
    (``_prepare_image_ids``: (10 + 10k, row, column, 0) for the k-th). The ids are the same for every sample
    (the transformer reads the first sample's), as the pipeline repeats them over its batch."""
    if not references:
        raise ValueError("reference_tokens needs at least one reference latent")
    patches = [patchify(r) for r in references]
    packed = torch.cat([_pipe()._pack_latents(p) for p in patches], dim=1)
    shapes = [p.new_empty((1, *p.shape[1:]), device="meta") for p in patches]
    ids = _pipe()._prepare_image_ids(shapes, scale=REFERENCE_TIME_SCALE)
    return packed, ids.to(packed.device).expand(len(packed), -1, -1)
