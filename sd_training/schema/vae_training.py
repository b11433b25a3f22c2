"""Schema of the ``vae_training`` section (the autoencoder stage's loss); checked by ``sd_training.vae_objective``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..fields import f


@dataclass
class VAEObjectiveConfig:
    reconstruction: str = f("l1", "l1 | l2: pixel reconstruction loss, mean over pixel values in [-1, 1] units")
    kl_weight: float = f(1e-6, "weight of KL(posterior || N(0, I)) summed over the latent, per 3*H*W pixel values (LDM KL-f8: 1e-6)")
    perceptual_weight: float = f(0.0, "weight of the VGG16 perceptual distance, added per image (0: off; LDM uses 1.0 with LPIPS)")
    perceptual_weights: Optional[str] = f(None, "local path of a torchvision VGG16 state_dict (.pth/.pt/.safetensors) for the perceptual loss")
