"""Flow matching (rectified flow), the objective of the sd3 and flux families (``flow_matching`` config section).

With sigma in (0, 1] per sample, the model sees ``x_t = (1 - sigma) x_0 + sigma * noise`` at timestep
``sigma * 1000`` and is asked for the velocity ``noise - x_0``; the loss is the per-sample mean squared
error times a weight. As diffusers' ``train_dreambooth_sd3.py`` / ``train_dreambooth_flux.py`` do:

* u in (0, 1) from ``diffusers.training_utils.compute_density_for_timestep_sampling`` (uniform,
  logit_normal with mean and std, or mode with its scale);
* the discrete step ``index = int(u * 1000)`` of the training scheduler's table
  (``FlowMatchEulerDiscreteScheduler``: sigma_i = 1 - i / 1000, shifted), ``timestep = sigma * 1000``;
* the shift: static ``s t / (1 + (s - 1) t)`` (``flow_matching.shift``, else the scheduler's ``shift``:
  SD3's 3.0), or Flux's resolution shift, the scheduler's ``time_shift`` with ``mu`` from the image's
  token count (``calculate_shift`` of the Flux pipeline), when ``flow_matching.resolution_shift`` (None:
  the scheduler's ``use_dynamic_shifting``) and no static shift is set;
* the weight from ``diffusers.training_utils.compute_loss_weighting_for_sd3`` (none, sigma_sqrt, cosmap).

With the batch's ``sample_seeds``, sample i's u comes from its ``timesteps`` stream and its noise from its
``noise`` stream (``objective.sample_generators``), as for the SD families, so a sample's loss does not
depend on the batch it is in; without them, from the global RNG (u first, then the noise).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...config import ConfigError
from .ddpm import host_seeds, sample_generators, weight_elements
from ..options import FlowMatchingConfig

SAMPLINGS = ("uniform", "logit_normal", "mode")
WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")
MODE_SCALE_MAX = 2 / (math.pi - 2)


def validate(cfg: FlowMatchingConfig, path: str = "flow_matching") -> None:
    """Checks that need no model; a ``ConfigError`` names the key."""
    if cfg.timestep_sampling not in SAMPLINGS:
        raise ConfigError(f"'{path}.timestep_sampling' is '{cfg.timestep_sampling}', expected one of {', '.join(SAMPLINGS)}")
    if cfg.weighting not in WEIGHTINGS:
        raise ConfigError(f"'{path}.weighting' is '{cfg.weighting}', expected one of {', '.join(WEIGHTINGS)}")
    if cfg.logit_std <= 0:
        raise ConfigError(f"'{path}.logit_std' must be > 0, got {cfg.logit_std}")
    if cfg.shift is not None and cfg.shift <= 0:
        raise ConfigError(f"'{path}.shift' must be > 0, got {cfg.shift}")
    if cfg.shift is not None and cfg.resolution_shift:
        raise ConfigError(f"'{path}.shift' (a static shift) and '{path}.resolution_shift=true' (Flux's shift by the "
                          f"image's token count) exclude each other: set one")
    if cfg.timestep_sampling == "mode" and not -1.0 <= cfg.mode_scale <= MODE_SCALE_MAX:
        # The SD3 paper's bound: beyond it the map u -> t is no longer monotonic.
        raise ConfigError(f"'{path}.mode_scale' must be within [-1, 2 / (pi - 2) = {MODE_SCALE_MAX:.4f}] (SD3 paper), "
                          f"got {cfg.mode_scale}")


def uses_resolution_shift(cfg: FlowMatchingConfig, scheduler) -> bool:
    """Flux's shift by the image's token count: ``resolution_shift``, else the scheduler's
    ``use_dynamic_shifting`` unless a static ``shift`` is set."""
    if cfg.resolution_shift is not None:
        return bool(cfg.resolution_shift)
    return bool(scheduler.config.get("use_dynamic_shifting", False)) and cfg.shift is None


def resolution_mu(scheduler, image_seq_len: int) -> float:
    """``mu`` of Flux's time shift for ``image_seq_len`` image tokens (the scheduler's base / max lengths and shifts)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    c = scheduler.config
    return calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                           c.get("base_shift", 0.5), c.get("max_shift", 1.15))


def sigma_table(cfg: FlowMatchingConfig, scheduler, image_seq_len: int | None = None) -> torch.Tensor:
    """The training sigmas, index 0 = sigma 1, as ``FlowMatchEulerDiscreteScheduler.__init__`` builds them
    (float32), shifted statically or by resolution."""
    n = int(scheduler.config.num_train_timesteps)
    base = torch.from_numpy(np.linspace(1, n, n, dtype=np.float32)[::-1].copy()) / n
    if uses_resolution_shift(cfg, scheduler):
        if image_seq_len is None:
            raise ValueError("flow matching's resolution shift needs the image's token count (image_seq_len)")
        return scheduler.time_shift(resolution_mu(scheduler, image_seq_len), 1.0, base).float()
    shift = float(cfg.shift if cfg.shift is not None else scheduler.config.get("shift", 1.0))
    return shift * base / (1 + (shift - 1) * base)


