"""Stable Diffusion 3 / 3.5: an MMDiT (``SD3Transformer2DModel``) trained with flow matching.

As ``StableDiffusion3Pipeline.encode_prompt`` conditions at inference, so the transformer trains:

* the penultimate hidden states of CLIP-L (``text_encoder``) and CLIP-G (``text_encoder_2``), both
  ``CLIPTextModelWithProjection``, concatenated along the channels and zero-padded to T5's width, then
  joined along the sequence (77 CLIP tokens unless ``model.text_encoder.max_length``)
  with T5's last hidden states (``text_encoder_3``, ``model.t5.max_length``
  tokens, default 256): [B, 77 + L, joint_attention_dim];
* pooled: the two CLIP projected pooled outputs, concatenated;
* an empty caption (caption dropout) is encoded as the pipeline encodes "" (SD3 has no zeroing of empty
  prompts); ``model.t5.use=false`` leaves T5 out (its states are zeros, as a pipeline without
  ``text_encoder_3``); ``model.t5.dropout``: a training sample's T5 states are zeros with that probability,
  drawn from the sample's ``t5_dropout`` stream (the SD3 paper drops each encoder part of the time);
* ``model.text_encoder.train``: both CLIPs train with the transformer (fp32, DDP-replicated, their own
  parameter groups; exports save them), T5 stays frozen; ``model.text_encoder.max_length``: CLIP tokens per
  caption (both tokenizers' ``model_max_length``, which the exported pipeline's encode_prompt reads).

Latents are ``(encode - shift_factor) * scaling_factor`` of the 16-channel VAE; the loss is flow matching
(``components.flow_matching``). The flow-matching base (``flow_family.FlowFamily``) holds the loss, the
stored-text plumbing, validation batches, sample grids, eval images and exports; this module declares the
components, the conditioning above and the ``StableDiffusion3Pipeline``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..config.schema import TrainConfig
from ..data.latent_checks import StoredText
from ..loading import load_component
from ..outputs.export import unwrap
from ..speed.precision import frozen_text_dtype
from . import reference_models as references
from .base import PixelGrid
from .components.clip import build_clip_tokenizer, place_text_encoder, text_encoder_for_pipeline
from .components.ddpm import host_seeds, sample_generators
from .components.t5 import (
    build_t5_tokenizer,
    encode_t5,
    load_t5_encoder,
    load_t5_tokenizer,
    t5_frozen_dtype,
    tiny_t5_encoder,
)
from .components.text import TextEncoding, grad_if_trained
from .components.transformer import (
    build_transformer,
    component_sources,
    load_schedulers,
    load_vae,
    reload_vae_fp32,
    source,
    validate_common,
)
from .components.unet import Components, frozen, uses_channels_last
from .flow_family import FlowFamily
from .tiny import TINY_TEXT_ENCODER, TINY_VAE, save, tokenizer_folder

log = logging.getLogger(__name__)

T5_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length
CLIP_LENGTH = 77  # CLIP's position embeddings (model.text_encoder.max_length: fewer)
SCALING_FACTOR, SHIFT_FACTOR = 1.5305, 0.0609  # SD3's VAE
# The tiny pipeline: two 64-wide CLIPs (projections 64 + 64 = the pooled 128), T5 128 wide (= the joint
# attention width; the CLIP states 64 + 64 are padded to it), a 2-layer MMDiT of 4 heads x 16, patch 2,
# a 16-channel VAE (downsampling 8: 32 px images are 2 x 2 tokens).
TINY_SD3_TRANSFORMER = dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                            attention_head_dim=16, num_attention_heads=4, joint_attention_dim=128,
                            caption_projection_dim=64, pooled_projection_dim=128, pos_embed_max_size=16)
TINY_SD3_VAE = dict(TINY_VAE, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)
SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass
class SD3Models(Components):
    tokenizer: Any
    tokenizer_2: Any
    tokenizer_3: Any  # None when model.t5.use is false
    text_encoder: torch.nn.Module  # CLIP-L with projection, frozen (fp32 and trained: model.text_encoder.train)
    text_encoder_2: torch.nn.Module  # CLIP-G with projection, as text_encoder
    text_encoder_3: Optional[torch.nn.Module]  # T5, frozen (None: left out)
    vae: torch.nn.Module
    transformer: torch.nn.Module  # trained
    noise_scheduler: Any  # FlowMatchEulerDiscreteScheduler: the training sigma table
    inference_scheduler: Any
    t5_length: int = T5_LENGTH
    reload_fp32: Optional[Callable[[str], torch.nn.Module]] = None
    _fp32_copies: dict = field(default_factory=dict, repr=False)

    @property
    def clip_length(self) -> int:
        return int(self.tokenizer.model_max_length)


def encode_prompts(text_encoder, text_encoder_2, text_encoder_3, input_ids, input_ids_2, input_ids_3=None,
                   t5_length: int = T5_LENGTH, t5_width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(states [B, n + L, W], pooled [B, p1 + p2]) in float32, as ``StableDiffusion3Pipeline.encode_prompt``
    (n: the CLIP ids' length, 77 unless ``model.text_encoder.max_length``): without T5 (``text_encoder_3``
    None) its L x ``t5_width`` states are zeros. Gradients flow into the CLIPs that train
    (``model.text_encoder.train``: every parameter reaches the conditioning, the last layer and final norm
    through the pooled output); T5 is always frozen."""
    with grad_if_trained(text_encoder):
        out1 = text_encoder(input_ids, output_hidden_states=True)
    with grad_if_trained(text_encoder_2):
        out2 = text_encoder_2(input_ids_2, output_hidden_states=True)
    clip = torch.cat([out1.hidden_states[-2].float(), out2.hidden_states[-2].float()], dim=-1)
    pooled = torch.cat([out1[0].float(), out2[0].float()], dim=-1)
    with torch.no_grad():
        if text_encoder_3 is not None:
            t5 = encode_t5(text_encoder_3, input_ids_3)
        else:
            t5 = torch.zeros(clip.shape[0], t5_length, t5_width, device=clip.device)
    clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5], dim=-2), pooled


