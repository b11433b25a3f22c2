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

from . import reference_models as references
from .components import llm_text
from .flux2 import FLUX2_REFERENCE, FLUX2_SCHEDULER, TINY_FLUX2_TRANSFORMER, Flux2Family
from .flux2_latents import tiny_flux2_vae
from .tiny import save, tokenizer_folder


def dev_text_settings() -> llm_text.LLMTextSettings:
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return llm_text.LLMTextSettings(layers=(10, 20, 30), max_length=512, limit=512, system=SYSTEM_MESSAGE,
                                    content_parts=True, add_special_tokens=False, generation_prompt=False,
                                    strip=("[IMG]",))


# The tiny Mistral-3 language model: 30 layers (the pipeline reads hidden state 30) of 16 channels -> 48-wide
# text states (llm_text's tiny processor and Pixtral tower around it).
TINY_DEV_MISTRAL3 = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=30, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8)


class Flux2Dev(Flux2Family):
    name = text_tag = "flux2_dev"
    display_name = "FLUX.2 dev"
    pipeline_classes = ("Flux2Pipeline",)
    text_settings = dev_text_settings()
    text_encoder_name = "Mistral-3"
    # Reference images (the pipeline's image=[...]): optional; diffusers sets no limit, BFL recommends at most
    # 6 for FLUX.2 dev (docs.bfl.ml, "Image Editing": reference images per model; its API models take 8-10).
    reference_images = (0, 6)

    @classmethod
    def load_prompt_tokenizer(cls, src: str | None, kw: dict, what: str, length: int) -> llm_text.PromptTokenizer:
        """The pipeline's processor (``AutoProcessor``: its chat template takes typed content parts, and the
        exports keep it as the pipeline's tokenizer); ``llm_text.load_tokenizer`` reads a tokenizer only."""
        from transformers import AutoProcessor

        from ..config import ConfigError
        from ..loading import load_component

        if src is None:
            raise ConfigError("the tokenizer has no source: set model.pretrained or model.tokenizer.pretrained")
        return llm_text.PromptTokenizer(load_component(AutoProcessor.from_pretrained, src, "tokenizer", what, **kw),
                          cls.text_settings, length)

    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """A ``Flux2Pipeline``: llm_text's tiny Pixtral processor, a 30-layer tiny Mistral3ForConditionalGeneration, an
        8-channel AutoencoderKLFlux2, a tiny guidance-distilled transformer, FLUX.2's scheduler."""
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

        scratch = tokenizer_folder(out, "tokenizer")
        processor = llm_text.build_mistral3_processor(scratch)
        encoder = llm_text.tiny_mistral3(len(processor.tokenizer), **TINY_DEV_MISTRAL3)
        transformer = Flux2Transformer2DModel(**TINY_FLUX2_TRANSFORMER, guidance_embeds=True,
                                              joint_attention_dim=cls.width(encoder))
        pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
                             vae=tiny_flux2_vae(scaling_factor), text_encoder=encoder, tokenizer=processor,
                             transformer=transformer)
        return save(pipe, out, scratch)

    @classmethod
    def reference_models(cls) -> dict[str, references.ReferenceModel]:
        """FLUX.2 dev (32B) with Mistral Small 3.1, 512 text tokens, the 32-channel VAE."""
        dev = dict(FLUX2_REFERENCE, num_layers=8, num_single_layers=48, num_attention_heads=48,
                   joint_attention_dim=15360, guidance_embeds=True)
        return {"FLUX.2-dev": references.ReferenceModel(cls.net_class, dev, ("Mistral-Small-3.1",), 512,
                                                        references.VAE_FLUX2)}
