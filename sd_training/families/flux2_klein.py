"""FLUX.2 klein: ``Flux2KleinPipeline``, a FLUX.2 transformer without a guidance embedding conditioned on
Qwen3 (``Qwen3ForCausalLM``).

As ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` conditions (``components.llm_text``): each caption as one
user message through the tokenizer's chat template (``add_generation_prompt=True, enable_thinking=False``),
padded to ``model.llm.max_length`` tokens (the pipeline's 512) and truncated, Qwen3 run with the attention
mask, the hidden states of layers 9, 18 and 27 side by side per token ([B, L, 3 x hidden]); every padded
token is conditioning (the transformer gets no mask). An empty caption (caption dropout) is ``""`` through
the template, as the pipeline encodes its negative prompt. Latents, ids, the loss: ``flux2.py``.

Samples: the klein base models sample with classifier-free guidance (the trainer's guidance scale); a
step-distilled klein (``is_distilled`` in model_index.json, kept in the exports) ignores it, as its pipeline
does.
"""

from __future__ import annotations

from pathlib import Path

from . import reference_models as references
from .components import llm_text
from .flux2 import FLUX2_REFERENCE, FLUX2_SCHEDULER, TINY_FLUX2_TRANSFORMER, Flux2Family
from .flux2_latents import tiny_flux2_vae
from .tiny import save, tokenizer_folder

# Flux2KleinPipeline's encode_prompt: the template's user message, layers 9, 18, 27, 512 tokens, no mask.
KLEIN_TEXT = llm_text.LLMTextSettings(layers=(9, 18, 27), max_length=512, limit=512, enable_thinking=False)
# The tiny Qwen3: 28 layers (the pipeline reads hidden state 27) of 16 channels -> 48-wide text states.
TINY_KLEIN_QWEN3 = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=28, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=8)


class Flux2Klein(Flux2Family):
    name = text_tag = "flux2_klein"
    display_name = "FLUX.2 klein"
    pipeline_classes = ("Flux2KleinPipeline",)
    text_settings = KLEIN_TEXT
    text_encoder_name = "Qwen3"
    pipeline_keys = ("is_distilled",)
    # Reference images (the pipeline's image=[...]): optional; diffusers sets no limit, BFL documents klein 4B
    # and 9B for up to 4 (docs.bfl.ml, "Image Editing": reference images per model).
    reference_images = (0, 4)

    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """A ``Flux2KleinPipeline``: the tiny Qwen tokenizer and a 28-layer tiny Qwen3ForCausalLM, an 8-channel
        AutoencoderKLFlux2, a tiny transformer without a guidance embedding, FLUX.2's scheduler."""
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel

        scratch = tokenizer_folder(out, "tokenizer")
        tokenizer = llm_text.build_qwen_tokenizer(scratch)
        encoder = llm_text.tiny_qwen3(len(tokenizer), causal_lm=True, **TINY_KLEIN_QWEN3)
        transformer = Flux2Transformer2DModel(**TINY_FLUX2_TRANSFORMER, guidance_embeds=False,
                                              joint_attention_dim=cls.width(encoder))
        pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
                                  vae=tiny_flux2_vae(scaling_factor), text_encoder=encoder, tokenizer=tokenizer,
                                  transformer=transformer)
        return save(pipe, out, scratch)

    @classmethod
    def reference_models(cls) -> dict[str, references.ReferenceModel]:
        """FLUX.2 klein 4B (Qwen3-4B) and 9B (Qwen3-8B), 512 text tokens, the 32-channel VAE."""
        four = dict(FLUX2_REFERENCE, num_layers=5, num_single_layers=20, num_attention_heads=24,
                    joint_attention_dim=7680, guidance_embeds=False)
        nine = dict(FLUX2_REFERENCE, num_layers=8, num_single_layers=24, num_attention_heads=32,
                    joint_attention_dim=12288, guidance_embeds=False)
        return {"FLUX.2-klein-4B": references.ReferenceModel(cls.net_class, four, ("Qwen3-4B",), 512, references.VAE_FLUX2),
                "FLUX.2-klein-9B": references.ReferenceModel(cls.net_class, nine, ("Qwen3-8B",), 512, references.VAE_FLUX2)}
