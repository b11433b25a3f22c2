"""Config sections that belong to one family, assembled into the schema by ``sd_training.config.schema``
(torch-free: imports only ``sd_training.config.fields``). The keys users type stay where they were:
``model.text_encoder_2.pretrained=...`` (SDXL's second encoder), ``vae_training.kl_weight=...`` (the
autoencoder stage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config.fields import ComponentConfig, ConfigError, f


@dataclass
class VAEObjectiveConfig:
    """The ``vae_training`` section (the autoencoder stage's loss); checked by ``families.autoencoder_loss``."""

    reconstruction: str = f("l1", "pixel reconstruction loss, mean over pixel values in [-1, 1] units", choices=("l1", "l2"))
    kl_weight: float = f(1e-6, "weight of KL(posterior || N(0, I)) summed over the latent, per 3*H*W pixel values (LDM KL-f8: 1e-6)")
    perceptual_weight: float = f(0.0, "weight of the VGG16 perceptual distance, added per image (0: off; LDM uses 1.0 with LPIPS)")
    perceptual_weights: Optional[str] = f(None, "local path of a torchvision VGG16 state_dict (.pth/.pt/.safetensors) for the perceptual loss")


@dataclass
class FamilyModelFields:
    """Fields of the ``model`` section that one family reads (``ModelConfig`` inherits them)."""

    text_encoder_2: ComponentConfig = f(ComponentConfig, "sdxl: the second text encoder (OpenCLIP bigG, CLIPTextModelWithProjection)")
    tokenizer_2: ComponentConfig = f(ComponentConfig, "sdxl: the second tokenizer")


@dataclass
class FamilySections:
    """Top-level sections that one family (or training stage) reads (``TrainConfig`` inherits them)."""

    vae_training: VAEObjectiveConfig = f(VAEObjectiveConfig, "autoencoder-stage losses (model.train_target=vae)")


def check(cfg) -> None:
    """Rules of these sections that need no family code (``cfg``: the whole ``TrainConfig``)."""
    if cfg.model.train_target != "vae" and cfg.vae_training != VAEObjectiveConfig():
        raise ConfigError("the 'vae_training' section applies to model.train_target=vae only")
