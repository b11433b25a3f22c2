"""Training the autoencoder (``model.train_target=vae``): its loss, its latent scaling factor, its export,
and the precision it may be trained in.

The loss is LDM's KL-regularised autoencoder objective (Rombach et al. 2022, ``LPIPSWithDiscriminator``
in CompVis/latent-diffusion, without the adversarial term and with the output log-variance fixed at 0):

    rec  = |x - D(z)|  (or squared)  + perceptual_weight * P(x, D(z))      z ~ q(z | x), a posterior *sample*
    loss = sum_pixels(rec) + kl_weight * KL(q(z | x) || N(0, I))           KL summed over the latent

LDM sums both terms per image, which makes the loss scale with the resolution. We divide the whole
per-image loss by the number of pixel values (3 x H x W): the same optimum and the same meaning of
``kl_weight`` (1e-6 for LDM's KL-f8 VAE, the one Stable Diffusion uses), but values of order 0.1 that
compare across resolutions and suit gradient clipping. So, per image:

    loss = mean_pixels|x - D(z)| + perceptual_weight * P + kl_weight * KL_sum / (3 H W)

Precision policy (seed 000: "This only works at fp32, fp16 gives NaN loss")
-------------------------------------------------------------------------
Train the VAE in fp32, or under bf16 autocast with fp32 weights. fp16 (autocast or fp16 weights) is
refused: the decoder's residual stream is not normalised, and once an activation exceeds fp16's largest
value (65504) it becomes inf, the next GroupNorm turns it into NaN, and the loss is NaN on every step; a
gradient scaler cannot help, since the overflow is in the forward pass, not in the gradients. bf16 has
fp32's exponent range (~3e38), so the same activations stay finite. ``tests/test_vae_objective.py``
shows it on the tiny VAE: activations pushed past 65504 give non-finite output in fp16 and finite
output in fp32 and bf16. (The same overflow is why the SDXL VAE needed a rescaled "fp16-fix" copy.)
:func:`check_vae_precision` enforces the policy at start-up and :func:`vae_loss` at every call.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from ..config import ConfigError
from ..config.dataset import is_latent_type
from ..config.schema import ObjectiveConfig
from ..data.transforms import unit_range
from .components.ddpm import SampleSeeds, sample_generators
from .options import VAEObjectiveConfig

log = logging.getLogger(__name__)

RECONSTRUCTIONS = ("l1", "l2")
FP16_MAX = 65504.0  # largest finite float16




class VAEPrecisionError(ValueError):
    """A precision the VAE must not be trained in (see the module docstring)."""


def validate_vae_objective_config(cfg: VAEObjectiveConfig, path: str = "vae_training") -> None:
    """Checks before anything is built; raises ``ConfigError`` naming the key."""
    if cfg.reconstruction not in RECONSTRUCTIONS:
        raise ConfigError(f"'{path}.reconstruction' is '{cfg.reconstruction}', expected one of {', '.join(RECONSTRUCTIONS)}")
    if cfg.kl_weight < 0:
        raise ConfigError(f"'{path}.kl_weight' must be >= 0, got {cfg.kl_weight}")
    if cfg.perceptual_weight < 0:
        raise ConfigError(f"'{path}.perceptual_weight' must be >= 0, got {cfg.perceptual_weight}")
    if cfg.perceptual_weight > 0:
        if not cfg.perceptual_weights:
            raise ConfigError(
                f"'{path}.perceptual_weight' is {cfg.perceptual_weight} but '{path}.perceptual_weights' is not set: "
                "give the local path of a torchvision VGG16 state_dict (nothing is downloaded at run time), "
                f"or set {path}.perceptual_weight=0"
            )
        if not os.path.isfile(cfg.perceptual_weights):
            raise ConfigError(f"'{path}.perceptual_weights': {cfg.perceptual_weights} does not exist (a local VGG16 state_dict file)")
    elif cfg.perceptual_weights:
        raise ConfigError(f"'{path}.perceptual_weights' is set but '{path}.perceptual_weight' is 0 (the loss is off): remove one")


def check_vae_precision(mixed_precision: str) -> None:
    """Refuse fp16 for VAE training (``model.mixed_precision``: no | fp32 | bf16 | fp16)."""
    if mixed_precision in ("no", "fp32", "bf16"):
        return
    if mixed_precision == "fp16":
        raise VAEPrecisionError(
            "model.mixed_precision=fp16 is refused for VAE training (model.train_target=vae): the decoder's "
            f"activations exceed fp16's maximum ({FP16_MAX:.0f}) and the loss becomes NaN (seed 000). Use "
            "model.mixed_precision=bf16 (fp32 weights, bf16 autocast; needs bf16 hardware to be fast) or no (fp32)"
        )
    raise VAEPrecisionError(f"model.mixed_precision={mixed_precision!r}: expected no, bf16 or fp16")


def _check_runtime_precision(vae, device_type: str) -> None:
    if next(vae.parameters()).dtype == torch.float16:
        raise VAEPrecisionError("the VAE's weights are fp16: train it in fp32 (optionally under bf16 autocast)")
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16:
        raise VAEPrecisionError("vae_loss under fp16 autocast: refused (decoder activations overflow fp16); use bf16 or fp32")


# ----------------------------------------------------------------------------------------------
# Perceptual distance
# ----------------------------------------------------------------------------------------------

# LPIPS's input normalisation: ImageNet mean/std expressed for inputs in [-1, 1].
_LPIPS_SHIFT = (-0.030, -0.088, -0.188)
_LPIPS_SCALE = (0.458, 0.448, 0.450)
# torchvision vgg16().features indices that end LPIPS's five slices: relu1_2, relu2_2, relu3_3, relu4_3, relu5_3.
_VGG_SLICE_ENDS = (4, 9, 16, 23, 30)


class VGGPerceptual(torch.nn.Module):
    """LPIPS's VGG16 distance without its learned linear layers ("lpips=False" in the LPIPS code).

    Features at the five ReLU outputs are unit-normalised along channels; their squared differences are
    summed over channels, averaged over space, and summed over layers. Returns one value per image.
    Frozen (eval, no parameter gradients) but differentiable with respect to its inputs.
    """

    def __init__(self, features: torch.nn.Sequential):
        super().__init__()
        self.slices = torch.nn.ModuleList()
        start = 0
        for end in _VGG_SLICE_ENDS:
            self.slices.append(torch.nn.Sequential(*[features[i] for i in range(start, end)]))
            start = end
        self.register_buffer("shift", torch.tensor(_LPIPS_SHIFT).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("scale", torch.tensor(_LPIPS_SCALE).view(1, 3, 1, 1), persistent=False)
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True):  # always eval: nothing here is trained
        return super().train(False)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = (torch.cat([a, b]) - self.shift) / self.scale  # one pass for both: same kernels, half the launches
        n = a.shape[0]
        total = torch.zeros(n, device=a.device, dtype=torch.float32)
        for s in self.slices:
            x = s(x)
            fa, fb = x[:n].float(), x[n:].float()
            fa = fa / (fa.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
            fb = fb / (fb.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
            total = total + (fa - fb).pow(2).sum(dim=1).mean(dim=(1, 2))
        return total


def _read_state_dict(path: str) -> Dict[str, torch.Tensor]:
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    return sd


def build_perceptual(path: str | os.PathLike, device: torch.device | str = "cpu") -> VGGPerceptual:
    """A :class:`VGGPerceptual` from a LOCAL torchvision VGG16 state_dict (``vgg16().state_dict()``, or
    only its ``features.*`` entries). torchvision's own weights download at run time; here nothing does."""
    import torchvision

    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"perceptual loss: VGG16 weights {path} do not exist. Save a torchvision VGG16 state_dict there "
            "(e.g. on a machine with internet: torch.save(torchvision.models.vgg16(weights='IMAGENET1K_V1')"
            ".state_dict(), PATH)) or turn the perceptual loss off (perceptual_weight=0)"
        )
    with torch.device("meta"):  # the architecture only: no 138M-parameter allocation and init
        vgg = torchvision.models.vgg16(weights=None)
    features = vgg.features.to_empty(device="cpu")
    sd = _read_state_dict(path)
    if not isinstance(sd, dict):
        raise ValueError(f"perceptual loss: {path} holds a {type(sd).__name__}, not a state_dict")
    feats = {k[len("features."):]: v for k, v in sd.items() if k.startswith("features.")}
    if not feats:  # a state_dict of vgg16().features itself
        feats = {k: v for k, v in sd.items() if k.split(".")[0].isdigit()}
    want = set(features.state_dict())
    missing = sorted(want - set(feats))
    if missing:
        raise ValueError(
            f"perceptual loss: {path} is not a torchvision VGG16 state_dict: {len(missing)} feature tensors are "
            f"missing (e.g. features.{missing[0]})"
        )
    features.load_state_dict({k: feats[k] for k in want})
    return VGGPerceptual(features).to(device)


