"""Flux.1: a FluxTransformer2DModel trained with flow matching on 2x2-packed 16-channel latents.

As ``FluxPipeline`` conditions at inference, so the transformer trains:

* the T5 encoder's last hidden states (``text_encoder_2``, ``model.t5.max_length`` tokens, 512 by
  default as the pipeline pads) are the joint-attention text tokens;
* CLIP ViT-L's pooled output (``text_encoder``, a ``CLIPTextModel``, 77 tokens) is ``pooled_projections``;
* an empty caption (caption dropout) is encoded as the pipeline encodes "" (no zeroing);
* latents ``(z - shift_factor) * scaling_factor`` of the 16-channel VAE, packed into 2x2 patches
  (``FluxPipeline._pack_latents``: [B, h/2 * w/2, 64]); image position ids (0, row, column) of the packed
  grid (``FluxPipeline._prepare_latent_image_ids``) and all-zero text position ids;
* the guidance embedding of a guidance-distilled transformer (``transformer.config.guidance_embeds``,
  FLUX.1-dev) is given ``model.guidance_embed`` (3.5); a transformer without one (schnell) gets none.

The loss is flow matching (``components.flow_matching``, around the transformer's forward in
``flow_family.FlowFamily``), with Flux's shift that grows with the image's token
count (the scheduler's ``use_dynamic_shifting``) unless ``flow_matching`` sets another. Samples and exports
are ``FluxPipeline`` folders; the frozen parts are exported in fp32 as loaded.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..config import ConfigError
from ..config.schema import TrainConfig
from ..data.latent_checks import StoredText
from ..outputs.export import unwrap
from . import reference_models as references
from .base import PixelGrid, SampleSettings
from .components.clip import build_clip_tokenizer, build_text_encoder, load_pipeline_clip
from .components.packing import image_ids, image_seq_len, pack, text_ids, unpack
from .components.t5 import TINY_T5, build_t5_tokenizer, encode_t5, load_t5_encoder, load_t5_tokenizer, t5_frozen_dtype
from .components.text import TextEncoding
from .components.transformer import (
    build_transformer,
    component_sources,
    load_schedulers,
    load_vae,
    reload_vae_fp32,
    source,
)
from .components.unet import Components
from .flow_family import FlowFamily, patch_grid_refusal
from .options import FamilyModelFields
from .tiny import TINY_TEXT_ENCODER, TINY_VAE, save, tokenizer_folder

log = logging.getLogger(__name__)

T5_MAX_LENGTH = 512  # FluxPipeline's default max_sequence_length (and its limit)
SCALING_FACTOR, SHIFT_FACTOR = 0.3611, 0.1159  # FLUX.1's VAE
# FLUX.1's training scheduler: the shift by the image's token count (mu from 256 -> 0.5 to 4096 -> 1.15).
FLUX_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096)
# The tiny pipeline: 1 double-stream + 1 single-stream block of 2 heads x 16 channels; T5's 128-channel states
# are the text tokens, the tiny CLIP's 64-channel pooled output the pooled projection; 16 latent channels
# packed 2x2 -> 64 input channels.
TINY_FLUX_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                             num_attention_heads=2, joint_attention_dim=TINY_T5["d_model"],
                             pooled_projection_dim=TINY_TEXT_ENCODER["hidden_size"], guidance_embeds=True,
                             axes_dims_rope=(4, 6, 6))
TINY_FLUX_VAE = dict(TINY_VAE, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)


@dataclass
class FluxModels(Components):
    tokenizer: Any  # CLIPTokenizer (77 tokens)
    text_encoder: torch.nn.Module  # CLIPTextModel, frozen: its pooled output
    tokenizer_2: Any  # T5TokenizerFast (model.t5.max_length tokens)
    text_encoder_2: torch.nn.Module  # T5EncoderModel, frozen: its last hidden states
    vae: torch.nn.Module  # frozen
    transformer: torch.nn.Module  # trained
    noise_scheduler: Any  # FlowMatchEulerDiscreteScheduler: the training sigmas and shift
    inference_scheduler: Any  # the scheduler exported pipelines and samples use
    reload_fp32: Optional[Callable[[str], torch.nn.Module]] = None
    _fp32_copies: dict = field(default_factory=dict, repr=False)


def encode_prompts(text_encoder, text_encoder_2, input_ids: torch.Tensor,
                   input_ids_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T5 states [B, L, d_t5], CLIP pooled [B, d_clip]) in float32, as ``FluxPipeline.encode_prompt``
    computes them from the same token ids (both encoders frozen)."""
    with torch.no_grad():
        pooled = text_encoder(input_ids.to(text_encoder.device), output_hidden_states=False).pooler_output
    return encode_t5(text_encoder_2, input_ids_2), pooled.float()


