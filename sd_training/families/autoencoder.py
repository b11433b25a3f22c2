"""The autoencoder stage (``model.train_target=vae``): the VAE trains, the rest of the pipeline is frozen.

Works on top of a pipeline family (SD or SDXL): that family builds the components and exports the
pipeline, with the trained VAE (and its latent scaling factor measured on data) in place of the old one.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import torch
from PIL import Image

from ..config.schema import TrainConfig
from ..data import build_train_loader
from ..data.transforms import unit_range
from ..outputs.export import image_grid
from ..memory import activations
from .components.ddpm import host_seeds
from .autoencoder_loss import measure_scaling_factor, vae_loss, validate_vae_stage
from .base import Family, LossOut, SampleSettings

log = logging.getLogger(__name__)


@torch.no_grad()
def reconstruction_grid(vae, pixels: torch.Tensor) -> Image.Image:
    """Top row: the images; bottom row: the VAE's reconstructions (posterior mean, decoded)."""
    was_training = vae.training
    vae.eval()
    try:
        x = pixels.to(vae.dtype)
        rec = vae.decode(vae.encode(x).latent_dist.mode()).sample
    finally:
        vae.train(was_training)
    to_img = lambda t: Image.fromarray(((t.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy())  # noqa: E731
    images = [to_img(t) for t in pixels] + [to_img(t) for t in rec]
    return image_grid(images, len(pixels))


class VAELossModule(torch.nn.Module):
    """The autoencoder stage's forward: what DDP wraps, so its gradient hooks see every VAE call."""

    def __init__(self, vae: torch.nn.Module, cfg):
        super().__init__()
        self.vae = vae
        self.cfg = cfg

    def forward(self, pixels: torch.Tensor, sample_seeds: list[int] | None = None):
        return vae_loss(self.vae, pixels, self.cfg, sample_seeds=sample_seeds)


class Autoencoder(Family):
    name = "autoencoder"
    net_name = "vae"
    samples_tag = "reconstructions"
    makes_eval_images = False
    metric_prefix = "vae/"

    def __init__(self, cfg: TrainConfig, device: torch.device, seed: int, is_main: bool, pipeline_family: type[Family]):
        super().__init__(cfg, device, seed, is_main)
        self.base = pipeline_family(cfg, device, seed, is_main)
        self.models = self.base.models
        # The VAE trains (fp32 weights); the UNet and text encoder stay frozen.
        self.models.unet.requires_grad_(False).eval()
        self.net = self.models.vae.float().train().requires_grad_(True)
        self.loss_module = VAELossModule(self.net, cfg.vae_training)
        self.fixed_images = self._fixed_images() if is_main else None

    @property
    def tokenizers(self):
        return self.base.tokenizers

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        validate_vae_stage(cfg)

    def frozen_modules(self) -> list[torch.nn.Module]:
        # The UNet, then the pipeline family's frozen modules but the VAE (it trains here).
        return [self.models.unet] + self.base.frozen_modules()

    def component_sources(self) -> dict:
        return self.base.component_sources()

    @property
    def card_tags(self) -> tuple[str, ...]:
        return self.base.card_tags

    def loss(self, model, batch, autocast, fixed=None, validation=False) -> LossOut:
        pixels = unit_range(batch["pixel_values"].to(self.device, non_blocking=True))
        if validation:  # a fixed posterior sample per held-out batch: comparable across steps and restarts
            g = torch.Generator(self.device).manual_seed(int(batch["seed"]))
            loss, per_sample, parts = vae_loss(self.net, pixels, self.cfg.vae_training, generator=g)
        else:
            # The seeds as ints, not a tensor: DDP would move a tensor argument to the device.
            seeds = batch.get("sample_seeds")
            seeds = None if seeds is None else host_seeds(seeds)
            with autocast:
                loss, per_sample, parts = model(pixels, seeds)
        return LossOut(loss, per_sample.detach(), None, parts)

    def validation_batch(self, batch, generator, index) -> dict:
        return {"pixel_values": batch["pixel_values"], "seed": torch.tensor(self.cfg.validation.seed + index)}

    def _fixed_images(self) -> torch.Tensor:
        """The first images of the data (seed fixed, no workers): the reconstruction grid and the
        scaling-factor sample, the same across steps and restarts."""
        d = self.cfg.dataset
        params = dataclasses.replace(d.params, workers=0, batch_size=max(self.cfg.experiment.sample_per_prompt * 2, 8))
        loader = build_train_loader(dataclasses.replace(d, params=params), tokenizer=self.tokenizers, rank=0,
                                    world_size=1, seed=self.cfg.system.seed)
        return unit_range(next(iter(loader))["pixel_values"])

    def export(self, net, out: Path) -> dict:
        """The pipeline with a copy of the trained VAE whose config carries the latent scaling factor
        measured on data (1 / std of the latents, the convention behind SD's 0.18215)."""
        vae = copy.deepcopy(net).to(self.device).eval()
        scale = float(measure_scaling_factor(vae, [self.fixed_images.to(self.device)]))
        vae.register_to_config(scaling_factor=scale)
        log.info("measured latent scaling factor %.5f on %d images", scale, len(self.fixed_images))
        self.base.export_with_vae(self.models.unet, vae, out)
        return {"vae/scaling_factor": scale}

    def sample_image(self, net, settings: SampleSettings) -> Image.Image:
        return reconstruction_grid(net, self.fixed_images.to(self.device))

    # memory and FLOP estimates -------------------------------------------------------------------
    net_class = "AutoencoderKL"

    @classmethod
    def sample_activation_elements(cls, conf: dict, sample: activations.SampleShape, checkpointing: bool) -> float:
        """Encoder and decoder trained, at the image's resolution."""
        return activations.convolutional(activations.vae_activation_elements(conf, sample.resolution), checkpointing)
