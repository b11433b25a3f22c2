"""FLUX.2 klein: ``Flux2KleinPipeline``, a FLUX.2 transformer without a guidance embedding conditioned on
Qwen3 (``Qwen3ForCausalLM``).

As ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` conditions (``components.llm_text``): each caption as one
user message through the tokenizer's chat template (``add_generation_prompt=True, enable_thinking=False``),
padded to ``max_sequence_length`` tokens (512) and truncated, Qwen3 run with the attention mask, the hidden
states of layers 9, 18 and 27 side by side per token ([B, L, 3 x hidden]); every padded token is
conditioning (the transformer gets no mask). An empty caption (caption dropout) is ``""`` through the
template, as the pipeline encodes its negative prompt. The latents, ids and the loss: ``flux2.py``.

Samples: the klein base models sample with classifier-free guidance (the trainer's guidance scale); a
step-distilled klein (``is_distilled`` in model_index.json) ignores it, as its pipeline does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..config import ConfigError
from ..config.schema import TrainConfig
from .components import llm_text
from .components.text import TextEncoding
from .components.transformer import build_transformer, load_schedulers, source
from .components.unet import Components
from .flux2 import (FLUX2_SCHEDULER, TINY_FLUX2_TRANSFORMER, TINY_FLUX2_VAE, Flux2Family, check_models,
                    frozen_flux2_vae, load_flux2_vae)
from .tiny import save, tokenizer_folder

# Flux2KleinPipeline's encode_prompt: the template's user message, layers 9, 18, 27, 512 tokens, no mask.
KLEIN_TEXT = llm_text.LLMTextSettings(layers=(9, 18, 27), max_length=512, limit=512, enable_thinking=False)
# The tiny Qwen3: 28 layers (the pipeline reads hidden state 27) of 16 channels -> 48-wide text states.
TINY_KLEIN_QWEN3 = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=28, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=8)


@dataclass
class Flux2KleinModels(Components):
    tokenizer: Any  # llm_text.PromptTokenizer over the pipeline's Qwen2 tokenizer
    text_encoder: torch.nn.Module  # Qwen3ForCausalLM, frozen: its hidden states
    vae: torch.nn.Module  # AutoencoderKLFlux2, frozen
    transformer: torch.nn.Module  # Flux2Transformer2DModel, trained
    noise_scheduler: Any
    inference_scheduler: Any
    is_distilled: bool = False  # model_index.json's (samples: no classifier-free guidance)
    reload_fp32: Optional[Callable[[str], torch.nn.Module]] = None
    _fp32_copies: dict = field(default_factory=dict, repr=False)


def pipeline_flag(cfg, key: str, default):
    """A value of the pipeline root's model_index.json (``default`` when there is none)."""
    path = os.path.join(cfg.pretrained or "", "model_index.json")
    if not cfg.pretrained or not os.path.isfile(path):
        return default
    with open(path, encoding="utf-8") as fh:
        return json.load(fh).get(key, default)