def build_flux_models(cfg, device: torch.device, seed: int, text_device: torch.device | None = None,
                      net_device: torch.device | None = None) -> FluxModels:
    """The components from ``model.*``: CLIP and T5 frozen (``model.text_encoder.dtype``, on ``text_device``,
    None: ``device``), the VAE frozen
    (``model.vae.dtype``), the transformer from ``model.transformer`` (from scratch with its params)."""
    from diffusers import FluxTransformer2DModel

    text_device = text_device or device
    text_encoder, tokenizer = build_text_encoder(cfg.text_encoder, cfg.pretrained, text_device,
                                                 tokenizer_src=cfg.tokenizer.pretrained, revision=cfg.revision,
                                                 mixed_precision=cfg.mixed_precision)

    def load_t5(dev, dtype):
        src, kw = source(cfg, "text_encoder_2")
        if src is None:
            raise ConfigError("Flux's T5 encoder has no source: set model.pretrained or model.text_encoder_2.pretrained")
        return load_t5_encoder(src, "text_encoder_2", "model.text_encoder_2.pretrained", dev, dtype, **kw)

    def reload_fp32(name: str) -> torch.nn.Module:
        if name == "vae":
            return reload_vae_fp32(cfg)
        if name == "text_encoder_2":
            return load_t5(torch.device("cpu"), torch.float32)
        return build_text_encoder(replace(cfg.text_encoder, dtype="fp32"), cfg.pretrained, torch.device("cpu"),
                                  tokenizer_src=cfg.tokenizer.pretrained, revision=cfg.revision)[0]

    tok_src, tok_kw = source(cfg, "tokenizer_2")
    tokenizer_2 = load_t5_tokenizer(tok_src, "tokenizer_2", "model.tokenizer_2.pretrained",
                                    cfg.t5.max_length or T5_MAX_LENGTH, **tok_kw)
    noise_scheduler, inference_scheduler = load_schedulers(cfg)
    return FluxModels(
        tokenizer=tokenizer, text_encoder=text_encoder, tokenizer_2=tokenizer_2,
        text_encoder_2=load_t5(text_device, t5_frozen_dtype(cfg.text_encoder.dtype, cfg.mixed_precision)),
        vae=load_vae(cfg, device), transformer=build_transformer(cfg, FluxTransformer2DModel, net_device or device, seed),
        noise_scheduler=noise_scheduler, inference_scheduler=inference_scheduler, reload_fp32=reload_fp32,
    )


def check_models(m: FluxModels) -> None:
    """The components fit together (a transformer of another size, a 4-channel VAE ...)."""
    c = unwrap(m.transformer).config
    problems = [
        (c.in_channels != 4 * m.vae.config.latent_channels,
         f"in_channels {c.in_channels} != 4 x the VAE's latent_channels {m.vae.config.latent_channels} (2x2 packing)"),
        (c.joint_attention_dim != m.text_encoder_2.config.d_model,
         f"joint_attention_dim {c.joint_attention_dim} != T5's d_model {m.text_encoder_2.config.d_model}"),
        (c.pooled_projection_dim != m.text_encoder.config.hidden_size,
         f"pooled_projection_dim {c.pooled_projection_dim} != CLIP's hidden_size {m.text_encoder.config.hidden_size}"),
    ]
    for bad, message in problems:
        if bad:
            raise ConfigError(f"the Flux transformer does not fit the pipeline's other components: {message} "
                              "(model.transformer.params or model.transformer.pretrained)")


def _refusals(cfg: TrainConfig) -> list[tuple[bool, str]]:
    """Flux's own refusals (``components.transformer.validate_common`` has the transformer families')."""
    m = cfg.model
    return [
        (m.text_encoder_3.pretrained is not None or m.tokenizer_3.pretrained is not None,
         "model.text_encoder_3 / tokenizer_3 are SD3's T5; Flux's T5 is model.text_encoder_2 / tokenizer_2"),
        (not m.t5.use, "Flux's text tokens are T5's states: model.t5.use=false is SD3's"),
        (m.t5.dropout > 0, "model.t5.dropout is SD3's (its T5 may be dropped); Flux always conditions on T5"),
        patch_grid_refusal(cfg, "Flux"),
    ]


