"""The one VAE encode: pixels -> latents in the denoiser's units, for every family and for latent shards.

Used by the UNet families' online encoding (``unet_family.py``), the flow-matching transformer families'
(``flow_family.py``) and ``scripts/precompute_latents.py`` (which stores the posterior's mean and std).

Two unit conventions exist, and each is kept bit for bit because runs and latent shards were made with it:

* ``shift=None`` (the UNet families: SD 1.x/2.x, SDXL): ``latent * scaling_factor`` computed in the VAE's
  own dtype (a bf16 VAE scales in bf16), no shift;
* ``shift`` a float (the transformer families' ``shift_factor``, and latent shards, 0 for a VAE without
  one): ``(latent.float() - shift) * scaling_factor`` in float32, as the SD3 / Flux pipelines decode
  ``latents / scale + shift``.

The encoder runs outside autocast (autocast would recast an fp32 VAE's convolutions) and without gradients.
"""

from __future__ import annotations

import torch

from .ddpm import SampleSeeds, sample_generators


def factors(vae) -> tuple[float, float]:
    """(shift_factor, scaling_factor) of the VAE config (shift 0 when it has none)."""
    return float(vae.config.get("shift_factor", None) or 0.0), float(vae.config.scaling_factor)


@torch.no_grad()
def encode(vae, pixels: torch.Tensor, scale: float | None = None, shift: float | None = None, *, mean: bool = False,
           sample_seeds: SampleSeeds | None = None, with_std: bool = False):
    """Pixels in [-1, 1] on the VAE's device -> scaled latents (see the module's two conventions).

    ``scale``: None reads the VAE config's ``scaling_factor``. ``mean``: the posterior mean (validation,
    ``model.vae.latent_sampling=mean``), else a posterior sample: row i from sample i's ``posterior`` stream
    with ``sample_seeds`` (diffusers' ``randn_tensor`` draws row i with generator i), else the device's
    global RNG. ``with_std``: (mean, std * scale) instead, both float32 (latent shards store the posterior)."""
    scale = float(vae.config.scaling_factor) if scale is None else scale
    with torch.autocast(pixels.device.type, enabled=False):
        dist = vae.encode(pixels.to(vae.dtype)).latent_dist
    if with_std:
        return (dist.mean.float() - (shift or 0.0)) * scale, dist.std.float() * scale
    if mean:
        latents = dist.mean
    else:
        gens = None if sample_seeds is None else sample_generators(sample_seeds, "posterior", dist.mean.device)
        if gens is not None and len(gens) != dist.mean.shape[0]:
            raise ValueError(f"{len(gens)} sample seeds for a batch of {dist.mean.shape[0]}")
        latents = dist.sample(generator=gens)
    if shift is None:
        return latents * scale
    return (latents.float() - shift) * scale


__all__ = ["factors", "encode"]
