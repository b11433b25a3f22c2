"""One training step's loss: encode, sample timesteps and noise, predict, compare with the target.

The ``objective`` config section chooses the parameterisation and the tricks around it. An option
that needs random numbers draws them only when it is on.

Where the random numbers come from:
  * With ``sample_seeds`` (the batch's, one per sample; what the families pass in training), every draw
    of sample i comes from generators seeded from ``sample_seeds[i]`` alone, one per stream (noise,
    timesteps, offset, pyramid levels, pyramid ratios, input perturbation, VAE posterior): see
    :func:`stream_seed`. A sample's noise, timestep and loss are then the same whichever batch,
    micro-batch or rank it is in, and whatever the global RNG state, up to floating-point summation
    order; turning an option on draws from its own stream and shifts no other draw.
  * Without them, from the global torch RNG of the latents' device (pyramid ratios: the CPU's), in
    this order: the noise (one ``randn_like``), pyramid levels, offset, the timesteps (one ``randint``),
    the input perturbation. With every option at its default that is exactly what the step always drew,
    so runs and resumed runs made that way stay bit-identical.

References, for the formulas below:
  * v-prediction: Salimans & Ho 2022, v = sqrt(a_t) * eps - sqrt(1 - a_t) * x0 (``get_velocity``).
  * min-SNR-gamma weighting: Hang et al. 2023; the per-parameterisation forms follow diffusers'
    examples/text_to_image/train_text_to_image.py.
  * offset noise: Guttenberg 2023 ("Diffusion with offset noise"), as in diffusers' ``--noise_offset``.
  * pyramid (multi-resolution) noise: Whitaker 2023, the EveryDream2 / kohya form (seed 002).
  * input perturbation: Ning et al. 2023, as in diffusers' ``--input_perturbation``.
  * zero terminal SNR: Lin et al. 2023 ("Common diffusion noise schedules and sample steps are flawed").
  * logit-normal timesteps: Esser et al. 2024 (Stable Diffusion 3), mapped onto the discrete DDPM steps.
"""

from __future__ import annotations

import logging
import operator
import random
from typing import Sequence, Union

import torch
import torch.nn.functional as F

from ...config import ConfigError
from ...config.schema import ObjectiveConfig

log = logging.getLogger(__name__)

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
LOSS_WEIGHTINGS = ("none", "min_snr")
TIMESTEP_SAMPLINGS = ("uniform", "logit_normal")
# Pyramid noise adds at most this many resolution levels; it stops earlier at a 1-pixel level.
PYRAMID_MAX_LEVELS = 10




def _error(message: str) -> ValueError:
    return ConfigError(message)


def validate_objective_config(cfg: ObjectiveConfig, path: str = "objective") -> None:
    """Checks that need no model; raises ConfigError naming the key. ``configure_schedulers`` checks the rest."""

    def choice(key, value, allowed):
        if value not in allowed:
            raise _error(f"'{path}.{key}' is '{value}', expected one of {', '.join(allowed)}")

    if cfg.prediction_type is not None:
        choice("prediction_type", cfg.prediction_type, PREDICTION_TYPES)
    choice("loss_weighting", cfg.loss_weighting, LOSS_WEIGHTINGS)
    choice("timestep_sampling", cfg.timestep_sampling, TIMESTEP_SAMPLINGS)
    if cfg.snr_gamma <= 0:
        raise _error(f"'{path}.snr_gamma' must be > 0, got {cfg.snr_gamma}")
    for key in ("noise_offset", "input_perturbation"):
        if getattr(cfg, key) < 0:
            raise _error(f"'{path}.{key}' must be >= 0, got {getattr(cfg, key)}")
    if not 0.0 <= cfg.pyramid_noise_discount < 1.0:
        raise _error(f"'{path}.pyramid_noise_discount' must be within [0, 1), got {cfg.pyramid_noise_discount}")
    if cfg.logit_std <= 0:
        raise _error(f"'{path}.logit_std' must be > 0, got {cfg.logit_std}")
    if cfg.zero_terminal_snr and cfg.prediction_type == "epsilon":
        raise _error(_ZTSNR_EPSILON.format(path=path, why="is 'epsilon'"))