class Flux(FlowFamily):
    name = text_tag = "flux"
    text_components = ("text_encoder", "text_encoder_2")  # CLIP-L and T5
    display_name = "Flux"
    pipeline_classes = ("FluxPipeline",)
    card_tags = ("flux", "flux-diffusers")
    net_class = "FluxTransformer2DModel"

    def build_models(self) -> FluxModels:
        models = build_flux_models(self.cfg.model, self.device, self.seed, self.text_device, self.net_device)
        check_models(models)
        # The same refusal as at load (configure.check_family_limits), for a transformer whose config could
        # not be read then (a hub id not in the local cache)
        if self.takes_guidance_embed(dict(unwrap(models.transformer).config)) is False and \
                self.cfg.model.guidance_embed != FamilyModelFields().guidance_embed:
            raise ConfigError(f"'model.guidance_embed'={self.cfg.model.guidance_embed:g} would be unused: the "
                              "transformer has no guidance embedding to feed it (guidance_embeds is false). Remove "
                              "the key")
        return models

    @classmethod
    def refusals(cls, cfg: TrainConfig) -> list[tuple[bool, str]]:
        return _refusals(cfg)

    @classmethod
    def pixel_grid(cls, net_conf: dict, vae_factor: int) -> PixelGrid:
        """2x2 patches of the latents (``pack``); rotary positions, so no longest side."""
        return PixelGrid(vae_factor * 2, None, f"2x2 patches of the VAE's {vae_factor} px per latent")

    @classmethod
    def takes_guidance_embed(cls, net_conf: dict | None) -> bool | None:
        """FLUX.1-dev's transformer has a guidance embedding (``guidance_embeds``); schnell's has none."""
        return None if net_conf is None else bool(net_conf.get("guidance_embeds", False))

    @classmethod
    def text_tokens(cls, cfg: TrainConfig) -> int:
        """T5's tokens per caption: the text side of the joint attention (the memory plan's activations)."""
        return int(cfg.model.t5.max_length or T5_MAX_LENGTH)

    @property
    def max_sequence_length(self) -> int:
        return int(self.models.tokenizer_2.model_max_length)

    @property
    def tokenizers(self):
        """CLIP's ids are the batch's ``input_ids``, T5's its ``input_ids_2`` (the pipeline's numbering)."""
        return (self.models.tokenizer, self.models.tokenizer_2)

    def frozen_modules(self) -> list[torch.nn.Module]:
        m = self.models
        return [m.vae, m.text_encoder, m.text_encoder_2]

    # -- the step ---------------------------------------------------------------------------------
    def encode_condition(self, batch: dict, validation: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 states, CLIP pooled), both encoders frozen."""
        dev = self.device
        return encode_prompts(self.models.text_encoder, self.models.text_encoder_2,
                              batch["input_ids"].to(dev, non_blocking=True), batch["input_ids_2"].to(dev, non_blocking=True))

    def guidance(self, batch_size: int) -> torch.Tensor | None:
        """The guidance embedding's input (``model.guidance_embed``) when the transformer has one."""
        if not self.net.config.guidance_embeds:
            return None
        return torch.full((batch_size,), float(self.cfg.model.guidance_embed), device=self.device, dtype=torch.float32)

    def transformer_inputs(self, latents: torch.Tensor, states: torch.Tensor, pooled: torch.Tensor | None) -> dict:
        return dict(super().transformer_inputs(latents, states, pooled), txt_ids=text_ids(states),
                    img_ids=image_ids(latents), guidance=self.guidance(len(latents)))

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return pack(latents)

    def unpack(self, out: torch.Tensor, latents_shape: torch.Size) -> torch.Tensor:
        return unpack(out, latents_shape[-2], latents_shape[-1])

    def transformer_timestep(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps / 1000  # Flux's transformer takes sigma (its embedding multiplies by 1000)

    def image_seq_len(self, latents: torch.Tensor) -> int:
        return image_seq_len(latents)

    def validation_timesteps(self, n: int) -> torch.Tensor:
        """Spread over (0, 1000) (the resolution shift's table depends on the image size)."""
        return torch.arange(1, n + 1, dtype=torch.float32) * (self.num_timesteps / (n + 1))

    def stored_text(self) -> StoredText:
        m = self.models
        return StoredText(int(m.tokenizer_2.model_max_length), int(m.text_encoder_2.config.d_model), 1,
                          self.text_tag)

    def flops_inputs(self, config, h: int, w: int) -> dict:
        n, length = (h // 2) * (w // 2), self.max_sequence_length
        return dict(hidden_states=torch.empty(1, n, config.in_channels, device="meta"),
                    encoder_hidden_states=torch.empty(1, length, config.joint_attention_dim, device="meta"),
                    pooled_projections=torch.empty(1, config.pooled_projection_dim, device="meta"),
                    timestep=torch.ones(1, device="meta"), img_ids=torch.zeros(n, 3, device="meta"),
                    txt_ids=torch.zeros(length, 3, device="meta"),
                    guidance=torch.ones(1, device="meta") if config.guidance_embeds else None)

    def text_encoder_runs(self) -> list[tuple[torch.nn.Module, int, int]]:
        m = self.models
        return [(m.text_encoder, int(m.tokenizer.model_max_length), 1), (m.text_encoder_2, self.max_sequence_length, 1)]

    def component_sources(self) -> dict:
        return component_sources(self.cfg.model, ("transformer", "vae", "text_encoder", "text_encoder_2"))

    # -- artifacts --------------------------------------------------------------------------------
    def pipeline(self, transformer: torch.nn.Module, for_export: bool = False):
        """A FluxPipeline of the run's components with ``transformer``; ``for_export``: the frozen parts in
        fp32 as loaded (a bf16 run keeps them in bf16)."""
        import diffusers

        m = self.models
        parts = {n: m.full_precision(n) if for_export else getattr(m, n) for n in ("vae", "text_encoder", "text_encoder_2")}
        # the family's pipeline class (FluxPipeline; Flux Kontext's FluxKontextPipeline takes the same components)
        return getattr(diffusers, self.pipeline_classes[0])(scheduler=copy.deepcopy(m.inference_scheduler), tokenizer=m.tokenizer,
                            tokenizer_2=m.tokenizer_2, transformer=unwrap(transformer), **parts)

    def sampling(self, settings: SampleSettings) -> SampleSettings:
        """Flux samples without classifier-free guidance: the pipeline's guidance_scale is the guidance
        embedding's input, the value trained with (``model.guidance_embed``)."""
        return settings._replace(guidance=float(self.cfg.model.guidance_embed))

    # -- with no run ------------------------------------------------------------------------------
    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """A ``FluxPipeline``: the tiny CLIP (pooled), a tiny T5 (states, 512 tokens), a 16-channel VAE with a
        shift factor, a guidance-distilled tiny transformer, the Flux scheduler."""
        import diffusers
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import CLIPTextConfig, CLIPTextModel

        from .components.t5 import tiny_t5_encoder

        scratch = tokenizer_folder(out, "tokenizer"), tokenizer_folder(out, "tokenizer_2")
        tokenizer_2 = build_t5_tokenizer(scratch[1], T5_MAX_LENGTH)
        pipe = getattr(diffusers, cls.pipeline_classes[0])(
            scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
            vae=AutoencoderKL(**TINY_FLUX_VAE, scaling_factor=scaling_factor or SCALING_FACTOR, shift_factor=SHIFT_FACTOR,
                              force_upcast=False),
            text_encoder=CLIPTextModel(CLIPTextConfig(**TINY_TEXT_ENCODER)),
            tokenizer=build_clip_tokenizer(scratch[0]),
            text_encoder_2=tiny_t5_encoder(len(tokenizer_2)),
            tokenizer_2=tokenizer_2,
            transformer=FluxTransformer2DModel(**TINY_FLUX_TRANSFORMER),
        )
        return save(pipe, out, *scratch)

    @classmethod
    def text_encoding(cls, pipeline: str, device: torch.device, clip_skip: int = 0,
                      max_length: int | None = None) -> TextEncoding:
        """T5's states (``max_length`` tokens, None: 512) and CLIP's pooled output, as :meth:`condition`
        computes them; the T5 tokenizer comes first (its length is the stored states'); stored in bf16 by
        default (T5's states dominate the shards' size)."""
        if clip_skip:
            raise ValueError("Flux conditions on CLIP's pooled output: clip skip does not apply")
        if max_length is not None and max_length > T5_MAX_LENGTH:
            raise ValueError(f"Flux's T5 takes at most {T5_MAX_LENGTH} tokens, got max_length {max_length}")
        tokenizer, text_encoder = load_pipeline_clip(pipeline, device)
        tokenizer_2 = load_t5_tokenizer(pipeline, "tokenizer_2", "the pipeline's tokenizer_2/", max_length or T5_MAX_LENGTH)
        text_encoder_2 = load_t5_encoder(pipeline, "text_encoder_2", "the pipeline's text_encoder_2/", device)
        return TextEncoding(cls.text_tag, [tokenizer_2, tokenizer], [text_encoder_2, text_encoder],
                            lambda encoders, ids: encode_prompts(encoders[1], encoders[0], ids[1], ids[0]),
                            storage_dtype="bf16")

    # memory and FLOP estimates (the activations: FlowFamily's) ----------------------------------------
    @classmethod
    def reference_models(cls) -> dict[str, references.ReferenceModel]:
        """FLUX.1-dev (its transformer's config.json), CLIP-L and T5-XXL, 512 T5 tokens."""
        dev = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                   axes_dims_rope=(16, 56, 56))
        return {"Flux.1-dev": references.ReferenceModel(cls.net_class, dev, ("CLIP-L", "T5-XXL"), T5_MAX_LENGTH)}