def t5_keep(batch_size: int, p: float, device: torch.device, sample_seeds=None) -> torch.Tensor:
    """[B] float 0/1: 0 where a sample's T5 states are dropped (probability ``p``), from each sample's
    ``t5_dropout`` stream (else the global RNG)."""
    if sample_seeds is None:
        u = torch.rand(batch_size)
    else:
        u = torch.cat([torch.rand(1, generator=g) for g in sample_generators(host_seeds(sample_seeds), "t5_dropout", "cpu")])
    return (u >= p).float().to(device, non_blocking=True)


class StableDiffusion3(FlowFamily):
    name = text_tag = "sd3"
    display_name = "SD3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    card_tags = ("sd3", "sd3-diffusers")
    text_encoder_names = ("text_encoder", "text_encoder_2")  # both CLIPs (T5 never trains)

    @classmethod
    def loaded_text_components(cls, cfg: TrainConfig) -> tuple[str, ...]:
        return (*cls.text_encoder_names, *(("text_encoder_3",) if cfg.model.t5.use else ()))
    # Kept from when SD3 inherited SD's settings: under compile_scope=auto the whole transformer is compiled.
    compile_scope_auto = "whole"

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        validate_common(cfg, cls.name, trains_clip=True, net_class=cls.transformer_class)
        n = cfg.model.text_encoder.max_length
        if n is not None and not 2 <= n <= CLIP_LENGTH:
            raise ConfigError(f"model.text_encoder.max_length {n}: SD3's CLIP tokens per caption are 2 (start and end) "
                              f"to {CLIP_LENGTH}")
        if cfg.model.text_encoder_2.pretrained is None and cfg.model.pretrained is None:
            raise ConfigError("sd3 reads its components from a pipeline: set model.pretrained")

    @classmethod
    def pixel_grid(cls, net_conf: dict, vae_factor: int) -> PixelGrid:
        """The MMDiT cuts the latents into patch_size x patch_size patches, and its position embeddings
        cover pos_embed_max_size patches per side (diffusers' PatchEmbed crops them, and refuses more)."""
        patch = int(net_conf.get("patch_size") or 2)
        most = net_conf.get("pos_embed_max_size")
        largest = int(most) * patch * vae_factor if most else None
        why = (f"the VAE's {vae_factor} px per latent x the transformer's patch_size {patch}"
               + (f"; at most pos_embed_max_size {most} patches per side" if most else ""))
        return PixelGrid(vae_factor * patch, largest, why)

    # -- components -------------------------------------------------------------------------------
    def build_models(self) -> SD3Models:
        from diffusers import SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer

        m, dev = self.cfg.model, self.device
        clip_dtype = frozen_text_dtype(m.text_encoder.dtype, m.mixed_precision)
        train = m.text_encoder.train

        def load(loader, name: str):
            src, kw = source(m, name)
            if src is None:
                raise ConfigError(f"sd3's {name} has no source: set model.pretrained or model.{name}.pretrained")
            return load_component(loader, src, name, f"model.{name}.pretrained", **kw)

        def clip(name: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
            return frozen(load(CLIPTextModelWithProjection.from_pretrained, name), device, dtype)

        def trained_clip(name: str) -> torch.nn.Module:  # fp32, train mode, requiring grad
            encoder = load(CLIPTextModelWithProjection.from_pretrained, name)
            place_text_encoder(encoder, dev, True, m.gradient_checkpointing, clip_dtype)
            return encoder

        place = trained_clip if train else lambda name: clip(name, self.text_device, clip_dtype)

        length = m.t5.max_length or T5_LENGTH
        t5 = tok3 = None
        if m.t5.use:
            src, kw = source(m, "text_encoder_3")
            t5 = load_t5_encoder(src, "text_encoder_3", "model.text_encoder_3.pretrained", self.text_device,
                                 t5_frozen_dtype(m.text_encoder.dtype, m.mixed_precision), **kw)
            tsrc, tkw = source(m, "tokenizer_3")
            tok3 = load_t5_tokenizer(tsrc, "tokenizer_3", "model.tokenizer_3.pretrained", length, **tkw)

        def reload_fp32(name: str) -> torch.nn.Module:
            if name == "vae":
                return reload_vae_fp32(m)
            if name == "text_encoder_3":
                src, kw = source(m, name)
                return load_t5_encoder(src, name, f"model.{name}.pretrained", **kw)
            return clip(name, torch.device("cpu"), torch.float32)

        models = SD3Models(
            tokenizer=load(CLIPTokenizer.from_pretrained, "tokenizer"),
            tokenizer_2=load(CLIPTokenizer.from_pretrained, "tokenizer_2"), tokenizer_3=tok3,
            text_encoder=place("text_encoder"), text_encoder_2=place("text_encoder_2"),
            text_encoder_3=t5, vae=load_vae(m, dev),
            transformer=build_transformer(m, SD3Transformer2DModel, self.net_device, self.seed),
            noise_scheduler=None, inference_scheduler=None, t5_length=length, reload_fp32=reload_fp32,
        )
        models.noise_scheduler, models.inference_scheduler = load_schedulers(m)
        set_clip_length(models, m.text_encoder.max_length)
        check_components(models)
        return models

    @classmethod
    def text_tokens(cls, cfg: TrainConfig) -> int:
        """CLIP's tokens (``model.text_encoder.max_length``, else 77) and T5's (zeros without T5): the text side
        of the joint attention (the memory plan's activations)."""
        return int(cfg.model.text_encoder.max_length or CLIP_LENGTH) + int(cfg.model.t5.max_length or T5_LENGTH)

    @property
    def tokenizers(self):
        m = self.models
        return (m.tokenizer, m.tokenizer_2) + ((m.tokenizer_3,) if m.tokenizer_3 is not None else ())

    def frozen_modules(self) -> list[torch.nn.Module]:
        m, trained = self.models, self.trained_encoders().values()
        return [x for x in (m.vae, m.text_encoder, m.text_encoder_2, m.text_encoder_3)
                if x is not None and all(x is not t for t in trained)]

    # -- the step ---------------------------------------------------------------------------------
    def condition(self, batch: dict, validation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The base's (states, pooled); in training, T5's states zeroed per sample by ``model.t5.dropout``."""
        states, pooled = super().condition(batch, validation)
        t5 = self.cfg.model.t5
        if not validation and t5.use and t5.dropout > 0:
            keep = t5_keep(len(states), t5.dropout, self.device, batch.get("sample_seeds"))
            n = self.models.clip_length
            states = torch.cat([states[:, :n], states[:, n:] * keep[:, None, None]], dim=1)
        return states, pooled

    def stored_condition(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored states with T5's part zeroed when ``model.t5.use`` is false (as a pipeline without T5)."""
        states, pooled = super().stored_condition(batch)
        if not self.cfg.model.t5.use:
            n = self.models.clip_length
            states = torch.cat([states[:, :n], torch.zeros_like(states[:, n:])], dim=1)
        return states, pooled

    def encode_condition(self, batch: dict, validation: bool) -> tuple[torch.Tensor, torch.Tensor]:
        m, dev = self.models, self.device
        ids3 = batch["input_ids_3"].to(dev, non_blocking=True) if m.text_encoder_3 is not None else None
        clips = [m.text_encoder, m.text_encoder_2]
        if not validation:  # trained CLIPs as DDP wraps them (gradient hooks), else the modules
            clips = [self._encoders.get(n, e) for n, e in zip(("text_encoder", "text_encoder_2"), clips)]
        return encode_prompts(*clips, m.text_encoder_3, batch["input_ids"].to(dev, non_blocking=True),
                              batch["input_ids_2"].to(dev, non_blocking=True), ids3, m.t5_length,
                              int(m.transformer.config.joint_attention_dim))

    def latents(self, batch: dict) -> torch.Tensor:
        # Kept from when SD3 inherited SD's latents: channels-last where model.channels_last asks it (auto: on
        # CUDA), a layout only (the values are the same).
        latents = super().latents(batch)
        if uses_channels_last(self.cfg.model, self.device):
            latents = latents.contiguous(memory_format=torch.channels_last)
        return latents

    @property
    def max_sequence_length(self) -> int:
        return self.models.t5_length

    def stored_text(self) -> StoredText:
        m = self.models
        return StoredText(m.clip_length + m.t5_length, int(m.transformer.config.joint_attention_dim), 1,
                          self.text_tag)

    def component_sources(self) -> dict:
        names = ("transformer", "vae", "text_encoder", "text_encoder_2") + (
            ("text_encoder_3",) if self.models.text_encoder_3 is not None else ())
        return component_sources(self.cfg.model, names)

    def flops_inputs(self, config, h: int, w: int) -> dict:
        length = self.models.clip_length + self.models.t5_length
        return dict(hidden_states=torch.empty(1, config.in_channels, h, w, device="meta"),
                    encoder_hidden_states=torch.empty(1, length, config.joint_attention_dim, device="meta"),
                    pooled_projections=torch.empty(1, config.pooled_projection_dim, device="meta"),
                    timestep=torch.ones(1, device="meta"))

    def text_encoder_runs(self) -> list[tuple[torch.nn.Module, int, int]]:
        m = self.models
        passes = 3 if self.cfg.model.text_encoder.train else 1  # a trained CLIP's forward and backward
        return [(e, n, k) for e, n, k in ((m.text_encoder, m.clip_length, passes), (m.text_encoder_2, m.clip_length, passes),
                                          (m.text_encoder_3, m.t5_length, 1)) if e is not None]

    # -- artifacts --------------------------------------------------------------------------------
    def pipeline(self, net, for_export: bool = False):
        """A ``StableDiffusion3Pipeline`` of the run's components with ``net``; ``for_export``: the frozen
        components in fp32 as loaded."""
        m = self.models
        vae = m.full_precision("vae") if for_export else m.vae
        trained = self.trained_encoders()
        enc = {n: unwrap(trained[n]) if n in trained else (m.full_precision(n) if for_export else getattr(m, n))
               if getattr(m, n) is not None else None for n in ENCODERS}
        return _pipeline(unwrap(net), m.inference_scheduler, unwrap(vae), enc, m)

    # -- with no run ------------------------------------------------------------------------------
    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """A ``StableDiffusion3Pipeline``: two CLIPs with projection, a tiny T5, a 16-channel VAE, an MMDiT."""
        from diffusers import (
            AutoencoderKL,
            FlowMatchEulerDiscreteScheduler,
            SD3Transformer2DModel,
            StableDiffusion3Pipeline,
        )
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection

        scratch = [tokenizer_folder(out, n) for n in ("tokenizer", "tokenizer_2", "tokenizer_3")]
        tokenizer_3 = build_t5_tokenizer(scratch[2], T5_LENGTH)
        pipe = StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel(**TINY_SD3_TRANSFORMER),
            scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER),
            vae=AutoencoderKL(**TINY_SD3_VAE, scaling_factor=scaling_factor or SCALING_FACTOR, shift_factor=SHIFT_FACTOR),
            text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(**TINY_TEXT_ENCODER)),
            text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**dict(TINY_TEXT_ENCODER, pad_token_id=0))),
            text_encoder_3=tiny_t5_encoder(len(tokenizer_3)),
            tokenizer=build_clip_tokenizer(scratch[0]), tokenizer_2=build_clip_tokenizer(scratch[1], pad_token="!"),
            tokenizer_3=tokenizer_3,
        )
        return save(pipe, out, *scratch)

    @classmethod
    def text_encoding(cls, pipeline: str, device: torch.device, clip_skip: int = 0,
                      max_length: int | None = None) -> TextEncoding:
        """States (CLIP-L + CLIP-G padded, joined with T5's ``max_length`` tokens, default 256; zeros when the
        pipeline has no T5) and pooled, as :meth:`condition` computes them."""
        import os

        from transformers import CLIPTextModelWithProjection, CLIPTokenizer

        if clip_skip:
            raise ValueError("SD3 conditions on both CLIPs' penultimate layers: clip skip does not apply")
        if max_length is not None and max_length > cls.t5_limit:
            raise ValueError(f"SD3's T5 takes at most {cls.t5_limit} tokens, got max_length {max_length}")
        length = max_length or T5_LENGTH
        toks = [load_component(CLIPTokenizer.from_pretrained, pipeline, n, f"the pipeline's {n}/")
                for n in ("tokenizer", "tokenizer_2")]
        encs = [frozen(load_component(CLIPTextModelWithProjection.from_pretrained, pipeline, n, f"the pipeline's {n}/"),
                       device) for n in ("text_encoder", "text_encoder_2")]
        # CLIP's length as the pipeline encodes (its tokenizer's: an export of a max_length run saved it)
        clip = min(int(toks[0].model_max_length), *(e.config.max_position_embeddings for e in encs))
        toks[0].model_max_length = toks[1].model_max_length = clip
        has_t5 = os.path.isdir(os.path.join(pipeline, "text_encoder_3")) or not os.path.isdir(pipeline)
        if has_t5:
            toks.append(load_t5_tokenizer(pipeline, "tokenizer_3", "the pipeline's tokenizer_3/", length))
            encs.append(load_t5_encoder(pipeline, "text_encoder_3", "the pipeline's text_encoder_3/", device))
        width = _joint_width(pipeline)

        def encode_ids(encoders, ids):
            return encode_prompts(encoders[0], encoders[1], encoders[2] if has_t5 else None, ids[0], ids[1],
                                  ids[2] if has_t5 else None, length, width)

        return TextEncoding(cls.text_tag, toks, encs, encode_ids, storage_dtype="bf16")

    # memory and FLOP estimates -------------------------------------------------------------------
    net_class = "SD3Transformer2DModel"

    @classmethod
    def reference_models(cls) -> dict[str, references.ReferenceModel]:
        """SD3.5 medium and large (their transformers' config.json), CLIP-L, CLIP-G and T5-XXL, 77 + 256 tokens."""
        common = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
                      joint_attention_dim=4096, pooled_projection_dim=2048, qk_norm="rms_norm")
        encoders, tokens = ("CLIP-L", "CLIP-G", "T5-XXL"), CLIP_LENGTH + T5_LENGTH
        medium = dict(common, num_layers=24, num_attention_heads=24, caption_projection_dim=1536,
                      pos_embed_max_size=384, dual_attention_layers=tuple(range(13)))
        large = dict(common, num_layers=38, num_attention_heads=38, caption_projection_dim=2432, pos_embed_max_size=192)
        return {"SD3.5-medium": references.ReferenceModel(cls.net_class, medium, encoders, tokens),
                "SD3.5-large": references.ReferenceModel(cls.net_class, large, encoders, tokens)}


