"""FLUX.2 (dev and klein): a ``Flux2Transformer2DModel`` trained with flow matching on the latents of
``AutoencoderKLFlux2``, conditioned on hidden states of a decoder-only LLM. What both share is here; the
text encoders and their pipelines are ``flux2_klein.py`` (Qwen3, ``Flux2KleinPipeline``) and ``flux2_dev.py``
(Mistral-3, ``Flux2Pipeline``).

As the FLUX.2 pipelines (and diffusers' ``train_dreambooth_lora_flux2*.py``) see the image:

* latents (``flux2_latents.py``): the VAE's posterior (mean or sample) in 2x2 patches, each of the 4C patch
  channels normalised with the VAE's batch-norm running statistics, ``(z - running_mean) /
  sqrt(running_var + batch_norm_eps)`` (``_encode_vae_image``), kept unpatchified; the noise is drawn in
  that layout, and the loss is the per-sample mean over all of them, so the order does not change it;
* the transformer's tokens: the patches packed row by row (``_pack_latents``: [B, h/2 * w/2, 4C]), with
  4-axis position ids (t, row, column, 0); the text tokens' ids are (0, 0, 0, l); no pooled embedding;
* timestep: sigma (the transformer multiplies by 1000); a guidance-distilled transformer
  (``guidance_embeds``: FLUX.2 dev) gets ``model.guidance_embed``, klein none.

Reference images (``dataset.params.references``, 0 to ``reference_images[1]``: the pipelines' ``image=[...]``),
through FlowFamily's ``join_references`` hook: each reference's latents as the target's (the same VAE encode
and batch-norm normalisation), patchified and packed, concatenated after the target's tokens in order, with
ids (10 + 10k, row, column, 0) for the k-th (``flux2_latents.reference_tokens``: ``prepare_image_latents`` and
``_prepare_image_ids``); the prediction is cut to the target's tokens (the loss is the target's alone) and the
resolution shift counts the target's tokens, as the pipelines' ``image_seq_len``. The references arrive at the
target's size (``reference_crop``: ``center`` resizes each on its own, ``aligned`` crops it with the target);
the pipelines resize a reference on its own only above 1024 x 1024 px of area (and floor its sides to 16 px).

The loss is flow matching around the transformer (``flow_family.FlowFamily``), with the shift that grows with
the image's token count (the scheduler's ``use_dynamic_shifting``, as Flux.1) unless ``flow_matching`` sets
another: diffusers' example trains on the unshifted table, the pipelines sample with an empirical shift.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..config import ConfigError
from ..config.schema import ModelConfig, TrainConfig
from ..data.latent_checks import StoredText
from ..data.latents import POOLED_KEY, TEXT_STATES_KEY
from ..loading import load_component
from ..memory import activations
from ..outputs.comfy_lora import ComfyLoraNames, Rule, fused
from ..outputs.export import unwrap
from .base import LossOut, PixelGrid, SampleSettings
from .components import llm_text
from .components import vae as vae_encoding
from .components.text import TextEncoding
from .components.transformer import build_transformer, load_schedulers, load_vae_of, source
from .components.unet import Components
from .flow_family import FlowFamily, llm_text_refusals, patch_grid_refusal
from .flux2_latents import TINY_FLUX2_VAE, NormalizedVAE, image_ids, reference_tokens, text_ids, tokens, untokens

# FLUX.2's scheduler (scheduler/scheduler_config.json of FLUX.2-dev and klein): Flux.1's, dynamic shifting.
FLUX2_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                       base_image_seq_len=256, max_image_seq_len=4096)
FLUX2_LATENT_CHANNELS = 32  # AutoencoderKLFlux2's (the memory plan's default)
# The tiny transformer: 1 double- + 1 single-stream block of 2 heads x 16 (rotary axes 4 x 4 = 16).
TINY_FLUX2_TRANSFORMER = dict(patch_size=1, in_channels=4 * TINY_FLUX2_VAE["latent_channels"], num_layers=1,
                              num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                              timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4))


# model.adapter.export_kohya: BFL's layer names (ComfyUI's FLUX.2 model), as diffusers' single-file converter
# maps them and _convert_non_diffusers_flux2_lora_to_diffusers reads LoRAs of them back (lora_A / lora_B, no
# alpha). norm_out.linear has none: BFL's final adaLN holds (shift, scale), diffusers' (scale, shift), and
# that converter does not swap them, so no one file loads right in both.
_DOUBLE, _SINGLE = r"transformer_blocks\.(\d+)\.", r"single_transformer_blocks\.(\d+)\.attn\."
FLUX2_COMFY = ComfyLoraNames(rules=(
    *fused(_DOUBLE + r"attn\.{}", r"double_blocks.\1.img_attn.qkv", ("to_q", "to_k", "to_v")),
    *fused(_DOUBLE + r"attn\.{}", r"double_blocks.\1.txt_attn.qkv", ("add_q_proj", "add_k_proj", "add_v_proj")),
    Rule(_DOUBLE + r"attn\.to_out\.0", r"double_blocks.\1.img_attn.proj"),
    Rule(_DOUBLE + r"attn\.to_add_out", r"double_blocks.\1.txt_attn.proj"),
    Rule(_DOUBLE + r"ff\.linear_in", r"double_blocks.\1.img_mlp.0"),
    Rule(_DOUBLE + r"ff\.linear_out", r"double_blocks.\1.img_mlp.2"),
    Rule(_DOUBLE + r"ff_context\.linear_in", r"double_blocks.\1.txt_mlp.0"),
    Rule(_DOUBLE + r"ff_context\.linear_out", r"double_blocks.\1.txt_mlp.2"),
    Rule(_SINGLE + r"to_qkv_mlp_proj", r"single_blocks.\1.linear1"),
    Rule(_SINGLE + r"to_out", r"single_blocks.\1.linear2"),
    Rule(r"x_embedder", "img_in"), Rule(r"context_embedder", "txt_in"), Rule(r"proj_out", "final_layer.linear"),
    Rule(r"time_guidance_embed\.timestep_embedder\.linear_1", "time_in.in_layer"),
    Rule(r"time_guidance_embed\.timestep_embedder\.linear_2", "time_in.out_layer"),
    Rule(r"time_guidance_embed\.guidance_embedder\.linear_1", "guidance_in.in_layer"),
    Rule(r"time_guidance_embed\.guidance_embedder\.linear_2", "guidance_in.out_layer"),
    Rule(r"(single_stream_modulation|double_stream_modulation_img|double_stream_modulation_txt)\.linear", r"\1.lin"),
), style="lora_A", alpha=False, reader="_convert_non_diffusers_flux2_lora_to_diffusers")

# The published transformers' config.json, what the memory table plans (``reference_models``)
FLUX2_REFERENCE = dict(patch_size=1, in_channels=128, attention_head_dim=128, timestep_guidance_channels=256,
                       mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000)


# The pipelines refuse a reference image under 64 px a side (Flux2ImageProcessor.check_image_input).
PIPELINE_MIN_REFERENCE_SIDE = 64


def sample_reference(image):
    """A reference image for the pipeline (RGB): scaled up (aspect kept) to at least its 64 px a side, so
    sample grids at the small sizes of CPU runs and tests work; a larger one as it is."""
    from PIL import Image

    image = image.convert("RGB")
    w, h = image.size
    scale = PIPELINE_MIN_REFERENCE_SIDE / min(w, h)
    if scale <= 1:
        return image
    return image.resize((max(PIPELINE_MIN_REFERENCE_SIDE, round(w * scale)), max(PIPELINE_MIN_REFERENCE_SIDE, round(h * scale))),
                        Image.Resampling.LANCZOS)


def batch_references(batch: dict) -> int:
    """Reference images per sample in a batch: ``reference_latents`` (latent shards) or ``reference_values``
    (images), [B, R, ...]; 0 without."""
    for key in ("reference_latents", "reference_values"):
        if key in batch:
            return int(batch[key].shape[1])
    return 0


# -- components ----------------------------------------------------------------------------------------------
def check_models(transformer, vae, text_width: int, what: str) -> None:
    """The components fit together (a transformer of another size, another VAE ...)."""
    c = unwrap(transformer).config
    problems = [
        (c.in_channels != 4 * vae.config.latent_channels,
         f"in_channels {c.in_channels} != 4 x the VAE's latent_channels {vae.config.latent_channels} (2x2 patches)"),
        (c.joint_attention_dim != text_width,
         f"joint_attention_dim {c.joint_attention_dim} != the {what} states' width {text_width}"),
    ]
    for bad, message in problems:
        if bad:
            raise ConfigError(f"the FLUX.2 transformer does not fit the pipeline's other components: {message} "
                              "(model.transformer.params or model.transformer.pretrained)")


@dataclass
class Flux2Models(Components):
    tokenizer: Any  # llm_text.PromptTokenizer over the pipeline's tokenizer (klein) or processor (dev)
    text_encoder: torch.nn.Module  # the LLM, frozen: its hidden states
    vae: torch.nn.Module  # AutoencoderKLFlux2, frozen
    transformer: torch.nn.Module  # Flux2Transformer2DModel, trained
    noise_scheduler: Any
    inference_scheduler: Any
    pipeline_config: dict = field(default_factory=dict)  # the pipeline's own settings (klein: is_distilled)
    reload_fp32: Optional[Callable[[str], torch.nn.Module]] = None
    _fp32_copies: dict = field(default_factory=dict, repr=False)


def load_text_encoder(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The frozen LLM of ``model.text_encoder.pretrained`` / the pipeline's ``text_encoder/`` (the class its
    config.json names: Qwen3ForCausalLM, Mistral3ForConditionalGeneration)."""
    src, kw = source(cfg, "text_encoder")
    if src is None:
        raise ConfigError("the text encoder has no source: set model.pretrained or model.text_encoder.pretrained")
    return llm_text.load_llm(src, "text_encoder", "model.text_encoder.pretrained", device, dtype, **kw)