def sample_u(cfg: FlowMatchingConfig, batch_size: int, device: torch.device,
             sample_seeds=None) -> torch.Tensor:
    """[B] float32 in [0, 1] from ``compute_density_for_timestep_sampling``: per sample from its
    ``timesteps`` stream (on the CPU, so any device draws the same), else from the global RNG of ``device``."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    kw = dict(weighting_scheme=cfg.timestep_sampling, logit_mean=cfg.logit_mean, logit_std=cfg.logit_std,
              mode_scale=cfg.mode_scale)
    if sample_seeds is None:
        return compute_density_for_timestep_sampling(batch_size=batch_size, device=device, **kw).float()
    gens = sample_generators(sample_seeds, "timesteps", "cpu")
    if len(gens) != batch_size:
        raise ValueError(f"{len(gens)} sample seeds for a batch of {batch_size}")
    u = torch.cat([compute_density_for_timestep_sampling(batch_size=1, device="cpu", generator=g, **kw) for g in gens])
    return u.float().to(device, non_blocking=True)


def sample_sigmas(cfg: FlowMatchingConfig, scheduler, batch_size: int, device: torch.device, sample_seeds=None,
                  image_seq_len: int | None = None) -> torch.Tensor:
    """[B] float32 sigmas in (0, 1]: the scheduler's table (:func:`sigma_table`) at ``int(u * 1000)``."""
    table = sigma_table(cfg, scheduler, image_seq_len)  # on the CPU
    if sample_seeds is None:  # u drawn on the device: the table follows without waiting (non_blocking)
        u = sample_u(cfg, batch_size, device, None)
        return table.to(device, non_blocking=True)[(u * len(table)).long().clamp_(0, len(table) - 1)]
    u = sample_u(cfg, batch_size, "cpu", sample_seeds)  # drawn on the CPU: look up there, copy B values
    return table[(u * len(table)).long().clamp_(0, len(table) - 1)].to(device, non_blocking=True)


def sample_noise(latents: torch.Tensor, sample_seeds=None) -> torch.Tensor:
    """Standard normals shaped like ``latents`` (float32): row i from sample i's ``noise`` stream, else the
    global RNG of the latents' device."""
    if sample_seeds is None:
        return torch.randn(latents.shape, device=latents.device, dtype=torch.float32)
    gens = sample_generators(sample_seeds, "noise", latents.device)
    if len(gens) != latents.shape[0]:
        raise ValueError(f"{len(gens)} sample seeds for a batch of {latents.shape[0]}")
    return torch.cat([torch.randn((1, *latents.shape[1:]), generator=g, device=latents.device) for g in gens])


def loss_weights(cfg: FlowMatchingConfig, sigmas: torch.Tensor) -> torch.Tensor:
    """[B] float32 per-sample weights (``compute_loss_weighting_for_sd3``)."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    return compute_loss_weighting_for_sd3(cfg.weighting, sigmas.float()).float()


def flow_loss(predict, latents: torch.Tensor, cfg: FlowMatchingConfig, scheduler, sample_seeds=None,
              noise: torch.Tensor | None = None, sigmas: torch.Tensor | None = None, image_seq_len: int | None = None,
              loss_weight: torch.Tensor | None = None):
    """(mean loss, per-sample losses detached, timesteps int64 for the per-quartile logs).

    ``predict(noisy_latents, timesteps)`` (timesteps: [B] float32 ``sigma * 1000``, what the transformer is
    given) returns the velocity prediction shaped like ``latents``. Given ``noise`` / ``sigmas`` (validation)
    are used as they are; the others are drawn (:func:`sample_sigmas`, :func:`sample_noise`). The
    interpolation and the loss are computed in float32, also under autocast. ``loss_weight`` (masked loss,
    [B, 1, h, w] on the latent grid) multiplies the per-element error before the mean; Flux's ``predict``
    unpacks its 2x2 patches, so the error is on the same [B, C, h, w] grid as the mask."""
    if sample_seeds is not None:
        sample_seeds = host_seeds(sample_seeds)  # read once
    latents = latents.float()
    b = latents.shape[0]
    if sigmas is None:
        sigmas = sample_sigmas(cfg, scheduler, b, latents.device, sample_seeds, image_seq_len)
    sigmas = sigmas.to(latents.device, torch.float32)
    if noise is None:
        noise = sample_noise(latents, sample_seeds)
    noise = noise.to(latents.device, torch.float32)
    s = sigmas.view(b, *([1] * (latents.ndim - 1)))
    noisy = (1.0 - s) * latents + s * noise
    timesteps = sigmas * float(scheduler.config.num_train_timesteps)
    pred = predict(noisy, timesteps)
    target = noise - latents
    weighting = loss_weights(cfg, s)
    # diffusers' examples: mean((weighting * (pred - target) ** 2).reshape(B, -1), 1), in float32.
    errors = weight_elements(weighting * (pred.float() - target) ** 2, loss_weight)
    per_sample = torch.mean(errors.reshape(b, -1), 1)
    return per_sample.mean(), per_sample.detach(), timesteps.detach().long()


__all__ = ["validate", "uses_resolution_shift", "resolution_mu", "sigma_table", "sample_u", "sample_sigmas",
           "sample_noise", "loss_weights", "flow_loss", "SAMPLINGS", "WEIGHTINGS"]