def _joint_width(pipeline: str) -> int:
    """The transformer's ``joint_attention_dim`` (T5's width) from the pipeline's config."""
    from diffusers import SD3Transformer2DModel

    conf = load_component(SD3Transformer2DModel.load_config, pipeline, "transformer", "the pipeline's transformer/")
    return int(conf["joint_attention_dim"])


def _pipeline(net, scheduler, vae, encoders: dict, m: SD3Models):
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(
        transformer=net, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder_for_pipeline(encoders["text_encoder"]), tokenizer=m.tokenizer,
        text_encoder_2=text_encoder_for_pipeline(encoders["text_encoder_2"]), tokenizer_2=m.tokenizer_2,
        text_encoder_3=encoders["text_encoder_3"], tokenizer_3=m.tokenizer_3,
    )


def set_clip_length(m: SD3Models, max_length: int | None) -> None:
    """Both CLIP tokenizers pad and truncate to ``model.text_encoder.max_length`` (None: the first
    tokenizer's length, at most the encoders' positions): ``StableDiffusion3Pipeline`` encodes both with
    ``tokenizer.model_max_length``, and exports save it, so inference reads the trained length."""
    limit = min(m.text_encoder.config.max_position_embeddings, m.text_encoder_2.config.max_position_embeddings)
    if max_length is not None and max_length > limit:
        raise ConfigError(f"model.text_encoder.max_length {max_length} exceeds the CLIPs' {limit} position embeddings")
    n = max_length or min(int(m.tokenizer.model_max_length), limit)
    m.tokenizer.model_max_length = m.tokenizer_2.model_max_length = n