class Flux2Klein(Flux2Family):
    name = text_tag = "flux2_klein"
    display_name = "FLUX.2 klein"
    pipeline_classes = ("Flux2KleinPipeline",)
    text_settings = KLEIN_TEXT

    def build_models(self) -> Flux2KleinModels:
        cfg = self.cfg.model
        from diffusers import Flux2Transformer2DModel

        def load_text_encoder(device, dtype):
            src, kw = source(cfg, "text_encoder")
            if src is None:
                raise ConfigError("the text encoder has no source: set model.pretrained or model.text_encoder.pretrained")
            return llm_text.load_llm(src, "text_encoder", "model.text_encoder.pretrained", device, dtype, **kw)

        def reload_fp32(name: str) -> torch.nn.Module:
            if name == "vae":
                return load_flux2_vae(cfg, None, torch.float32)
            return load_text_encoder(torch.device("cpu"), torch.float32)

        tok_src, tok_kw = source(cfg, "tokenizer")
        tokenizer = llm_text.load_tokenizer(tok_src, "tokenizer", "model.tokenizer.pretrained", self.text_settings,
                                            self.text_length(self.cfg), **tok_kw)
        noise_scheduler, inference_scheduler = load_schedulers(cfg)
        models = Flux2KleinModels(
            tokenizer=tokenizer,
            text_encoder=load_text_encoder(self.device, llm_text.frozen_dtype(cfg.text_encoder.dtype, cfg.mixed_precision)),
            vae=frozen_flux2_vae(cfg, self.device),
            transformer=build_transformer(cfg, Flux2Transformer2DModel, self.device, self.seed),
            noise_scheduler=noise_scheduler, inference_scheduler=inference_scheduler,
            is_distilled=bool(pipeline_flag(cfg, "is_distilled", False)), reload_fp32=reload_fp32)
        check_models(models.transformer, models.vae, self._width(models.text_encoder), "Qwen3")
        return models

    # -- text -------------------------------------------------------------------------------------
    @classmethod
    def _width(cls, encoder) -> int:
        return int(encoder.config.hidden_size) * len(cls.text_settings.layers)

    @property
    def text_width(self) -> int:
        return self._width(self.models.text_encoder)

    @property
    def max_sequence_length(self) -> int:
        return int(self.models.tokenizer.max_length)

    @property
    def tokenizers(self):
        return (self.models.tokenizer,)

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.models.vae, self.models.text_encoder]

    def encode_condition(self, batch: dict, validation: bool) -> tuple[torch.Tensor, None]:
        m = self.models
        cond = llm_text.encode_llm(m.text_encoder, batch["input_ids"].to(self.device, non_blocking=True),
                                   m.tokenizer.pad_token_id, self.text_settings)
        return cond.states, None

    def text_encoder_runs(self) -> list[tuple[torch.nn.Module, int, int]]:
        return [(self.models.text_encoder, self.max_sequence_length, 1)]

    # -- artifacts --------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import Flux2KleinPipeline

        return Flux2KleinPipeline

    def pipeline_config(self) -> dict:
        return {"is_distilled": self.models.is_distilled}

    # -- with no run ------------------------------------------------------------------------------
    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """A ``Flux2KleinPipeline``: the tiny Qwen tokenizer and a 28-layer tiny Qwen3ForCausalLM, an 8-channel
        AutoencoderKLFlux2, a tiny transformer without a guidance embedding, FLUX.2's scheduler."""
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel

        if scaling_factor is not None:
            raise ValueError("FLUX.2's VAE normalises latents with its batch-norm statistics: no scaling factor")
        scratch = tokenizer_folder(out, "tokenizer")
        tokenizer = llm_text.build_qwen_tokenizer(scratch)
        encoder = llm_text.tiny_qwen3(len(tokenizer), causal_lm=True, **TINY_KLEIN_QWEN3)
        vae = AutoencoderKLFlux2(**TINY_FLUX2_VAE)
        # Running statistics that are not the identity, so the normalisation is exercised.
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
        transformer = Flux2Transformer2DModel(**TINY_FLUX2_TRANSFORMER, guidance_embeds=False,
                                              joint_attention_dim=cls._width(encoder))
        pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), vae=vae,
                                  text_encoder=encoder, tokenizer=tokenizer, transformer=transformer)
        return save(pipe, out, scratch)

    @classmethod
    def text_encoding(cls, pipeline: str, device: torch.device, clip_skip: int = 0,
                      max_length: int | None = None) -> TextEncoding:
        """Qwen3's states as :meth:`encode_condition` computes them (``max_length`` tokens, None: 512), in bf16."""
        if clip_skip:
            raise ValueError(f"{cls.display_name} conditions on chosen Qwen3 layers: clip skip does not apply")
        length = llm_text.check_length(max_length, cls.text_settings, "--max-length", cls.display_name)
        tokenizer = llm_text.load_tokenizer(pipeline, "tokenizer", "the pipeline's tokenizer/", cls.text_settings, length)
        encoder = llm_text.load_llm(pipeline, "text_encoder", "the pipeline's text_encoder/", device)
        return llm_text.text_encoding(cls.text_tag, tokenizer, encoder, cls.text_settings)