_ZTSNR_EPSILON = (
    "'{path}.zero_terminal_snr' needs a parameterisation that is defined at SNR 0, but '{path}.prediction_type' {why}: "
    "at the last timestep the input is pure noise, so predicting the noise teaches nothing. "
    "Set {path}.prediction_type=v_prediction (Lin et al.) or turn zero_terminal_snr off"
)


# ----------------------------------------------------------------------------------------------
# Schedulers
# ----------------------------------------------------------------------------------------------


def _accepts(scheduler_cls, arg: str) -> bool:
    import inspect

    return arg in inspect.signature(scheduler_cls.__init__).parameters


def configure_schedulers(noise_scheduler, inference_scheduler, cfg: ObjectiveConfig | None, path: str = "objective"):
    """Both schedulers rebuilt (``from_config`` with overrides) with the objective's parameterisation.

    The inference scheduler is what exported pipelines and sample grids use, so it must sample with the
    ``prediction_type`` (and the betas) the UNet is trained with: it takes the training scheduler's
    (after ``objective.prediction_type``) even when only the pipeline's own two configs disagree.
    Zero terminal SNR also sets ``timestep_spacing="trailing"`` on the inference scheduler, so
    sampling starts at the last (SNR 0) timestep as Lin et al. recommend. An inference scheduler class
    that cannot rescale its betas (PNDM, LMS, Heun ...) is replaced by ``DDIMScheduler`` (the paper's
    sampler), with a warning. Returns ``(noise_scheduler, inference_scheduler)``: the same objects
    when nothing changes; the arguments are never modified.
    """
    cfg = cfg or ObjectiveConfig()
    train_cfg = noise_scheduler.config
    kind = cfg.prediction_type or train_cfg.prediction_type
    zero_snr = cfg.zero_terminal_snr or bool(train_cfg.get("rescale_betas_zero_snr", False))
    if zero_snr and kind == "epsilon":
        why = "is 'epsilon'" if cfg.prediction_type else "is unset and the training scheduler's own is 'epsilon'"
        raise _error(_ZTSNR_EPSILON.format(path=path, why=why))
    if kind not in PREDICTION_TYPES:
        raise _error(f"the training scheduler's prediction_type '{kind}' is not one of {', '.join(PREDICTION_TYPES)}: set {path}.prediction_type")

    train_over: dict = {}
    if kind != train_cfg.prediction_type:
        train_over["prediction_type"] = kind
    if zero_snr and not train_cfg.get("rescale_betas_zero_snr", False):
        train_over["rescale_betas_zero_snr"] = True
    if train_over:
        noise_scheduler = type(noise_scheduler).from_config(train_cfg, **train_over)

    cls, infer_cfg = type(inference_scheduler), inference_scheduler.config
    infer_over: dict = {}
    if zero_snr:
        if not _accepts(cls, "rescale_betas_zero_snr"):
            from diffusers import DDIMScheduler

            log.warning(
                "%s.zero_terminal_snr: the inference scheduler %s cannot rescale its betas; exported pipelines and "
                "samples use DDIMScheduler (trailing timesteps) instead", path, cls.__name__,
            )
            cls = DDIMScheduler
        if not infer_cfg.get("rescale_betas_zero_snr", False):
            infer_over["rescale_betas_zero_snr"] = True
        if infer_cfg.get("timestep_spacing") != "trailing":
            infer_over["timestep_spacing"] = "trailing"
    if infer_cfg.get("prediction_type", "epsilon") != kind:
        if not _accepts(cls, "prediction_type"):
            raise _error(f"{path}.prediction_type: the inference scheduler {cls.__name__} has no prediction_type setting")
        infer_over["prediction_type"] = kind
    if infer_over or cls is not type(inference_scheduler):
        inference_scheduler = cls.from_config(infer_cfg, **infer_over)
    return noise_scheduler, inference_scheduler


# ----------------------------------------------------------------------------------------------
# Per-sample random streams
# ----------------------------------------------------------------------------------------------