def check_components(m: SD3Models) -> None:
    """The transformer's widths fit the encoders and the VAE (a ConfigError names what differs)."""
    c = m.transformer.config
    pooled = m.text_encoder.config.projection_dim + m.text_encoder_2.config.projection_dim
    clip = m.text_encoder.config.hidden_size + m.text_encoder_2.config.hidden_size
    problems = []
    if c.in_channels != m.vae.config.latent_channels:
        problems.append(f"in_channels {c.in_channels} != the VAE's latent_channels {m.vae.config.latent_channels}")
    if c.pooled_projection_dim != pooled:
        problems.append(f"pooled_projection_dim {c.pooled_projection_dim} != the CLIPs' projection_dim sum {pooled}")
    if c.joint_attention_dim < clip:
        problems.append(f"joint_attention_dim {c.joint_attention_dim} < the CLIPs' hidden_size sum {clip}")
    if m.text_encoder_3 is not None and m.text_encoder_3.config.d_model != c.joint_attention_dim:
        problems.append(f"joint_attention_dim {c.joint_attention_dim} != T5's d_model {m.text_encoder_3.config.d_model}")
    if problems:
        raise ConfigError("the SD3 transformer does not fit the pipeline's other components: " + "; ".join(problems)
                          + " (model.transformer.params must match them)")
