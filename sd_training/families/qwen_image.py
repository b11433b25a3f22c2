"""Qwen-Image: ``QwenImagePipeline``, a ``QwenImageTransformer2DModel`` (dual-stream MMDiT) trained with flow
matching on the latents of ``AutoencoderKLQwenImage``, conditioned on Qwen2.5-VL's last hidden states.

As ``QwenImagePipeline`` conditions (``_get_qwen_prompt_embeds`` / ``encode_prompt``; ``components.llm_text``):

* each caption in the pipeline's format string (a system prompt describing images, then the caption as the
  user's message; not the chat template), ``model.llm.max_length`` + 34 tokens (the pipeline tokenizes
  ``tokenizer_max_length`` + 34 and keeps ``max_sequence_length``: the LLM is causal, so cutting before or
  after it is the same), Qwen2.5-VL's ``hidden_states[-1]``, the template's first 34 tokens dropped;
* each sample's real tokens first, zero-padded to the batch's longest, with the mask
  (``encoder_hidden_states_mask``; None when all are real, as ``encode_prompt`` returns it); ``max_length`` is
  512 by default (the pipeline's and diffusers' example's ``max_sequence_length``), 1024 at most
  (``check_inputs``);
* an empty caption (caption dropout) is ``""`` through the template, as the example encodes it.

Latents, tokens and ``img_shapes`` are ``qwen_image_parts.py``'s (the per-channel normalised posterior, 2x2
patches, ``[[(1, h/2, w/2)]] * B``); the timestep is sigma (the pipeline passes ``t / 1000``). The loss is flow
matching (``flow_family.FlowFamily``) with the shift that grows with the image's token count (the scheduler's
``use_dynamic_shifting``) unless ``flow_matching`` sets another: diffusers' example trains on the unshifted
table. Latent shards store the LLM states in bf16 with the mask as one more channel. Exports and samples are
``QwenImagePipeline`` folders; LoRA exports load with its ``load_lora_weights``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..config import ConfigError
from ..config.schema import TrainConfig
from ..data.latent_checks import StoredText
from ..data.latents import TEXT_STATES_KEY
from ..outputs.comfy_lora import ComfyLoraNames, Rule
from ..outputs.export import unwrap
from ..speed.flops import StepFlops, count_net_flops, encoder_flops, height_width
from . import qwen_image_parts as parts
from . import reference_models as references
from .base import PixelGrid
from .components import llm_text
from .components.text import TextEncoding
from .components.transformer import (
    TrainedLength,
    build_transformer,
    component_sources,
    load_schedulers,
    load_vae_of,
    source,
)
from .components.unet import Components
from .flow_family import FlowFamily, llm_text_refusals, patch_grid_refusal
from .pipeline_family import is_latent_data
from .tiny import save, tokenizer_folder

# QwenImagePipeline._get_qwen_prompt_embeds: its format string, the last layer, 34 prefix tokens dropped, the
# real tokens with a mask; 512 tokens by default, tokenizer_max_length (1024) at most.
QWEN_IMAGE_TEXT = llm_text.LLMTextSettings(layers=(-1,), max_length=512, limit=1024, template=parts.PROMPT_TEMPLATE,
                                           drop_prefix=parts.PREFIX_TOKENS, masked=True)
# Qwen-Image's scheduler/scheduler_config.json: dynamic (exponential) shifting up to 8192 image tokens.
QWEN_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                            max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                            time_shift_type="exponential")
# model.adapter presets: the joint attention's projections (diffusers' example's to_q/k/v/out.0, + the text
# side's), + the image and text MLPs, every Linear layer of the blocks
_ATTENTION = r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
ADAPTER_PRESETS = {
    "attention": _ATTENTION,
    "attention_ffn": rf"{_ATTENTION}|transformer_blocks\.\d+\.(img|txt)_mlp\.net\.(0\.proj|2)",
    "all_linear": r"transformer_blocks\.\d+\..+",
}
# model.adapter.export_kohya: Qwen-Image's original layer names are diffusers' (ComfyUI's QwenImage model keeps
# them), under ComfyUI's diffusion_model. prefix, read back by _convert_non_diffusers_qwen_lora_to_diffusers
QWEN_IMAGE_COMFY = ComfyLoraNames(rules=(Rule(r".+", r"\g<0>"),), style="lora_A", alpha=True,
                                  reader="_convert_non_diffusers_qwen_lora_to_diffusers")


@dataclass
class QwenImageModels(Components):
    tokenizer: Any  # llm_text.PromptTokenizer: the pipeline's format string, max_length + 34 tokens
    text_encoder: torch.nn.Module  # Qwen2_5_VLForConditionalGeneration, frozen
    vae: torch.nn.Module  # qwen_image_parts.QwenLatentVAE: the frozen AutoencoderKLQwenImage (``.vae``) as 4-D latents
    transformer: torch.nn.Module  # QwenImageTransformer2DModel, trained
    noise_scheduler: Any
    inference_scheduler: Any
    reload_fp32: Optional[Callable[[str], torch.nn.Module]] = None
    _fp32_copies: dict = field(default_factory=dict, repr=False)


def hidden_size(encoder) -> int:
    return int(getattr(encoder.config, "text_config", encoder.config).hidden_size)


def load_prompt_tokenizer(src: str | None, kw: dict, what: str, length: int,
                          settings: llm_text.LLMTextSettings | None = None) -> llm_text.PromptTokenizer:
    """The pipeline's tokenizer with its template (``settings``, None: Qwen-Image's), ``length`` tokens after the
    prefix; padding on the right, so the prefix is the first positions (the pipeline finds the real tokens by the
    mask on either side)."""
    if src is None:
        raise ConfigError("Qwen-Image's tokenizer has no source: set model.pretrained or model.tokenizer.pretrained")
    tok = llm_text.load_tokenizer(src, "tokenizer", what, settings or QWEN_IMAGE_TEXT, length, **kw)
    tok.text_tokenizer.padding_side = "right"
    return tok


def load_text_encoder(cfg, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    src, kw = source(cfg, "text_encoder")
    if src is None:
        raise ConfigError("Qwen-Image's text encoder has no source: set model.pretrained or "
                          "model.text_encoder.pretrained")
    return llm_text.load_llm(src, "text_encoder", "model.text_encoder.pretrained", device, dtype, **kw)


def check_models(m: QwenImageModels) -> None:
    """The components fit together (a transformer of another size, another VAE ...)."""
    c, z = unwrap(m.transformer).config, m.vae.config.latent_channels
    problems = [
        (c.in_channels != 4 * z, f"in_channels {c.in_channels} != 4 x the VAE's z_dim {z} (2x2 patches)"),
        ((c.out_channels or c.in_channels) != z, f"out_channels {c.out_channels} != the VAE's z_dim {z}"),
        (c.joint_attention_dim != hidden_size(m.text_encoder),
         f"joint_attention_dim {c.joint_attention_dim} != Qwen2.5-VL's hidden_size {hidden_size(m.text_encoder)}"),
    ]
    for bad, message in problems:
        if bad:
            raise ConfigError(f"the Qwen-Image transformer does not fit the pipeline's other components: {message} "
                              "(model.transformer.params or model.transformer.pretrained)")


def _tie_text(module, args, output):
    text, image = output
    if not torch.is_grad_enabled():
        return output
    return text, image + text.reshape(-1)[0] * 0  # exactly the image (x + 0 = x); the text side now has a gradient


def tie_last_text_output(net: torch.nn.Module) -> None:
    """The last block's text-stream output feeds nothing (the transformer returns the image's), so its text
    MLP, output projection and their adapters would get no gradient, which DDP refuses (every trained parameter
    must have one each step) and gradient checks cannot compare. Tie it into the image's output with weight 0:
    the outputs are unchanged bit for bit and those parameters get zero gradients, as they would if used."""
    net.transformer_blocks[-1].register_forward_hook(_tie_text)


class GuidedByTrueCFG(TrainedLength):
    """:class:`TrainedLength` whose ``guidance_scale`` (> 1) becomes ``true_cfg_scale`` with the empty negative
    prompt (the transformer has no guidance embedding: the pipeline would ignore it and sample unguided)."""

    def __call__(self, *args, **kwargs):
        scale = kwargs.pop("guidance_scale", None)
        if scale is not None and scale > 1 and "negative_prompt" not in kwargs:
            prompt = kwargs.get("prompt")
            kwargs.update(true_cfg_scale=scale, negative_prompt=[""] * len(prompt) if isinstance(prompt, list) else "")
        return super().__call__(*args, **kwargs)


class QwenImage(FlowFamily):
    name = text_tag = "qwen_image"
    display_name = "Qwen-Image"
    pipeline_classes = ("QwenImagePipeline",)
    card_tags = ("qwen-image", "qwen-image-diffusers")
    net_class = "QwenImageTransformer2DModel"
    adapter_presets = ADAPTER_PRESETS
    comfy_lora_names = QWEN_IMAGE_COMFY
    text_settings = QWEN_IMAGE_TEXT  # how its encode_prompt formats and cuts the text (Qwen-Image-Edit: its own)

    def build_models(self) -> QwenImageModels:
        from diffusers import QwenImageTransformer2DModel

        cfg = self.cfg.model

        def reload_fp32(name: str) -> torch.nn.Module:
            if name == "vae":
                return parts.QwenLatentVAE(load_vae_of("AutoencoderKLQwenImage", cfg, None, torch.float32))
            return load_text_encoder(cfg, torch.device("cpu"), torch.float32)

        noise_scheduler, inference_scheduler = load_schedulers(cfg)
        models = QwenImageModels(
            tokenizer=load_prompt_tokenizer(*source(cfg, "tokenizer"), "model.tokenizer.pretrained",
                                            self.text_tokens(self.cfg), self.text_settings),
            text_encoder=load_text_encoder(cfg, self.text_device, llm_text.frozen_dtype(cfg.text_encoder.dtype,
                                                                                    cfg.mixed_precision)),
            vae=parts.QwenLatentVAE(load_vae_of("AutoencoderKLQwenImage", cfg, self.device)),
            transformer=build_transformer(cfg, QwenImageTransformer2DModel, self.net_device, self.seed),
            noise_scheduler=noise_scheduler, inference_scheduler=inference_scheduler, reload_fp32=reload_fp32)
        check_models(models)
        tie_last_text_output(unwrap(models.transformer))
        return models

    @classmethod
    def refusals(cls, cfg: TrainConfig) -> list[tuple[bool, str]]:
        return [*llm_text_refusals(cfg, cls.display_name), patch_grid_refusal(cfg, cls.display_name)]

    @classmethod
    def text_limits(cls, cfg: TrainConfig) -> dict[str, tuple[int, str]]:
        why = f"{cls.pipeline_classes[0]}'s tokenizer_max_length (max_sequence_length)"
        return {"model.llm.max_length": (cls.text_settings.limit, why)}

    @classmethod
    def text_tokens(cls, cfg: TrainConfig) -> int:
        """Text tokens per caption at most (after the prefix): ``model.llm.max_length``, else the pipeline's 512."""
        return int(cfg.model.llm.max_length or cls.text_settings.max_length)

    @classmethod
    def pixel_grid(cls, net_conf: dict, vae_factor: int) -> PixelGrid:
        patch = int(net_conf.get("patch_size") or 2)
        return PixelGrid(vae_factor * patch, None, f"{patch}x{patch} patches of the VAE's {vae_factor} px per latent")

    @classmethod
    def sample_activation_elements(cls, conf: dict, sample, checkpointing: bool) -> float:
        from ..memory import activations

        # in_channels (64) already holds the 2x2 patches packed (as Flux's); patch_size only sizes the output
        return activations.transformer_sample_elements({**conf, "patch_size": 1}, sample, checkpointing,
                                                       latent_channels=16)

    # -- the text ---------------------------------------------------------------------------------
    @property
    def max_sequence_length(self) -> int:
        return int(self.models.tokenizer.max_length)

    @property
    def tokenizers(self):
        return (self.models.tokenizer,)

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.models.vae, self.models.text_encoder]

    def condition(self, batch: dict, validation: bool = False):
        """(the real tokens first [B, n, D] float32, their mask [B, n] or None): stored in latent shards (the mask
        their last channel), else encoded. The mask rides in the (states, pooled) pair's second place."""
        if TEXT_STATES_KEY in batch:
            states, mask = llm_text.split_mask(batch[TEXT_STATES_KEY].to(self.device, non_blocking=True).float(), True)
        else:
            cond = llm_text.encode_llm(self.models.text_encoder, batch["input_ids"].to(self.device, non_blocking=True),
                                       self.models.tokenizer.pad_token_id, QWEN_IMAGE_TEXT)
            states, mask = cond.states, cond.mask
        return parts.front_padded(states, mask)

    def encode_condition(self, batch: dict, validation: bool):
        return self.condition({k: v for k, v in batch.items() if k != TEXT_STATES_KEY}, validation)

    def text_encoder_runs(self) -> list[tuple[torch.nn.Module, int, int]]:
        return [(self.models.text_encoder, self.models.tokenizer.model_max_length, 1)]

    @classmethod
    def text_encoding(cls, pipeline: str, device: torch.device, clip_skip: int = 0,
                      max_length: int | None = None) -> TextEncoding:
        """The LLM's states with their mask (``max_length`` tokens, None: 512), bf16 in shards."""
        if clip_skip:
            raise ValueError("Qwen-Image conditions on Qwen2.5-VL's last hidden states: clip skip does not apply")
        length = llm_text.check_length(max_length, QWEN_IMAGE_TEXT, "--max-length", "QwenImagePipeline")
        tokenizer = load_prompt_tokenizer(pipeline, {}, "the pipeline's tokenizer/", length)
        encoder = llm_text.load_llm(pipeline, "text_encoder", "the pipeline's text_encoder/", device)
        return llm_text.text_encoding(cls.text_tag, tokenizer, encoder, QWEN_IMAGE_TEXT)

    def stored_text(self) -> StoredText:
        width = llm_text.stored_width(hidden_size(self.models.text_encoder), self.text_settings)
        return StoredText(self.max_sequence_length, width, 1, self.text_tag)

    # -- latents and the transformer's forward ----------------------------------------------------
    @classmethod
    def latent_vae(cls, pipeline: str, what: str, dtype: torch.dtype) -> torch.nn.Module:
        """The VAE latent shards are made with: the normalising 4-D view of ``AutoencoderKLQwenImage``."""
        from diffusers import AutoencoderKLQwenImage

        from ..loading import load_component

        vae = load_component(AutoencoderKLQwenImage.from_pretrained, pipeline, "vae", what, torch_dtype=dtype)
        return parts.QwenLatentVAE(vae)

    def transformer_inputs(self, latents: torch.Tensor, states: torch.Tensor, mask: torch.Tensor | None) -> dict:
        return dict(encoder_hidden_states=states, encoder_hidden_states_mask=mask, img_shapes=parts.img_shapes(latents))

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return parts.tokens(latents)

    def unpack(self, out: torch.Tensor, latents_shape: torch.Size) -> torch.Tensor:
        return parts.untokens(out, latents_shape)

    def transformer_timestep(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps / 1000  # sigma, as the pipeline passes it

    def image_seq_len(self, latents: torch.Tensor) -> int:
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)

    def validation_timesteps(self, n: int) -> torch.Tensor:
        """Spread over (0, 1000) (the resolution shift's table depends on the image size)."""
        return torch.arange(1, n + 1, dtype=torch.float32) * (self.num_timesteps / (n + 1))

    def flops_inputs(self, config, h: int, w: int) -> dict:
        n, length = (h // 2) * (w // 2), self.max_sequence_length
        return dict(hidden_states=torch.empty(1, n, config.in_channels, device="meta"),
                    encoder_hidden_states=torch.empty(1, length, config.joint_attention_dim, device="meta"),
                    timestep=torch.ones(1, device="meta"), img_shapes=[[(1, h // 2, w // 2)]])

    def step_flops(self) -> StepFlops:
        """As ``FlowFamily.step_flops``, with the 3-D VAE's factor and encode of one frame."""
        m, cfg = self.models, self.cfg
        res = cfg.dataset.params.resolution
        factor = parts.vae_factor(m.vae.vae)
        h, w = (s // factor for s in height_width(res))
        latent = is_latent_data(cfg)
        text = 0 if not self.step_encodes_text_on_device else sum(k * encoder_flops(e, n) for e, n, k in self.text_encoder_runs())
        return count_net_flops(self.net, lambda meta: self.flops_inputs(meta.config, h, w),
                               cfg.model.gradient_checkpointing,
                               vae_encode=0 if latent else parts.vae_encode_flops(m.vae.vae, res), text_encode=text)

    def component_sources(self) -> dict:
        return component_sources(self.cfg.model, ("transformer", "vae", "text_encoder"))

    # -- artifacts --------------------------------------------------------------------------------
    def pipeline(self, transformer: torch.nn.Module, for_export: bool = False):
        """A QwenImagePipeline of the run's components with ``transformer``; ``for_export``: the frozen parts in
        fp32 as loaded."""
        from diffusers import QwenImagePipeline

        m = self.models
        vae, encoder = (m.full_precision(n) if for_export else getattr(m, n) for n in ("vae", "text_encoder"))
        return QwenImagePipeline(scheduler=copy.deepcopy(m.inference_scheduler), tokenizer=m.tokenizer.tokenizer,
                                 transformer=unwrap(transformer), vae=vae.vae, text_encoder=encoder)

    def inference_pipeline(self, net: torch.nn.Module):
        """The pipeline as sample grids and eval images call it: the trained text length, and their guidance
        scale as ``QwenImagePipeline``'s classifier-free guidance (``true_cfg_scale`` against the empty caption,
        what caption dropout trains; its ``guidance_scale`` feeds only guidance-distilled transformers)."""
        return GuidedByTrueCFG(self.pipeline(net), self.max_sequence_length)

    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """A ``QwenImagePipeline``: the tiny Qwen tokenizer (the template's prefix in 34 tokens) and
        Qwen2.5-VL, a 4-channel AutoencoderKLQwenImage with per-channel statistics, a tiny transformer,
        Qwen-Image's scheduler."""
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImagePipeline,
            QwenImageTransformer2DModel,
        )

        if scaling_factor is not None:
            raise ValueError("Qwen-Image's VAE normalises latents per channel (latents_mean / latents_std): it has no "
                             "scaling factor")
        scratch = tokenizer_folder(out, "tokenizer")
        tokenizer = parts.build_qwen_image_tokenizer(scratch)
        pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
                                 vae=AutoencoderKLQwenImage(**parts.TINY_QWEN_VAE),
                                 text_encoder=parts.tiny_qwen25_vl(tokenizer), tokenizer=tokenizer,
                                 transformer=QwenImageTransformer2DModel(**parts.TINY_QWEN_TRANSFORMER))
        return save(pipe, out, scratch)


    @classmethod
    def reference_models(cls) -> dict[str, references.ReferenceModel]:
        """Qwen-Image (20B: its transformer's config.json) with Qwen2.5-VL-7B, 512 tokens, its 3-D VAE."""
        conf = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                    num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
        vae = dict(_class_name="AutoencoderKLQwenImage", base_dim=96, z_dim=16)  # 16 latent channels
        return {"Qwen-Image": references.ReferenceModel(cls.net_class, conf, ("Qwen2.5-VL-7B",),
                                                        QWEN_IMAGE_TEXT.max_length, vae)}


__all__ = ["QWEN_IMAGE_TEXT", "QwenImage", "QwenImageModels"]