# A sample's draws of one kind come from that kind's stream; the numbers are fixed forever (changing one
# changes every run's draws), and a new kind of draw takes a new number.
STREAMS = {
    "noise": 1, "timesteps": 2, "offset": 3, "pyramid": 4, "pyramid_ratios": 5, "perturbation": 6, "posterior": 7,
    "t5_dropout": 8,  # SD3: whether a sample's T5 states are dropped (model.t5.dropout)
    "reference": 9,  # edit training: the seeds of each reference image's own posterior sample
}
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1

SampleSeeds = Union[torch.Tensor, Sequence[int]]  # one non-negative int per sample


def stream_seed(sample_seed: int, stream: str) -> int:
    """The seed of ``stream``'s generator for the sample with ``sample_seed``: SplitMix64 (Steele et al.
    2014) of ``sample_seed + STREAMS[stream] * 0x9E3779B97F4A7C15`` (mod 2**64), its top 63 bits."""
    z = (sample_seed + STREAMS[stream] * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def reference_seeds(sample_seeds: SampleSeeds, k: int) -> list[int]:
    """The sample seeds of the ``k``-th reference image (0: the first) of each sample: apart from the target's
    streams and from every other reference's, so each posterior sample is drawn from its own generator."""
    return [(stream_seed(s, "reference") + k) & ((1 << 63) - 1) for s in host_seeds(sample_seeds)]


def host_seeds(sample_seeds: SampleSeeds) -> list[int]:
    """The seeds as Python ints: a CPU int tensor (the batch's ``sample_seeds``) or a sequence of ints.

    A tensor on an accelerator is refused: reading it would make the host wait for the device. The CPU
    tensor is read with ``operator.index`` rather than ``.tolist()`` because ``sync_count.BlockingCalls``
    counts ``.tolist()`` of any tensor (on a CPU run it cannot tell host data from device data); the
    CPU-only check is what keeps this read free of synchronisation.
    """
    if isinstance(sample_seeds, torch.Tensor):
        if sample_seeds.device.type != "cpu" or sample_seeds.ndim != 1 or sample_seeds.is_floating_point():
            raise ValueError(f"sample_seeds must be a 1-d integer CPU tensor, got {sample_seeds.dtype} "
                             f"{tuple(sample_seeds.shape)} on {sample_seeds.device}")
    return [operator.index(s) for s in sample_seeds]


def sample_generators(sample_seeds: SampleSeeds, stream: str, device: torch.device | str) -> list[torch.Generator]:
    """One ``torch.Generator`` on ``device`` per sample, seeded with :func:`stream_seed` (no device sync)."""
    return [torch.Generator(device=device).manual_seed(stream_seed(s, stream)) for s in host_seeds(sample_seeds)]


def _per_sample_randn(gens: list[torch.Generator], shape, device, dtype) -> torch.Tensor:
    """``[len(gens), *shape[1:]]`` standard normals, row i drawn from ``gens[i]`` alone."""
    if len(gens) != shape[0]:
        raise ValueError(f"{len(gens)} sample seeds for a batch of {shape[0]}")
    rows = [torch.randn((1, *shape[1:]), generator=g, device=device, dtype=dtype) for g in gens]
    return torch.cat(rows)


# ----------------------------------------------------------------------------------------------
# Targets and weights
# ----------------------------------------------------------------------------------------------


def scheduler_tensors_to(noise_scheduler, device: torch.device) -> None:
    """The training scheduler's tables on the training device at set-up: diffusers' ``add_noise`` and
    ``get_velocity`` move ``alphas_cumprod`` to the samples' device at their first call, a copy that waits
    for the GPU (step 0 failed ``scripts/sync_check.py --device cuda``)."""
    for name in ("alphas_cumprod", "alphas", "betas"):
        value = getattr(noise_scheduler, name, None)
        if isinstance(value, torch.Tensor):
            setattr(noise_scheduler, name, value.to(device))


def training_target(noise_scheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """What the UNet is asked to predict, following the scheduler's ``prediction_type``."""
    kind = noise_scheduler.config.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return noise_scheduler.get_velocity(latents, noise, timesteps)
    if kind == "sample":
        return latents
    raise ValueError(f"unsupported prediction_type '{kind}' in the training noise scheduler")


def snr(noise_scheduler, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio alpha_bar_t / (1 - alpha_bar_t) of each timestep, float32 (diffusers' ``compute_snr``)."""
    ac = noise_scheduler.alphas_cumprod.to(device=timesteps.device)[timesteps].float()
    return (ac.sqrt() / (1.0 - ac).sqrt()) ** 2


def min_snr_weights(noise_scheduler, timesteps: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per-sample weights of the min-SNR-gamma strategy for the scheduler's ``prediction_type``.

    The x0-space weight is min(SNR, gamma); an epsilon loss equals SNR times the x0 loss and a v loss
    (SNR + 1) times it, hence min(SNR, gamma) / SNR and min(SNR, gamma) / (SNR + 1). The epsilon form is
    written as where(SNR < gamma, 1, gamma / SNR): the same numbers, but 1 rather than 0/0 at SNR 0.
    """
    s = snr(noise_scheduler, timesteps)
    capped = torch.clamp(s, max=gamma)  # == stack([snr, gamma * ones]).min(dim=1)[0]
    kind = noise_scheduler.config.prediction_type
    if kind == "epsilon":
        return torch.where(s < gamma, torch.ones_like(s), gamma / s)
    if kind == "v_prediction":
        return capped / (s + 1.0)
    if kind == "sample":
        return capped
    raise ValueError(f"unsupported prediction_type '{kind}' in the training noise scheduler")


# ----------------------------------------------------------------------------------------------
# Noise and timesteps
# ----------------------------------------------------------------------------------------------


def pyramid_noise(noise: torch.Tensor, discount: float, max_levels: int = PYRAMID_MAX_LEVELS,
                  sample_seeds: SampleSeeds | None = None) -> torch.Tensor:
    """Multi-resolution noise: ``noise`` plus upsampled coarser noise, level i weighted discount**i.

    Level i has the size of the latent divided by r**i with r drawn in [2, 4) per level (Whitaker's
    "rather than always going 2x"); it stops after the first level that is 1 pixel high or wide, so
    the number of levels is bounded by the latent size. The result is rescaled to unit std per sample
    (the reference divides by the batch's std; per sample keeps a sample's noise independent of the
    batch size). The ratios r are host numbers (no device sync for the sizes): from the CPU generator,
    or with ``sample_seeds`` from each sample's ``pyramid_ratios`` stream (a ``random.Random``), each
    sample then getting its own pyramid with levels from its ``pyramid`` stream.
    """
    if noise.ndim != 4:
        raise ValueError(f"pyramid noise needs [B, C, H, W] latents, got shape {tuple(noise.shape)}")
    if sample_seeds is None:
        return _pyramid(noise, discount, max_levels, lambda: torch.rand(()).item(), None)
    seeds = host_seeds(sample_seeds)
    if len(seeds) != noise.shape[0]:
        raise ValueError(f"{len(seeds)} sample seeds for a batch of {noise.shape[0]}")
    gens = sample_generators(seeds, "pyramid", noise.device)
    ratios = [random.Random(stream_seed(s, "pyramid_ratios")).random for s in seeds]
    return torch.cat([_pyramid(noise[i:i + 1], discount, max_levels, ratios[i], gens[i]) for i in range(len(seeds))])


def _pyramid(noise: torch.Tensor, discount: float, max_levels: int, uniform, generator) -> torch.Tensor:
    """:func:`pyramid_noise` of a batch whose ratios come from ``uniform()`` (a float in [0, 1)) and
    levels from ``generator`` (None: the device's global RNG)."""
    b, c, h, w = noise.shape
    out = noise
    for i in range(max_levels):
        r = 2.0 + 2.0 * uniform()
        hn, wn = max(1, int(h / r**i)), max(1, int(w / r**i))
        level = torch.randn(b, c, hn, wn, generator=generator, device=noise.device, dtype=noise.dtype)
        out = out + F.interpolate(level, size=(h, w), mode="bilinear", align_corners=False) * discount**i
        if hn == 1 or wn == 1:
            break
    return out / out.std(dim=(1, 2, 3), keepdim=True)


def _randn(shape, like: torch.Tensor, sample_seeds: SampleSeeds | None, stream: str) -> torch.Tensor:
    """Standard normals of ``shape`` on ``like``'s device and dtype: from the global RNG, or row i from
    sample i's ``stream``."""
    if sample_seeds is None:
        return torch.randn(shape, device=like.device, dtype=like.dtype)
    return _per_sample_randn(sample_generators(sample_seeds, stream, like.device), shape, like.device, like.dtype)


def sample_noise(latents: torch.Tensor, cfg: ObjectiveConfig, sample_seeds: SampleSeeds | None = None) -> torch.Tensor:
    """Unit Gaussian noise shaped like ``latents``; then pyramid noise (renormalised), then the offset, when on.
    ``sample_seeds``: sample i's noise from its own streams (``noise``, ``pyramid``, ``pyramid_ratios``, ``offset``)."""
    if sample_seeds is None:
        noise = torch.randn_like(latents)
    else:
        noise = _randn(latents.shape, latents, sample_seeds, "noise")
        channels_last = latents.ndim == 4 and latents.is_contiguous(memory_format=torch.channels_last)
        if channels_last and not latents.is_contiguous():
            noise = noise.contiguous(memory_format=torch.channels_last)  # as randn_like would lay it out
    if cfg.pyramid_noise_discount > 0:
        noise = pyramid_noise(noise, cfg.pyramid_noise_discount, sample_seeds=sample_seeds)
    if cfg.noise_offset > 0:
        # One constant per (sample, channel): shifts the image mean, which plain noise barely does.
        shape = latents.shape[:2] + (1,) * (latents.ndim - 2)
        noise = noise + cfg.noise_offset * _randn(shape, latents, sample_seeds, "offset")
    return noise


def sample_timesteps(noise_scheduler, batch_size: int, device: torch.device, cfg: ObjectiveConfig,
                     sample_seeds: SampleSeeds | None = None) -> torch.Tensor:
    """Training timesteps in [0, num_train_timesteps), int64; with ``sample_seeds``, sample i's from its
    ``timesteps`` stream."""
    n = noise_scheduler.config.num_train_timesteps
    gens = None if sample_seeds is None else sample_generators(sample_seeds, "timesteps", device)
    if gens is not None and len(gens) != batch_size:
        raise ValueError(f"{len(gens)} sample seeds for a batch of {batch_size}")
    if cfg.timestep_sampling == "uniform":
        if gens is None:
            return torch.randint(0, n, (batch_size,), device=device)
        return torch.cat([torch.randint(0, n, (1,), generator=g, device=device) for g in gens])
    if cfg.timestep_sampling == "logit_normal":
        # u = sigmoid(N(mean, std)) in (0, 1), then the DDPM step whose interval [t/n, (t+1)/n) holds u.
        if gens is None:
            z = torch.randn(batch_size, device=device)
        else:
            z = _per_sample_randn(gens, (batch_size,), device, torch.float32)
        u = torch.sigmoid(cfg.logit_mean + cfg.logit_std * z)
        return (u * n).long().clamp_(0, n - 1)
    raise ValueError(f"unknown timestep_sampling '{cfg.timestep_sampling}'")


_DEFAULTS = ObjectiveConfig()


def weight_elements(errors: torch.Tensor, loss_weight: torch.Tensor | None) -> torch.Tensor:
    """The per-element losses ``errors`` [B, C, h, w] (float32) times the batch's masked-loss weight
    ``loss_weight`` [B, 1, h', w'] (``data.masks``; None: unweighted), broadcast over the channels and
    resampled by area to the latents' grid when the data's 8 px cells are not the VAE's. Applied before the
    per-sample mean, so the mean stays over all elements (kohya's masked loss)."""
    if loss_weight is None:
        return errors
    weight = loss_weight.to(errors.device, torch.float32, non_blocking=True)
    if weight.ndim != 4 or weight.shape[0] != errors.shape[0] or weight.shape[1] != 1 or errors.ndim != 4:
        raise ValueError(f"loss_weight {tuple(weight.shape)} does not fit latents {tuple(errors.shape)}: "
                         "expected [B, 1, h, w] for [B, C, h, w]")
    if weight.shape[-2:] != errors.shape[-2:]:
        weight = F.interpolate(weight, size=errors.shape[-2:], mode="area")
    return errors * weight


def diffusion_loss(
    unet, noise_scheduler, latents: torch.Tensor, encoder_hidden_states: torch.Tensor,
    cfg: ObjectiveConfig | None = None, noise: torch.Tensor | None = None, timesteps: torch.Tensor | None = None,
    added_cond_kwargs: dict | None = None, sample_seeds: SampleSeeds | None = None,
    loss_weight: torch.Tensor | None = None,
):
    """Mean-squared error of the UNet's prediction; also returns the per-sample losses and timesteps.

    ``added_cond_kwargs``: extra UNet conditioning (SDXL's pooled text embedding and size/crop ids).

    Noise, timesteps and input perturbation not given are drawn per sample from ``sample_seeds`` (one
    int per sample, a CPU tensor or a sequence: see the module docstring), so a sample's loss does not
    depend on the batch it is in; without them, from the global torch RNG of the latents' device,
    which the checkpoint saves and restores, so a resumed run draws the same ones. Fixed ones give a
    loss that is comparable across steps (validation): a given ``noise`` is used as is (no offset,
    pyramid or input perturbation); the loss weighting still applies. The per-sample losses are the
    weighted ones, so the loss is their mean. ``loss_weight`` (the batch's masked-loss weight, [B, 1, h, w])
    multiplies the per-element error before the per-sample mean (:func:`weight_elements`).
    """
    cfg = cfg or _DEFAULTS
    kind = noise_scheduler.config.prediction_type
    if cfg.prediction_type is not None and cfg.prediction_type != kind:
        raise ValueError(
            f"objective.prediction_type is '{cfg.prediction_type}' but the noise scheduler's is '{kind}': "
            "build the schedulers with configure_schedulers()"
        )
    if sample_seeds is not None:
        sample_seeds = host_seeds(sample_seeds)  # read once, not once per stream
    drawn = noise is None
    if drawn:
        noise = sample_noise(latents, cfg, sample_seeds)
    if timesteps is None:
        timesteps = sample_timesteps(noise_scheduler, latents.shape[0], latents.device, cfg, sample_seeds)
    timesteps = timesteps.long()
    model_noise = noise
    if drawn and cfg.input_perturbation > 0:
        # Ning et al.: the UNet sees x_t built from perturbed noise, but is still asked for the original.
        if sample_seeds is None:
            perturbation = torch.randn_like(noise)
        else:
            perturbation = _randn(noise.shape, noise, sample_seeds, "perturbation")
        model_noise = noise + cfg.input_perturbation * perturbation
    noisy = noise_scheduler.add_noise(latents, model_noise, timesteps)
    target = training_target(noise_scheduler, latents, noise, timesteps)
    extra = {"added_cond_kwargs": added_cond_kwargs} if added_cond_kwargs is not None else {}
    pred = unet(noisy, timesteps, encoder_hidden_states, return_dict=False, **extra)[0]
    # The loss in fp32 even under autocast: a bf16 mean over millions of elements loses precision.
    errors = weight_elements(F.mse_loss(pred.float(), target.float(), reduction="none"), loss_weight)
    per_sample = errors.mean(dim=tuple(range(1, pred.ndim)))
    if cfg.loss_weighting == "min_snr":
        per_sample = per_sample * min_snr_weights(noise_scheduler, timesteps, cfg.snr_gamma)
    return per_sample.mean(), per_sample.detach(), timesteps


__all__ = [
    "ObjectiveConfig", "validate_objective_config", "configure_schedulers",
    "training_target", "snr", "min_snr_weights", "pyramid_noise", "sample_noise", "sample_timesteps",
    "diffusion_loss", "STREAMS", "stream_seed", "host_seeds", "sample_generators", "weight_elements",
]
