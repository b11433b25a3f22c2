"""FLUX.2 dev: ``Flux2Pipeline``, a guidance-distilled FLUX.2 transformer conditioned on Mistral-3
(``Mistral3ForConditionalGeneration``, Mistral Small 3.1) through its processor (``PixtralProcessor``).

As ``Flux2Pipeline._get_mistral_3_small_prompt_embeds`` conditions (``components.llm_text``): each caption,
``[IMG]`` removed (its ``format_input``), as a user message after the pipeline's system message, both as typed
text parts, through the processor's chat template without a generation prompt (the template writes the BOS),
padded to ``model.llm.max_length`` tokens (the pipeline's 512) and truncated; Mistral-3 run with the attention
mask, the hidden states of layers 10, 20 and 30 side by side per token; every padded token is conditioning.
An empty caption (caption dropout) is ``""`` through the template. The transformer's guidance embedding gets
``model.guidance_embed`` in training and samples (the pipeline's guidance_scale is that embedding's input).
Latents, ids, the loss: ``flux2.py``.
"""

from __future__ import annotations

from pathlib import Path

from .components import llm_text
from .flux2 import FLUX2_SCHEDULER, TINY_FLUX2_TRANSFORMER, Flux2Family
from .flux2_latents import tiny_flux2_vae
from .flux2_processor import TINY_MISTRAL3, build_mistral_processor, tiny_mistral3
from .tiny import save, tokenizer_folder


def dev_text_settings() -> llm_text.LLMTextSettings:
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return llm_text.LLMTextSettings(layers=(10, 20, 30), max_length=512, limit=512, system=SYSTEM_MESSAGE,
                                    content_parts=True, add_special_tokens=False, generation_prompt=False)


class DevPrompts(llm_text.PromptTokenizer):
    """The processor with the pipeline's template; captions lose ``[IMG]`` first, as ``format_input`` drops it
    (the processor would count it as an image placeholder)."""

    def __call__(self, captions, *args, **kwargs):
        captions = [captions] if isinstance(captions, str) else list(captions)
        return super().__call__([c.replace("[IMG]", "") for c in captions], *args, **kwargs)


class Flux2Dev(Flux2Family):
    name = text_tag = "flux2_dev"
    display_name = "FLUX.2 dev"
    pipeline_classes = ("Flux2Pipeline",)
    text_settings = dev_text_settings()
    text_encoder_name = "Mistral-3"

    @classmethod
    def load_prompt_tokenizer(cls, src: str | None, kw: dict, what: str, length: int) -> llm_text.PromptTokenizer:
        """The pipeline's processor (``AutoProcessor``: its chat template takes typed content parts)."""
        from transformers import AutoProcessor

        from ..config import ConfigError
        from ..loading import load_component

        if src is None:
            raise ConfigError("the tokenizer has no source: set model.pretrained or model.tokenizer.pretrained")
        return DevPrompts(load_component(AutoProcessor.from_pretrained, src, "tokenizer", what, **kw),
                          cls.text_settings, length)

    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """A ``Flux2Pipeline``: a tiny Pixtral processor and a 30-layer tiny Mistral3ForConditionalGeneration, an
        8-channel AutoencoderKLFlux2, a tiny guidance-distilled transformer, FLUX.2's scheduler."""
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

        scratch = tokenizer_folder(out, "tokenizer")
        processor = build_mistral_processor(scratch)
        encoder = tiny_mistral3(processor, **TINY_MISTRAL3)
        transformer = Flux2Transformer2DModel(**TINY_FLUX2_TRANSFORMER, guidance_embeds=True,
                                              joint_attention_dim=cls.width(encoder))
        pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
                             vae=tiny_flux2_vae(scaling_factor), text_encoder=encoder, tokenizer=processor,
                             transformer=transformer)
        return save(pipe, out, scratch)