@functools.lru_cache(maxsize=2)
def _cached_perceptual(path: str, device: str) -> VGGPerceptual:
    return build_perceptual(path, device)


# ----------------------------------------------------------------------------------------------
# The loss
# ----------------------------------------------------------------------------------------------


def kl_divergence(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, exp(logvar)) || N(0, I)) summed over all but the batch dimension, float32 (diffusers' ``kl()``)."""
    mean, logvar = mean.float(), logvar.float()
    return 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).sum(dim=tuple(range(1, mean.ndim)))


def vae_loss(
    vae,
    pixels: torch.Tensor,
    cfg: VAEObjectiveConfig,
    generator: Optional[torch.Generator] = None,
    perceptual: Optional[torch.nn.Module] = None,
    sample_seeds: Optional[SampleSeeds] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """LDM's autoencoder loss on ``pixels`` ([B, 3, H, W] in [-1, 1]); see the module docstring.

    The decoder reconstructs a *sample* of the posterior, as LDM trains: drawn with ``generator``; or,
    with ``sample_seeds`` (one int per image, a CPU tensor or a sequence), image i's from its own
    ``posterior`` stream (``objective.stream_seed``), so an image's loss does not depend on the batch it
    is in; else from the global RNG of the device. ``perceptual`` overrides the VGG16 built (once,
    cached) from ``cfg.perceptual_weights``. Returns ``(loss, per_sample, logs)``: the mean loss, the detached
    per-image losses, and detached 0-dim tensors (no device sync): ``rec`` (mean |x - D(z)| or squared),
    ``kl`` (KL summed over the latent, per image: what LDM logs), ``perceptual`` (mean distance, 0 when
    off), ``loss``. All losses are computed in fp32, also under bf16 autocast.
    """
    _check_runtime_precision(vae, pixels.device.type)
    if cfg.reconstruction not in RECONSTRUCTIONS:
        raise ValueError(f"reconstruction={cfg.reconstruction!r}: expected one of {RECONSTRUCTIONS}")
    if generator is not None and sample_seeds is not None:
        raise ValueError("vae_loss: give a generator or sample_seeds, not both")
    posterior = vae.encode(pixels).latent_dist
    gens = generator
    if sample_seeds is not None:
        gens = sample_generators(sample_seeds, "posterior", posterior.mean.device)
        if len(gens) != pixels.shape[0]:
            raise ValueError(f"{len(gens)} sample seeds for a batch of {pixels.shape[0]}")
    z = posterior.sample(generator=gens)  # diffusers' randn_tensor: row i from generator i of a list
    recon = vae.decode(z).sample
    x, y = pixels.float(), recon.float()
    err = (y - x).abs() if cfg.reconstruction == "l1" else (y - x).pow(2)
    dims = tuple(range(1, x.ndim))
    rec = err.mean(dim=dims)
    kl = kl_divergence(posterior.mean, posterior.logvar)
    per_sample = rec + cfg.kl_weight * kl / float(x[0].numel())
    p_dist = torch.zeros_like(rec)
    if cfg.perceptual_weight > 0:
        if perceptual is None:
            if not cfg.perceptual_weights:
                raise ValueError("perceptual_weight > 0 needs perceptual_weights (a local VGG16 state_dict path)")
            perceptual = _cached_perceptual(str(cfg.perceptual_weights), str(pixels.device))
        p_dist = perceptual(pixels, recon).float()
        per_sample = per_sample + cfg.perceptual_weight * p_dist
    loss = per_sample.mean()
    logs = {
        "rec": rec.detach().mean(),
        "kl": kl.detach().mean(),
        "perceptual": p_dist.detach().mean(),
        "loss": loss.detach(),
    }
    return loss, per_sample.detach(), logs


# ----------------------------------------------------------------------------------------------
# Scaling factor and export
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def latent_statistics(
    vae, pixel_batches: Iterable[Any], generator: Optional[torch.Generator] = None, all_ranks: bool = False
) -> Dict[str, float]:
    """Mean and std over every element of posterior samples of ``pixel_batches``, and the image count.

    A batch is a pixel tensor (uint8, or float in [-1, 1]) or a dict holding ``pixel_values`` (a data loader batch; bound
    it, e.g. with ``itertools.islice``). Sums are kept in float64. ``all_ranks``: sum them over the
    ranks of torch.distributed (a collective: every rank must call it, with any number of batches);
    off by default, so rank 0 alone may measure.
    """
    param = next(vae.parameters())
    s = torch.zeros(3, dtype=torch.float64, device=param.device)  # sum, sum of squares, element count
    images = 0
    for batch in pixel_batches:
        pixels = batch["pixel_values"] if isinstance(batch, dict) else batch
        pixels = unit_range(pixels.to(param.device)).to(param.dtype)
        z = vae.encode(pixels).latent_dist.sample(generator=generator).double()
        s += torch.stack([z.sum(), z.pow(2).sum(), torch.tensor(float(z.numel()), dtype=torch.float64, device=z.device)])
        images += pixels.shape[0]
    import torch.distributed as dist

    if all_ranks and dist.is_available() and dist.is_initialized():
        n = torch.tensor([float(images)], dtype=torch.float64, device=s.device)
        both = torch.cat([s, n])
        dist.all_reduce(both)
        s, images = both[:3], int(both[3].item())
    total, sq, count = (float(v) for v in s.tolist())
    if count < 2:
        raise ValueError("latent statistics need at least one image")
    mean = total / count
    var = max(sq / count - mean * mean, 0.0) * count / (count - 1)  # unbiased, as torch.std
    return {"mean": mean, "std": var ** 0.5, "num_images": images, "num_elements": int(count)}


def measure_scaling_factor(
    vae, pixel_batches: Iterable[Any], generator: Optional[torch.Generator] = None, all_ranks: bool = False
) -> float:
    """1 / std of posterior samples over ``pixel_batches`` (LDM's convention, which gave SD's 0.18215):
    scaled latents then have unit variance, as the diffusion model's noise schedule assumes.
    ``all_ranks`` as in :func:`latent_statistics`."""
    std = latent_statistics(vae, pixel_batches, generator, all_ranks)["std"]
    if not std > 0:
        raise ValueError(f"latent std is {std}: cannot derive a scaling factor")
    return 1.0 / std


def export_vae(
    vae,
    pipeline_dir: str | os.PathLike,
    scaling_factor: float,
    *,
    base_pipeline: str | os.PathLike | None = None,
    statistics: Optional[Dict[str, Any]] = None,
) -> Path:
    """Write ``vae`` into ``pipeline_dir/vae/`` with ``scaling_factor`` in its ``config.json``.

    With ``base_pipeline``, its other components are copied first (when ``pipeline_dir`` holds no
    ``model_index.json`` yet), so the result loads with ``StableDiffusionPipeline.from_pretrained``.
    ``statistics`` (e.g. :func:`latent_statistics`) is recorded in ``vae/latent_statistics.json``
    next to the scaling factor, so where the number came from stays with the weights. The VAE's own
    config is left as it was. Returns the ``vae/`` folder.
    """
    out = Path(pipeline_dir)
    if base_pipeline is not None and not (out / "model_index.json").exists():
        shutil.copytree(base_pipeline, out, dirs_exist_ok=True, ignore=lambda d, names: ["vae"] if Path(d) == Path(base_pipeline) else [])
    target = out / "vae"
    old = vae.config.scaling_factor
    vae.register_to_config(scaling_factor=float(scaling_factor))
    try:
        tmp = out / "vae.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        vae.save_pretrained(tmp)
        record = {"scaling_factor": float(scaling_factor), **(statistics or {})}
        (tmp / "latent_statistics.json").write_text(json.dumps(record, indent=1))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # a reader never sees a half-written vae/
    finally:
        vae.register_to_config(scaling_factor=old)
    log.info("exported VAE to %s (scaling_factor %.6g)", target, scaling_factor)
    return target


__all__ = [
    "VAEObjectiveConfig", "VAEPrecisionError", "validate_vae_objective_config", "check_vae_precision",
    "VGGPerceptual", "build_perceptual", "kl_divergence", "vae_loss", "latent_statistics",
    "measure_scaling_factor", "export_vae",
]


def validate_vae_stage(cfg) -> None:
    """The run-level checks of ``model.train_target=vae`` (``cfg``: the whole ``TrainConfig``)."""
    validate_vae_objective_config(cfg.vae_training)
    if is_latent_type(cfg.dataset.type):
        raise ConfigError("model.train_target=vae needs images: dataset.type=latents holds no pixels")
    if cfg.dataset.params.masked_loss:
        raise ConfigError("dataset.params.masked_loss weights the denoiser's loss on the latent grid; the autoencoder "
                          "stage (model.train_target=vae) has no masked loss: turn it off")
    if cfg.objective != ObjectiveConfig():
        raise ConfigError("the 'objective' section applies to UNet training; remove it for model.train_target=vae")
    try:
        check_vae_precision(cfg.model.mixed_precision)
    except ValueError as e:
        raise ConfigError(f"'model.mixed_precision': {e}") from None
    if cfg.distributed.strategy in ("fsdp", "hsdp"):
        raise ConfigError(f"model.train_target=vae trains with distributed.strategy=ddp, not "
                          f"{cfg.distributed.strategy} (autoencoders fit one device)")
    if cfg.model.vae.dtype not in ("auto", "fp32"):
        raise ConfigError("model.train_target=vae keeps the trained VAE in fp32: set model.vae.dtype=fp32 (or auto)")
    for key in ("text_encoder.train", "compile", "channels_last"):
        obj = cfg.model
        for part in key.split("."):
            obj = getattr(obj, part)
        if obj is True or obj == "on":  # channels_last: auto means off here
            raise ConfigError(f"'model.{key}' applies to UNet training, not model.train_target=vae")
