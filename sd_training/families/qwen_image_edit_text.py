"""Qwen-Image-Edit's text states, read with the reference images: one function for the step's online encode and
for the states latent shards store (``scripts/precompute_latents.py --references N --text-embeddings``), so a run
from latent shards conditions on exactly what a run from the image shards computes.

The text depends on the references' pixels (Qwen2.5-VL reads the instruction with them), so the shards store it
per sample, made from the references as the loader gives them to the step (``dataset.params.reference_crop``, at
the target's size), each brought to the VL encoder by the family's rule (:data:`VL_RULES`). ``latents_info.json``
records the rule and the reference count (``text_references``, ``text_vl_images``), and a run whose family reads
another rule or count refuses the shards (``data.latent_checks.check_latents_match``). Stored states are padded to one
length for the whole folder, the longest any of its sizes gives (:func:`stored_length`: the instruction's tokens
and each reference's VL tokens); the mask rides as a last channel (``llm_text.with_mask``) and the step keeps the
real tokens only (``front_padded``), so the padding changes nothing.

Caption dropout: the empty instruction's states are image-conditioned too (the pipeline encodes its negative
prompt with the image), so the shards hold each sample's own ``KEY.empty.text.npy`` (the empty instruction read
with that sample's references) instead of one ``empty.text.npy``: a dropped caption trains exactly as online.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from . import qwen_image_edit_parts as eparts
from .components import llm_text
from .components.text import TextEncoding
from .qwen_image import hidden_size

# latents_info.json's text_vl_images: how each family brings a reference to its VL encoder
TARGET_SIZE = "the reference at the target's size"  # Qwen-Image-Edit: the one image its VAE reads too
CONDITION_SIZE = "the reference at ~384x384 of its aspect ratio (CONDITION_IMAGE_SIZE, Lanczos)"  # Plus


def edit_vl_images(refs: torch.Tensor, vae_factor: int) -> list:
    """Qwen-Image-Edit's VL images, prompt by prompt: each reference (uint8 [B, R, 3, H, W]) as the loader made it."""
    return [r for sample in refs for r in sample]


def plus_vl_images(refs: torch.Tensor, vae_factor: int) -> list:
    """Qwen-Image-Edit-Plus's: each reference brought to ~384^2 of its aspect ratio as the pipeline does it
    (``calculate_dimensions(CONDITION_IMAGE_SIZE, ratio)``, ``VaeImageProcessor.resize``: PIL, Lanczos)."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    from PIL import Image

    resizer = VaeImageProcessor(vae_scale_factor=vae_factor * 2)
    out = []
    for r in (r for sample in refs for r in sample):
        image = Image.fromarray(r.permute(1, 2, 0).cpu().numpy())
        width, height = plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE, image.width / image.height)
        out.append(resizer.resize(image, height, width))
    return out


VL_RULES: dict[str, Callable[[torch.Tensor, int], list]] = {TARGET_SIZE: edit_vl_images, CONDITION_SIZE: plus_vl_images}


def encode_with_references(encoder, processor, pad_token_id: int, ids: torch.Tensor, refs: torch.Tensor,
                           vl_rule: str, vae_factor: int, drop_prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Template ids [B, T] (one ``<|image_pad|>`` per reference) and the references uint8 [B, R, 3, H, W] ->
    (states [B, n, D] float32, mask [B, n] bool), as ``encode_prompt(prompt, image=...)``: the VL images by
    ``vl_rule``, the image tokens expanded to each image's count, the encoder's last layer, the prefix dropped."""
    b, k = refs.shape[:2]
    pixel_values, grid = eparts.vision_inputs(processor.image_processor, VL_RULES[vl_rule](refs, vae_factor))
    counts = eparts.image_token_count(grid, processor.image_processor.merge_size)
    ids = eparts.expand_image_tokens(ids, processor.image_token_id, [counts[i * k:(i + 1) * k] for i in range(b)],
                                     llm_text.PAD)
    return eparts.encode_with_image(encoder, ids, pixel_values, grid, pad_token_id, drop_prefix)


def stored_length(processor, vl_rule: str, vae_factor: int, references: int, max_length: int,
                  sizes: Sequence[tuple[int, int]]) -> int:
    """Tokens of the stored states: the instruction's ``max_length`` plus the references' VL tokens (each image's
    count less its one placeholder), at the largest of ``sizes`` ((width, height) of the targets: the square
    resolution, or each aspect bucket)."""
    most = 0
    for width, height in sizes:
        blank = torch.zeros(1, references, 3, height, width, dtype=torch.uint8)
        _, grid = eparts.vision_inputs(processor.image_processor, VL_RULES[vl_rule](blank, vae_factor))
        most = max(most, sum(eparts.image_token_count(grid, processor.image_processor.merge_size)) - references)
    return max_length + most


class EditTextEncoding(TextEncoding):
    """What the shards store for an edit family: each caption read with its sample's references
    (:meth:`encode`'s ``references``, the loader's uint8 [B, R, 3, H, W]), the mask as a last channel, padded to
    ``length`` tokens; bf16 by default, as Qwen-Image's."""

    image_conditioned = True  # the precompute passes each batch's references and stores per-sample empty captions

    def __init__(self, tag: str, tokenizer, encoder, processor, settings: llm_text.LLMTextSettings,
                 vl_rule: str, references: int, length: int, vae_factor: int):
        super().__init__(tag, [tokenizer], [encoder], None, storage_dtype="bf16")
        self.processor, self.settings, self.vl_rule = processor, settings, vl_rule
        self.references, self.length, self.vae_factor = references, length, vae_factor

    @property
    def text_shape(self) -> tuple[int, int]:
        return self.length, llm_text.stored_width(hidden_size(self.encoders[0]), self.settings)

    @torch.no_grad()
    def encode(self, captions: list[str], references: torch.Tensor | None = None) -> tuple[np.ndarray, None]:
        if references is None or references.shape[1] != self.references:
            raise ValueError(f"{self.tag}'s text reads each caption with its {self.references} reference image(s): "
                             "pass them (the loader's reference_values)")
        tok = self.tokenizers[0]
        ids = tok(captions, padding="max_length", truncation=True, max_length=tok.model_max_length,
                  return_tensors="pt").input_ids
        states, mask = encode_with_references(self.encoders[0], self.processor, tok.pad_token_id, ids, references,
                                              self.vl_rule, self.vae_factor, self.settings.drop_prefix)
        stored = llm_text.with_mask(llm_text.TextConditioning(states, None, mask)).float().cpu()
        if stored.shape[1] > self.length:
            raise ValueError(f"{stored.shape[1]} text tokens, more than the folder's {self.length}: a reference "
                             "larger than the run's sizes")
        pad = stored.new_zeros(stored.shape[0], self.length - stored.shape[1], stored.shape[2])  # mask 0: dropped
        return torch.cat([stored, pad], dim=1).numpy(), None


__all__ = ["TARGET_SIZE", "CONDITION_SIZE", "VL_RULES", "EditTextEncoding", "encode_with_references",
           "stored_length"]
