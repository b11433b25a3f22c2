"""Config sections that belong to one family, assembled into the schema by ``sd_training.config.schema``
(torch-free: imports only ``sd_training.config.fields``). The keys users type stay where they were:
``model.text_encoder_2.pretrained=...`` (SDXL's second encoder), ``vae_training.kl_weight=...`` (the
autoencoder stage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..config.fields import ComponentConfig, ConfigError, f

FLOW_FAMILIES = ("sd3", "flux")  # the families trained with flow matching (families/flow_matching.py)


@dataclass
class VAEObjectiveConfig:
    """The ``vae_training`` section (the autoencoder stage's loss); checked by ``families.autoencoder_loss``."""

    reconstruction: str = f("l1", "pixel reconstruction loss, mean over pixel values in [-1, 1] units", choices=("l1", "l2"))
    kl_weight: float = f(1e-6, "weight of KL(posterior || N(0, I)) summed over the latent, per 3*H*W pixel values (LDM KL-f8: 1e-6)")
    perceptual_weight: float = f(0.0, "weight of the VGG16 perceptual distance, added per image (0: off; LDM uses 1.0 with LPIPS)")
    perceptual_weights: Optional[str] = f(None, "local path of a torchvision VGG16 state_dict (.pth/.pt/.safetensors) for the perceptual loss")


@dataclass
class FlowMatchingConfig:
    """The ``flow_matching`` section (rectified flow: x_t = (1 - t) x_0 + t noise, target noise - x_0), read by
    the sd3 and flux families; checked and computed by ``families.flow_matching``."""

    timestep_sampling: str = f("logit_normal", "density of t in (0, 1): uniform, logit_normal (SD3) or mode (heavy tails at the ends)",
                               choices=("uniform", "logit_normal", "mode"))
    logit_mean: float = f(0.0, "logit_normal: mean of the normal in logit(t) units", ge=None)
    logit_std: float = f(1.0, "logit_normal: std of the normal in logit(t) units", gt=0)
    mode_scale: float = f(1.29, "mode: the scale s of the mode density (SD3 paper; 0: uniform)", ge=None)
    shift: Optional[float] = f(None, "static time shift t' = s t / (1 + (s - 1) t) (None: the training scheduler's shift, SD3 3.0)", gt=0)
    resolution_shift: Optional[bool] = f(None, "Flux's shift that grows with the image's token count (None: the scheduler's use_dynamic_shifting)")
    weighting: str = f("none", "per-sample loss weight: none, sigma_sqrt or cosmap (SD3 paper)", choices=("none", "sigma_sqrt", "cosmap"))


@dataclass
class TransformerConfig:
    """``model.transformer``: the trained diffusion transformer of the sd3 and flux families."""

    pretrained: Optional[str] = f(None, "sd3/flux: pipeline root or transformer folder (None: model.pretrained, else from scratch)")
    params: Dict[str, Any] = f({}, "sd3/flux: constructor arguments of the family's transformer class for from-scratch training")


@dataclass
class T5Config:
    """``model.t5``: the T5 text encoder of the sd3 and flux families."""

    use: bool = f(True, "sd3: False leaves T5 out (its states are zeros, as a pipeline without text_encoder_3); flux needs it")
    max_length: Optional[int] = f(None, "T5 tokens per caption (None: the pipeline's default, sd3 256, flux 512)", ge=1)
    dropout: float = f(0.0, "sd3: probability that a training sample's T5 states are zeros (the SD3 paper drops T5 part of the time)",
                       ge=0, le=1)


@dataclass
class FamilyModelFields:
    """Fields of the ``model`` section that one family reads (``ModelConfig`` inherits them)."""

    text_encoder_2: ComponentConfig = f(ComponentConfig, "sdxl: the second text encoder (OpenCLIP bigG, CLIPTextModelWithProjection)")
    tokenizer_2: ComponentConfig = f(ComponentConfig, "sdxl: the second tokenizer")
    text_encoder_3: ComponentConfig = f(ComponentConfig, "sd3: the T5 encoder (T5EncoderModel); flux's T5 is text_encoder_2")
    tokenizer_3: ComponentConfig = f(ComponentConfig, "sd3: the T5 tokenizer; flux's is tokenizer_2")
    transformer: TransformerConfig = f(TransformerConfig, "sd3/flux: the trained transformer")
    t5: T5Config = f(T5Config, "sd3/flux: the T5 encoder's use and length")
    guidance_embed: float = f(3.5, "flux: the guidance value fed to a guidance-distilled transformer (guidance_embeds) in training", ge=0)


@dataclass
class FamilySections:
    """Top-level sections that one family (or training stage) reads (``TrainConfig`` inherits them)."""

    vae_training: VAEObjectiveConfig = f(VAEObjectiveConfig, "autoencoder-stage losses (model.train_target=vae)")
    flow_matching: FlowMatchingConfig = f(FlowMatchingConfig, "sd3/flux: the flow-matching objective")


def check(cfg) -> None:
    """Rules of these sections that need no family code (``cfg``: the whole ``TrainConfig``)."""
    if cfg.model.train_target != "vae" and cfg.vae_training != VAEObjectiveConfig():
        raise ConfigError("the 'vae_training' section applies to model.train_target=vae only")
