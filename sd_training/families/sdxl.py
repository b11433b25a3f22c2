"""Stable Diffusion XL: two text encoders and micro-conditioning on sizes and crops.

As ``StableDiffusionXLPipeline`` conditions at inference, so the UNet trains:

* the penultimate hidden states (no final layer norm) of CLIP ViT-L (``text_encoder``, a
  ``CLIPTextModel``) and OpenCLIP bigG (``text_encoder_2``, a ``CLIPTextModelWithProjection``),
  concatenated along the channels: the cross-attention states;
* the projected pooled embedding of the second encoder (``text_embeds``);
* six "time ids" per image: ``original_size`` (h, w; from the sample's metadata when present, else the
  decoded image), ``crops_coords_top_left`` (y, x of the crop the transform made) and ``target_size``
  (h, w of the bucket);
* an empty caption (caption dropout, or a sample without one) gets all-zero states and pooled embedding:
  what the pipeline uses for the unconditional branch (``force_zeros_for_empty_prompt``), so
  classifier-free guidance at inference meets what was trained.

The VAE: SDXL's overflows in fp16, so ``model.vae.dtype`` fp16 is refused; fp32 or bf16, or a
user-supplied fp16-safe VAE through ``model.vae.pretrained`` with ``model.vae.dtype=fp32``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from ..config.schema import TrainConfig
from ..data.latent_checks import StoredText
from ..data.latents import POOLED_KEY, TEXT_STATES_KEY
from ..data.samples import SIZE_FIELDS
from ..loading import load_component
from ..outputs.export import unwrap
from ..speed.flops import StepFlops
from ..speed.precision import frozen_text_dtype
from .components.clip import (
    build_clip_tokenizer,
    load_pipeline_clip,
    place_text_encoder,
    text_encoder_for_pipeline,
    text_model_of,
)
from .components.text import TextEncoding, grad_if_trained
from .components.unet import Models, build_models
from .components.unet_flops import text_encode_flops, unet_inputs
from .sd import StableDiffusion
from .tiny import SD_SCHEDULER, TINY_TEXT_ENCODER, TINY_UNET, TINY_VAE, save, tokenizer_folder

log = logging.getLogger(__name__)

N_TIME_IDS = 6  # original (h, w), crop top-left (y, x), target (h, w)
SCALING_FACTOR = 0.13025  # SDXL's VAE

# The tiny pipeline: SDXL's layout at toy width: two text encoders whose hidden states are concatenated
# (64 + 64 = 128 channels of cross-attention), the second with a projection whose pooled output joins the
# six size / crop ids (8 channels each) in the added embedding: 64 + 6 x 8 = 112.
TINY_TEXT_ENCODER_2 = dict(TINY_TEXT_ENCODER, pad_token_id=0)
TINY_SDXL_UNET = dict(
    TINY_UNET,  # the same sizes; SDXL's block order, linear projections and added conditioning
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=TINY_TEXT_ENCODER["hidden_size"] + TINY_TEXT_ENCODER_2["hidden_size"],
    attention_head_dim=(2, 4, 8),
    transformer_layers_per_block=(1, 1, 1),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=TINY_TEXT_ENCODER_2["projection_dim"] + N_TIME_IDS * 8,
)
# SDXL's scheduler: Euler with "leading" spacing; SD's betas (Euler takes no clip_sample / set_alpha_to_one).
SDXL_SCHEDULER = dict(
    {k: v for k, v in SD_SCHEDULER.items() if k not in ("clip_sample", "set_alpha_to_one")},
    timestep_spacing="leading",
)


@dataclass
class SDXLModels(Models):
    """SD's components and SDXL's second text encoder (CLIPTextModelWithProjection) and tokenizer."""

    text_encoder_2: torch.nn.Module | None = None
    tokenizer_2: Any = None


def time_ids(batch: dict, height: int, width: int) -> torch.Tensor:
    """[B, 6] float: original_size + crops_coords_top_left + target_size per sample. A batch without
    the data pipeline's size fields (an older loader) conditions as the pipeline does by default:
    original = target = the trained size, crop (0, 0)."""
    n = len(batch["input_ids"])
    if all(k in batch for k in SIZE_FIELDS):
        ids = torch.cat([batch["original_size"], batch["crop_top_left"], batch["target_size"]], dim=1)
    else:
        ids = torch.tensor([[height, width, 0, 0, height, width]]).expand(n, N_TIME_IDS)
    return ids.float()


def encode_prompts(text_encoder, text_encoder_2, input_ids: torch.Tensor, input_ids_2: torch.Tensor,
                   eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-attention states [B, L, d1 + d2], pooled [B, p]) in fp32, zeros for empty captions.

    Gradients flow only into encoders that train (``model.text_encoder.train``)."""
    with grad_if_trained(text_encoder):
        h1 = text_encoder(input_ids, output_hidden_states=True).hidden_states[-2]
    with grad_if_trained(text_encoder_2):
        out2 = text_encoder_2(input_ids_2, output_hidden_states=True)
        pooled, h2 = out2[0], out2.hidden_states[-2]
    states = torch.cat([h1.float(), h2.float()], dim=-1)
    pooled = pooled.float()
    # "" tokenizes to [start, end, pad ...]: the caption was dropped (or the sample had none).
    keep = (input_ids[:, 1] != eos_token_id).to(states.dtype)
    return states * keep[:, None, None], pooled * keep[:, None]


