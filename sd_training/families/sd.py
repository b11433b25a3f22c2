"""Stable Diffusion 1.x / 2.x: one CLIP text encoder, a UNet conditioned on its hidden states.

The UNet base (``unet_family.UNetFamily``) holds online VAE encoding, the diffusion loss, validation
batches, exports, sample grids and eval images; this module adds the CLIP text encoder (trained or frozen,
clip skip, max length), its conditioning and the ``StableDiffusionPipeline``. SDXL (``sdxl.py``) extends it
with its second encoder and size conditioning.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..data.latent_checks import StoredText
from ..data.latents import TEXT_STATES_KEY
from ..outputs.export import unwrap
from .components.clip import (
    apply_clip_skip,
    build_clip_tokenizer,
    clip_skip_of,
    encode_text,
    load_pipeline_clip,
    text_encoder_for_pipeline,
)
from .components.text import TextEncoding
from .components.unet import build_models
from .tiny import SD_SCHEDULER, TINY_TEXT_ENCODER, TINY_UNET, TINY_VAE, save, tokenizer_folder
from .unet_family import UNetFamily

SCALING_FACTOR = 0.18215  # SD 1.x/2.x's VAE


def make_pipeline(models, unet: torch.nn.Module, vae: torch.nn.Module | None = None, for_export: bool = False):
    """A StableDiffusionPipeline of the run's components with ``unet`` (and ``vae``, when the VAE is trained).

    ``for_export``: the frozen VAE and text encoder in fp32 as loaded from their sources (a bf16 run
    keeps them in bf16 for speed; an export must not round them)."""
    from diffusers import StableDiffusionPipeline

    if vae is None:
        vae = models.full_precision("vae") if for_export else models.vae
    text_encoder = unwrap(models.text_encoder)
    if for_export and not any(p.requires_grad for p in text_encoder.parameters()):
        text_encoder = models.full_precision("text_encoder")
    return StableDiffusionPipeline(
        vae=unwrap(vae),
        text_encoder=text_encoder_for_pipeline(text_encoder),
        tokenizer=models.tokenizer,
        unet=unwrap(unet),
        scheduler=models.inference_scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )



class StableDiffusion(UNetFamily):
    name = "sd"
    pipeline_classes = ("StableDiffusionPipeline",)
    card_tags = ("stable-diffusion", "stable-diffusion-diffusers")
    kohya_lora_prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te1_"}
    text_encoder_names = ("text_encoder",)

    def build_models(self):
        return build_models(self.cfg.model, self.device, seed=self.seed, net_device=self.net_device)

    # -- what trains besides the UNet -------------------------------------------------------------
    def frozen_modules(self) -> list[torch.nn.Module]:
        return [x for x in (self.models.vae, self.models.text_encoder) if not any(p.requires_grad for p in x.parameters())]

    # -- the step ---------------------------------------------------------------------------------
    def condition(self, batch: dict, validation: bool) -> tuple[torch.Tensor, dict | None]:
        """The UNet's conditioning of a batch on the device: cross-attention states, no added kwargs."""
        if TEXT_STATES_KEY in batch:  # precomputed text-encoder outputs (latent shards)
            return batch[TEXT_STATES_KEY].to(self.device, non_blocking=True).float(), None
        encoder = self.models.text_encoder if validation else self._encoders.get("text_encoder", self.models.text_encoder)
        return encode_text(encoder, batch["input_ids"].to(self.device, non_blocking=True)), None

    def stored_text(self) -> StoredText:
        m = self.models
        return StoredText(int(m.tokenizer.model_max_length), int(m.text_encoder.config.hidden_size),
                          clip_skip_of(m.text_encoder), self.text_tag)

    # -- artifacts --------------------------------------------------------------------------------
    def pipeline(self, unet: torch.nn.Module, for_export: bool = False, vae: torch.nn.Module | None = None):
        return make_pipeline(self.models, unet, vae, for_export=for_export)

    # -- with no run ------------------------------------------------------------------------------
    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """A ``StableDiffusionPipeline`` in the 1.x layout (``families.tiny``'s sizes), DDIM for inference;
        the training scheduler is built from ``scheduler/`` (DDPMScheduler.from_pretrained), as diffusers does."""
        from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel

        scratch = tokenizer_folder(out, "tokenizer")
        tokenizer = build_clip_tokenizer(scratch)
        text_encoder = CLIPTextModel(CLIPTextConfig(**TINY_TEXT_ENCODER))
        vae = AutoencoderKL(**TINY_VAE, scaling_factor=scaling_factor or SCALING_FACTOR)
        unet = UNet2DConditionModel(**TINY_UNET)
        pipe = StableDiffusionPipeline(
            vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=DDIMScheduler(**SD_SCHEDULER),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
        return save(pipe, out, scratch)

    @classmethod
    def text_encoding(cls, pipeline: str, device: torch.device, clip_skip: int = 0,
                      max_length: int | None = None) -> TextEncoding:
        """The text encoder's last hidden state (clip skip applied), as :meth:`condition` computes it."""
        tokenizer, text_encoder = load_pipeline_clip(pipeline, device, max_length)
        apply_clip_skip(text_encoder, clip_skip)
        return TextEncoding(cls.text_tag, [tokenizer], [text_encoder],
                            lambda encoders, ids: (encode_text(encoders[0], ids[0]), None))