def pipeline_settings(cfg: ModelConfig, keys: tuple[str, ...]) -> dict:
    """``keys`` of the pipeline root's model_index.json that it has (a local folder, or a hub id in the cache;
    none without a pipeline root), so the exports keep them."""
    if not keys or not cfg.pretrained:
        return {}
    path = os.path.join(cfg.pretrained, "model_index.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            index = json.load(fh)
    else:
        from diffusers import DiffusionPipeline

        try:
            index = DiffusionPipeline.load_config(cfg.pretrained)
        except Exception:  # noqa: BLE001 -- components set one by one: no pipeline settings to keep
            return {}
    return {k: index[k] for k in keys if isinstance(index, dict) and k in index}


class Flux2Family(FlowFamily):
    """What FLUX.2 dev and klein share (see the module); a subclass names its text encoder and pipeline."""

    text_settings: llm_text.LLMTextSettings  # how the pipeline's encode_prompt runs its LLM
    text_encoder_name = ""  # the LLM, in messages ("Qwen3", "Mistral-3")
    pipeline_keys: tuple[str, ...] = ()  # model_index.json settings its pipeline class takes (klein: is_distilled)
    net_class = "Flux2Transformer2DModel"
    card_tags = ("flux2", "flux2-diffusers")
    comfy_lora_names = FLUX2_COMFY
    # LoRA presets by Flux2's layer names: the joint attention's projections (the double blocks' image and text
    # sides, the single blocks' fused qkv+mlp input and output); + the double blocks' feed-forwards; every
    # Linear. diffusers' example trains to_q/k/v/out.0 + the single blocks' to_qkv_mlp_proj and to_out.
    _ATTENTION = (r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|"
                  r"to_add_out)|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)")
    adapter_presets = {
        "attention": _ATTENTION,
        "attention_ffn": rf"{_ATTENTION}|transformer_blocks\.\d+\.ff(_context)?\.(linear_in|linear_out)",
        "all_linear": r".+",
    }

    def build_models(self) -> Flux2Models:
        from diffusers import Flux2Transformer2DModel

        cfg = self.cfg.model

        def reload_fp32(name: str) -> torch.nn.Module:
            if name == "vae":
                return load_vae_of("AutoencoderKLFlux2", cfg, None, torch.float32)
            return load_text_encoder(cfg, torch.device("cpu"), torch.float32)

        noise_scheduler, inference_scheduler = load_schedulers(cfg)
        models = Flux2Models(
            tokenizer=self.load_prompt_tokenizer(*source(cfg, "tokenizer"), "model.tokenizer.pretrained",
                                                 self.text_length(self.cfg)),
            text_encoder=load_text_encoder(cfg, self.text_device, llm_text.frozen_dtype(cfg.text_encoder.dtype,
                                                                                    cfg.mixed_precision)),
            vae=load_vae_of("AutoencoderKLFlux2", cfg, self.device),
            transformer=build_transformer(cfg, Flux2Transformer2DModel, self.net_device, self.seed),
            noise_scheduler=noise_scheduler, inference_scheduler=inference_scheduler,
            pipeline_config=pipeline_settings(cfg, self.pipeline_keys), reload_fp32=reload_fp32)
        check_models(models.transformer, models.vae, self.width(models.text_encoder), self.text_encoder_name)
        return models

    @classmethod
    def load_prompt_tokenizer(cls, src: str | None, kw: dict, what: str, length: int) -> llm_text.PromptTokenizer:
        """The pipeline's tokenizer with its template, ``length`` tokens per caption."""
        if src is None:
            raise ConfigError("the tokenizer has no source: set model.pretrained or model.tokenizer.pretrained")
        return llm_text.load_tokenizer(src, "tokenizer", what, cls.text_settings, length, **kw)

    @classmethod
    def width(cls, encoder) -> int:
        """Channels of the text states: the LLM's hidden size x the layers taken."""
        conf = getattr(encoder.config, "text_config", encoder.config)  # Mistral-3's language model
        return int(conf.hidden_size) * len(cls.text_settings.layers)

    @classmethod
    def refusals(cls, cfg: TrainConfig) -> list[tuple[bool, str]]:
        return [*llm_text_refusals(cfg, cls.display_name), patch_grid_refusal(cfg, cls.display_name)]

    @classmethod
    def text_limits(cls, cfg: TrainConfig) -> dict[str, tuple[int, str]]:
        return {"model.llm.max_length": (cls.text_settings.limit,
                                         f"{cls.pipeline_classes[0]}'s tokenizer_max_length")}

    @classmethod
    def text_length(cls, cfg: TrainConfig) -> int:
        """LLM tokens per caption, template included: ``model.llm.max_length``, else the pipeline's 512."""
        return int(cfg.model.llm.max_length or cls.text_settings.max_length)

    @classmethod
    def text_tokens(cls, cfg: TrainConfig) -> int:
        return cls.text_length(cfg)

    @classmethod
    def pixel_grid(cls, net_conf: dict, vae_factor: int) -> PixelGrid:
        return PixelGrid(vae_factor * 2, None, f"2x2 patches of the VAE's {vae_factor} px per latent")

    @classmethod
    def takes_guidance_embed(cls, net_conf: dict | None) -> bool | None:
        """FLUX.2 dev's transformer has a guidance embedding (``guidance_embeds``); klein's has none."""
        return None if net_conf is None else bool(net_conf.get("guidance_embeds", True))

    @classmethod
    def sample_activation_elements(cls, conf: dict, sample, checkpointing: bool) -> float:
        return activations.transformer_sample_elements(conf, sample, checkpointing,
                                                       latent_channels=FLUX2_LATENT_CHANNELS)

    # -- the text ------------------------------------------------------------------------------------
    @property
    def text_width(self) -> int:
        return self.width(self.models.text_encoder)

    @property
    def max_sequence_length(self) -> int:
        return int(self.models.tokenizer.max_length)

    @property
    def tokenizers(self):
        return (self.models.tokenizer,)

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.models.vae, self.models.text_encoder]

    def encode_condition(self, batch: dict, validation: bool) -> tuple[torch.Tensor, None]:
        """The LLM's chosen layers side by side per token, every padded token included (no mask)."""
        m = self.models
        cond = llm_text.encode_llm(m.text_encoder, batch["input_ids"].to(self.device, non_blocking=True),
                                   m.tokenizer.pad_token_id, self.text_settings)
        return cond.states, None

    def text_encoder_runs(self) -> list[tuple[torch.nn.Module, int, int]]:
        return [(self.models.text_encoder, self.max_sequence_length, 1)]

    @classmethod
    def text_encoding(cls, pipeline: str, device: torch.device, clip_skip: int = 0,
                      max_length: int | None = None) -> TextEncoding:
        """The LLM's states as :meth:`encode_condition` computes them (``max_length`` tokens, None: 512), in bf16."""
        if clip_skip:
            raise ValueError(f"{cls.display_name} conditions on chosen {cls.text_encoder_name} layers: clip skip does "
                             "not apply")
        length = llm_text.check_length(max_length, cls.text_settings, "--max-length", cls.display_name)
        tokenizer = cls.load_prompt_tokenizer(pipeline, {}, "the pipeline's tokenizer/", length)
        encoder = llm_text.load_llm(pipeline, "text_encoder", "the pipeline's text_encoder/", device)
        return llm_text.text_encoding(cls.text_tag, tokenizer, encoder, cls.text_settings)

    def stored_condition(self, batch: dict) -> tuple[torch.Tensor, None]:
        """The LLM states latent shards store (no pooled embedding)."""
        if POOLED_KEY in batch:
            raise ValueError(f"the batch has a stored pooled text embedding ({POOLED_KEY}): these latent shards were "
                             f"not made for {self.display_name} (scripts/precompute_latents.py with its pipeline)")
        return batch[TEXT_STATES_KEY].to(self.device, non_blocking=True).float(), None

    @classmethod
    def latent_vae(cls, pipeline: str, what: str, dtype: torch.dtype) -> torch.nn.Module:
        """The VAE latent shards are made with: the normalising view of ``AutoencoderKLFlux2``."""
        from diffusers import AutoencoderKLFlux2

        return NormalizedVAE(load_component(AutoencoderKLFlux2.from_pretrained, pipeline, "vae", what, torch_dtype=dtype))

    def stored_text(self) -> StoredText:
        return StoredText(self.max_sequence_length, self.text_width, 1, self.text_tag)

    # -- latents and the transformer's forward -------------------------------------------------------------
    def encode(self, pixels: torch.Tensor, mean: bool | None = None, sample_seeds=None) -> torch.Tensor:
        """The one VAE encode, of the posterior normalised as the pipeline does (:class:`NormalizedVAE`)."""
        mean = self.cfg.model.vae.latent_sampling == "mean" if mean is None else mean
        return vae_encoding.encode(NormalizedVAE(self.models.vae), pixels, 1.0, 0.0, mean=mean, sample_seeds=sample_seeds)

    def guidance(self, batch_size: int) -> torch.Tensor | None:
        if not self.net.config.guidance_embeds:
            return None
        return torch.full((batch_size,), float(self.cfg.model.guidance_embed), device=self.device, dtype=torch.float32)

    def transformer_inputs(self, latents: torch.Tensor, states: torch.Tensor, pooled: torch.Tensor | None) -> dict:
        return dict(encoder_hidden_states=states, txt_ids=text_ids(states), img_ids=image_ids(latents),
                    guidance=self.guidance(len(latents)))

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return tokens(latents)

    def unpack(self, out: torch.Tensor, latents_shape: torch.Size) -> torch.Tensor:
        return untokens(out, latents_shape)

    def transformer_timestep(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps / 1000  # sigma: the transformer multiplies by 1000

    def image_seq_len(self, latents: torch.Tensor) -> int:
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)

    # -- reference images (edit training: FlowFamily's join_references hook) -----------------------------------
    def join_references(self, latents: torch.Tensor, refs: list[torch.Tensor],
                        inputs: dict) -> tuple[torch.Tensor, dict]:
        """Each reference patchified and packed, in order, with ids (10 + 10k, row, column, 0) after the target's
        (``flux2_latents.reference_tokens``: the pipelines' ``prepare_image_latents``)."""
        ref_tokens, ref_ids = reference_tokens(refs)
        return ref_tokens, dict(inputs, img_ids=torch.cat([inputs["img_ids"], ref_ids], dim=1))

    def loss(self, model, batch, autocast, fixed=None, validation=False) -> LossOut:
        """FlowFamily's step (references joined by :meth:`join_references`), after checking that the batch has
        the references the run asks for: FLUX.2 takes 0 or more, so the shared step cannot tell a batch that
        lost them (latent shards made without references) from a text-to-image one."""
        want, have = int(self.cfg.dataset.params.references), batch_references(batch)
        if have != want:
            raise ValueError(f"dataset.params.references={want} but the batch has {have} reference image(s) "
                             "(reference_values, or reference_latents in latent shards): make the shards with the "
                             "references, or set dataset.params.references to what they hold")
        return super().loss(model, batch, autocast, fixed, validation)

    @classmethod
    def reference_call(cls, images: list) -> dict:
        """``image=[...]``: the prompt's references (at the sample's size: ``outputs.sample_references``), each
        raised to the pipeline's least 64 px a side where the sample size is smaller (:func:`sample_reference`);
        the pipeline then floors each side to 16 px and keeps a reference of at most 1024 x 1024 px as it is."""
        return {"image": [sample_reference(im) for im in images]}

    def validation_timesteps(self, n: int) -> torch.Tensor:
        """Spread over (0, 1000) (the resolution shift's table depends on the image size)."""
        return torch.arange(1, n + 1, dtype=torch.float32) * (self.num_timesteps / (n + 1))

    def flops_inputs(self, config, h: int, w: int) -> dict:
        """One sample's forward: the target's patches, each reference's (at the target's size), the text."""
        n = (h // 2) * (w // 2) * (1 + int(self.cfg.dataset.params.references))
        length = self.max_sequence_length
        return dict(hidden_states=torch.empty(1, n, config.in_channels, device="meta"),
                    encoder_hidden_states=torch.empty(1, length, config.joint_attention_dim, device="meta"),
                    timestep=torch.ones(1, device="meta"), img_ids=torch.zeros(n, 4, device="meta"),
                    txt_ids=torch.zeros(length, 4, device="meta"),
                    guidance=torch.ones(1, device="meta") if config.guidance_embeds else None)

    # -- artifacts ----------------------------------------------------------------------------------------
    @classmethod
    def pipeline_class(cls) -> type:
        """The diffusers pipeline class (``pipeline_classes[0]``)."""
        import diffusers

        return getattr(diffusers, cls.pipeline_classes[0])

    def pipeline(self, transformer: torch.nn.Module, for_export: bool = False):
        """The family's pipeline with ``transformer``; ``for_export``: the frozen parts in fp32 as loaded."""
        m = self.models
        parts: dict[str, Any] = {n: m.full_precision(n) if for_export else getattr(m, n) for n in ("vae", "text_encoder")}
        tokenizer = getattr(m.tokenizer, "tokenizer", m.tokenizer)  # the pipeline's own, not the template wrapper
        return self.pipeline_class()(scheduler=copy.deepcopy(m.inference_scheduler), tokenizer=tokenizer,
                                     transformer=unwrap(transformer), **parts, **m.pipeline_config)

    def sampling(self, settings: SampleSettings) -> SampleSettings:
        """A guidance-distilled transformer samples with the guidance it trained with (the pipeline's
        guidance_scale is the embedding's input); klein with the trainer's classifier-free guidance."""
        if self.net.config.guidance_embeds:
            return settings._replace(guidance=float(self.cfg.model.guidance_embed))
        return settings

    def component_sources(self) -> dict:
        from .components.transformer import component_sources

        return component_sources(self.cfg.model, ("transformer", "vae", "text_encoder"))