class StableDiffusionXL(StableDiffusion):
    name = "sdxl"
    text_tag = "sdxl"
    pipeline_classes = ("StableDiffusionXLPipeline",)
    card_tags = ("stable-diffusion-xl", "stable-diffusion-xl-diffusers")
    kohya_lora_prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
    text_encoder_names = text_components = ("text_encoder", "text_encoder_2")

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        super().validate(cfg)  # the transformer families' keys
        m = cfg.model
        refusals = [
            (m.text_encoder.type != "clip", "SDXL's text encoders are read from the pipeline (text_encoder/, "
                                            "text_encoder_2/): model.text_encoder.type must be clip"),
            (m.text_encoder.clip_skip not in (0, 1), "SDXL already conditions on the penultimate layers of both "
                                                     "encoders: leave model.text_encoder.clip_skip at 0"),
            (m.vae.dtype == "fp16", "SDXL's VAE overflows in fp16: set model.vae.dtype to auto, bf16 or fp32 (or give "
                                    "an fp16-safe VAE through model.vae.pretrained with model.vae.dtype=fp32)"),
        ]
        for refused, message in refusals:
            if refused:
                raise ConfigError(message)
        if m.unet.params and m.unet.params.get("addition_embed_type") != "text_time":
            raise ConfigError("model.unet.params builds an SDXL UNet from scratch: it needs addition_embed_type: "
                              "text_time (and addition_time_embed_dim, projection_class_embeddings_input_dim)")

    def build_models(self):
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer

        cfg = self.cfg.model

        def source(component):
            own = getattr(cfg, component).pretrained
            return own or cfg.pretrained, dict(revision=cfg.revision) if cfg.revision and not own else {}

        src, kw = source("text_encoder_2")
        if src is None:
            raise ConfigError("SDXL's second text encoder has no source: set model.pretrained or model.text_encoder_2.pretrained")
        def load_text_encoder_2() -> torch.nn.Module:
            return load_component(CLIPTextModelWithProjection.from_pretrained, src, "text_encoder_2",
                                  "model.text_encoder_2.pretrained", **kw)

        text_encoder_2 = load_text_encoder_2()
        tok_src, tok_kw = source("tokenizer_2")
        tokenizer_2 = load_component(CLIPTokenizer.from_pretrained, tok_src, "tokenizer_2", "model.tokenizer_2.pretrained",
                                     **tok_kw)
        models = build_models(cfg, self.device, seed=self.seed, extra_context_dim=text_encoder_2.config.hidden_size,
                              net_device=self.net_device)
        # Both encoders train (fp32, the UNet's schedule and, unless set, its LR) or both are frozen.
        place_text_encoder(text_encoder_2, self.device, cfg.text_encoder.train, cfg.gradient_checkpointing,
                           frozen_text_dtype(cfg.text_encoder.dtype, cfg.mixed_precision))
        if cfg.text_encoder.train:
            # The first encoder's last layer and final norm do not reach SDXL's conditioning (it reads the
            # penultimate layer): frozen, so no gradient is ever waited for (DDP) or decayed to zero (AdamW).
            core = text_model_of(models.text_encoder)
            core.encoder.layers[-1].requires_grad_(False)
            core.final_layer_norm.requires_grad_(False)
        models = SDXLModels(**{f.name: getattr(models, f.name) for f in fields(Models)}, text_encoder_2=text_encoder_2,
                            tokenizer_2=tokenizer_2)
        unet = unwrap(models.unet)
        if unet.config.get("addition_embed_type") != "text_time":
            raise ConfigError(f"the UNet of {cfg.unet.pretrained or cfg.pretrained} is not an SDXL UNet "
                              "(addition_embed_type is not text_time): set model.family to match the pipeline")
        want = text_encoder_2.config.projection_dim + N_TIME_IDS * unet.config.addition_time_embed_dim
        if unet.config.projection_class_embeddings_input_dim != want:
            raise ConfigError(f"the SDXL UNet's projection_class_embeddings_input_dim is "
                              f"{unet.config.projection_class_embeddings_input_dim}, but text_encoder_2's projection_dim "
                              f"{text_encoder_2.config.projection_dim} + 6 x addition_time_embed_dim "
                              f"{unet.config.addition_time_embed_dim} = {want}")
        reload = models.reload_fp32

        def reload_fp32(name: str) -> torch.nn.Module:
            return load_text_encoder_2() if name == "text_encoder_2" else reload(name)

        return replace(models, reload_fp32=reload_fp32)

    @property
    def tokenizers(self):
        return (self.models.tokenizer, self.models.tokenizer_2)

    def frozen_modules(self) -> list[torch.nn.Module]:
        second = self.models.text_encoder_2
        return super().frozen_modules() + ([] if any(p.requires_grad for p in second.parameters()) else [second])

    def condition(self, batch: dict, validation: bool):
        dev = self.device
        res = self.cfg.dataset.params.resolution
        ids = time_ids(batch, res, res).to(dev, non_blocking=True)
        if TEXT_STATES_KEY in batch:  # precomputed (latent shards with --text-embeddings)
            if POOLED_KEY not in batch:
                raise ValueError(f"the batch has stored text embeddings but no {POOLED_KEY}: these latent shards "
                                 "were not made for SDXL (scripts/precompute_latents.py with an SDXL pipeline)")
            states = batch[TEXT_STATES_KEY].to(dev, non_blocking=True).float()
            return states, {"text_embeds": batch[POOLED_KEY].to(dev, non_blocking=True).float(), "time_ids": ids}
        encoders = [self.models.text_encoder, self.models.text_encoder_2]
        if not validation:  # the trained encoders as DDP wraps them (gradient hooks), else the modules
            encoders = [self._encoders.get(n, e) for n, e in zip(("text_encoder", "text_encoder_2"), encoders)]
        states, pooled = encode_prompts(
            *encoders, batch["input_ids"].to(dev, non_blocking=True),
            batch["input_ids_2"].to(dev, non_blocking=True), int(self.models.tokenizer.eos_token_id),
        )
        return states, {"text_embeds": pooled, "time_ids": ids}

    def stored_text(self) -> StoredText:
        m = self.models
        return replace(super().stored_text(), width=int(m.text_encoder.config.hidden_size + m.text_encoder_2.config.hidden_size))

    def step_flops(self) -> StepFlops:
        """The UNet base's count with the second encoder's forward added."""
        flops = super().step_flops()
        seq = int(self.models.tokenizer_2.model_max_length)
        return replace(flops, text_encode=flops.text_encode + text_encode_flops(self.models.text_encoder_2, seq))

    def pipeline(self, unet, for_export: bool = False, vae=None):
        from diffusers import StableDiffusionXLPipeline

        m = self.models
        if vae is None:
            vae = m.full_precision("vae") if for_export else m.vae
        encoders = [m.full_precision(n) if for_export else getattr(m, n) for n in ("text_encoder", "text_encoder_2")]
        return StableDiffusionXLPipeline(
            vae=unwrap(vae), text_encoder=text_encoder_for_pipeline(encoders[0]),
            text_encoder_2=text_encoder_for_pipeline(encoders[1]), tokenizer=m.tokenizer, tokenizer_2=m.tokenizer_2,
            unet=unwrap(unet), scheduler=m.inference_scheduler, force_zeros_for_empty_prompt=True,
            add_watermarker=False,
        )

    # -- with no run ------------------------------------------------------------------------------
    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """A ``StableDiffusionXLPipeline``: two text encoders, size conditioning, Euler for inference."""
        from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

        scratch = tokenizer_folder(out, "tokenizer"), tokenizer_folder(out, "tokenizer_2")
        pipe = StableDiffusionXLPipeline(
            vae=AutoencoderKL(**TINY_VAE, scaling_factor=scaling_factor or SCALING_FACTOR, force_upcast=False),
            text_encoder=CLIPTextModel(CLIPTextConfig(**TINY_TEXT_ENCODER)),
            text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**TINY_TEXT_ENCODER_2)),
            tokenizer=build_clip_tokenizer(scratch[0]),
            tokenizer_2=build_clip_tokenizer(scratch[1], pad_token="!"),
            unet=UNet2DConditionModel(**TINY_SDXL_UNET),
            scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER),
            force_zeros_for_empty_prompt=True,
            add_watermarker=False,
        )
        return save(pipe, out, *scratch)

    @classmethod
    def text_encoding(cls, pipeline: str, device: torch.device, clip_skip: int = 0,
                      max_length: int | None = None) -> TextEncoding:
        """Both encoders' penultimate states concatenated and the second's pooled embedding, zeros for an
        empty caption (:func:`encode_prompts`, as :meth:`condition` computes them)."""
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer

        if clip_skip or max_length:
            raise ValueError("SDXL conditions on both encoders' penultimate layers at 77 tokens: clip skip and "
                             "max length do not apply")
        tokenizer, text_encoder = load_pipeline_clip(pipeline, device)
        tokenizer_2 = load_component(CLIPTokenizer.from_pretrained, pipeline, "tokenizer_2", "the pipeline's tokenizer_2/")
        text_encoder_2 = load_component(CLIPTextModelWithProjection.from_pretrained, pipeline, "text_encoder_2",
                                        "the pipeline's text_encoder_2/")
        eos = int(tokenizer.eos_token_id)
        return TextEncoding(cls.text_tag, [tokenizer, tokenizer_2],
                            [text_encoder, text_encoder_2.to(device).eval().requires_grad_(False)],
                            lambda encoders, ids: encode_prompts(*encoders, *ids, eos))

    # memory and FLOP estimates -------------------------------------------------------------------
    @staticmethod
    def flop_inputs(unet: torch.nn.Module, latent_size, seq_len: int, batch: int) -> tuple[tuple, dict]:
        """SD's UNet arguments plus the added conditioning: the pooled text embeddings and 6 size/crop ids."""
        args, kwargs = unet_inputs(unet, latent_size, seq_len, batch)
        c = unet.config
        n_text = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.empty(batch, n_text, device="meta"),
                                       "time_ids": torch.empty(batch, 6, device="meta")}
        return args, kwargs
