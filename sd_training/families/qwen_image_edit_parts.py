"""Qwen-Image-Edit's pieces as ``QwenImageEditPipeline`` makes them, beside Qwen-Image's (``qwen_image_parts``):
the edit prompt template, the reference image through Qwen2.5-VL's processor into the text encoder, the reference
latents after the target's tokens, and the tiny offline tokenizer / processor / Qwen2.5-VL of the tiny pipeline.

* The text: ``_get_qwen_prompt_embeds`` formats each instruction into :data:`EDIT_TEMPLATE` (a system prompt, then
  ``<|vision_start|><|image_pad|><|vision_end|>`` and the instruction as the user's message), the processor
  expands the one ``<|image_pad|>`` into one token per merged 2x2 patch of the image (``image_grid_thw``) and
  Qwen2.5-VL's vision tower fills those tokens; ``hidden_states[-1]``, the first 64 tokens (the system prompt)
  dropped: the image's tokens are conditioning. The family tokenizes the template in the data loader
  (``llm_text.PromptTokenizer``: one ``<|image_pad|>``) and :func:`expand_image_tokens` does the processor's
  expansion on the ids (a special token: expanding the text or the ids is the same).
* Plus (``QwenImageEditPlusPipeline``): :func:`plus_template`, the same system prompt with "Picture i: <image>"
  for each reference before the instruction; one ``<|image_pad|>`` per reference, each expanded by its own count.
* The reference latents: ``_encode_vae_image``'s normalised posterior mode, packed 2x2 (``_pack_latents``) and
  concatenated after the noisy target's tokens (``prepare_latents`` / the denoising loop); ``img_shapes`` lists
  the target's and the reference's patch grids; the prediction is the target's tokens (``noise_pred[:, :n]``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from . import qwen_image_parts as qparts

# QwenImageEditPipeline.__init__'s prompt_template_encode and prompt_template_encode_start_idx: the system
# prompt is 64 tokens of Qwen2.5-VL's tokenizer (the tiny tokenizer below spells it in 64 too).
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n"
                 "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
EDIT_PREFIX_TOKENS = 64
# QwenImageEditPlusPipeline's: the same system prompt, the pictures' markers written before the instruction
PLUS_TEMPLATE = EDIT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>{}", "{}")
IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
VISION_SPECIAL = (VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN)


# -- the reference images through the text encoder ------------------------------------------------------------
def plus_template(references: int) -> str:
    """``QwenImageEditPlusPipeline``'s text for ``references`` images: "Picture i: <image>" for each, then the
    instruction, in the same system prompt (``_get_qwen_prompt_embeds``' ``img_prompt_template``)."""
    pictures = "".join(f"Picture {i + 1}: {VISION_START}{IMAGE_TOKEN}{VISION_END}" for i in range(references))
    return PLUS_TEMPLATE.replace("{}", pictures + "{}")


def vision_inputs(image_processor, images: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The VL encoder's images (uint8 [3, H, W] tensors or PIL images, prompt by prompt) -> (pixel_values [patches,
    D], image_grid_thw [n, 3]) as the processor makes them (each on its 28-pixel grid within min/max pixels,
    rescaled, normalised)."""
    out = image_processor(images=[i.cpu() if isinstance(i, torch.Tensor) else i for i in images], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def image_token_count(grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Tokens each image takes in the text (``Qwen2VLProcessor.replace_image_token``: its patches / merge^2)."""
    return [int(g.prod()) // (merge_size ** 2) for g in grid_thw]


def expand_image_tokens(ids: torch.Tensor, image_token_id: int, counts: list[list[int]], pad: int) -> torch.Tensor:
    """Ids [B, T] holding ``len(counts[i])`` ``<|image_pad|>`` each -> each repeated ``counts[i][j]`` times (what the
    processor does to the text), rows padded on the right with ``pad`` to the longest."""
    rows = []
    for row, row_counts in zip(ids, counts):
        at = (row == image_token_id).nonzero().flatten().tolist()
        if len(at) != len(row_counts):
            raise ValueError(f"an edit prompt's ids hold {len(at)} image tokens, expected {len(row_counts)} (the "
                             "template's, one per reference)")
        pieces, start = [], 0
        for i, n in zip(at, row_counts):
            pieces += [row[start:i], row.new_full((n,), image_token_id)]
            start = i + 1
        rows.append(torch.cat([*pieces, row[start:]]))
    width = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, r.new_full((width - len(r),), pad)]) for r in rows])


def encode_with_image(encoder, ids: torch.Tensor, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                      pad_token_id: int, drop_prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expanded ids [B, T] (padding marked ``llm_text.PAD``) and the image -> (``hidden_states[-1]`` after the
    dropped prefix [B, T - drop, D] float32, the mask [B, T - drop] bool), called as ``_get_qwen_prompt_embeds``
    calls the encoder (ids, mask, pixel_values, image_grid_thw; frozen: no gradient)."""
    from .components.llm_text import PAD

    ids = ids.to(encoder.device)
    mask = ids != PAD
    with torch.no_grad():
        out = encoder(input_ids=ids.masked_fill(~mask, pad_token_id), attention_mask=mask.long(),
                      pixel_values=pixel_values.to(encoder.device), image_grid_thw=grid_thw.to(encoder.device),
                      output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1][:, drop_prefix:].float(), mask[:, drop_prefix:]


# -- the reference latents beside the target's ------------------------------------------------------------------
def reference_tokens(references: list[torch.Tensor]) -> torch.Tensor:
    """The references' 2x2 tokens in order (``prepare_latents``' ``image_latents``), what follows the target's."""
    return torch.cat([qparts.tokens(r) for r in references], dim=1)


def joint_tokens(noisy: torch.Tensor, references: list[torch.Tensor]) -> torch.Tensor:
    """The transformer's image input: the noisy target's 2x2 tokens, then each reference's (``torch.cat(
    [latents, image_latents], dim=1)``)."""
    return torch.cat([qparts.tokens(noisy), reference_tokens(references)], dim=1)


def joint_img_shapes(latents: torch.Tensor, references: list[torch.Tensor]) -> list:
    """``img_shapes``: per sample the target's frame of h/2 x w/2 patches, then each reference's."""
    shapes = [(1, x.shape[-2] // 2, x.shape[-1] // 2) for x in (latents, *references)]
    return [list(shapes)] * latents.shape[0]


def target_tokens(out: torch.Tensor, latents_shape: torch.Size) -> torch.Tensor:
    """The prediction for the target: its first h/2 * w/2 tokens (``noise_pred[:, : latents.size(1)]``), unpacked."""
    n = (latents_shape[-2] // 2) * (latents_shape[-1] // 2)
    return qparts.untokens(out[:, :n], latents_shape)


# -- the tiny pipeline's tokenizer, processor and Qwen2.5-VL -----------------------------------------------------
def template_words() -> list[str]:
    """Byte-level words that make the template's system prompt 64 tokens and its end 5, as Qwen2.5-VL's vocabulary
    spells them: the template's words with and without a leading space, and " (", "'s", ")," whole."""
    words = sorted(set(re.findall(r"[A-Za-z]+", EDIT_TEMPLATE)))
    return [s for w in words for s in (w, "\u0120" + w)] + ["\u0120(", "'s", "),"]


def build_edit_processor(folder: str | os.PathLike):
    """The tiny ``Qwen2VLProcessor`` (the class Qwen-Image-Edit's processor/ names): the tiny Qwen tokenizer with the
    template's words and the vision special tokens, and Qwen2-VL's image (and video) processor at its defaults
    (14 px patches, 2x2 merge, 56^2 .. 28^2 x 1280 pixels). Written to ``folder`` if not there yet, loaded from it."""
    from tokenizers import AddedToken
    from transformers import (AutoProcessor, AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor,
                              Qwen2VLVideoProcessor)

    folder = Path(folder)
    if not (folder / "tokenizer.json").exists():
        from .components.llm_tokenizers import write_qwen_tokenizer

        write_qwen_tokenizer(folder, 2048, qparts.QWEN25_VL_CHAT_TEMPLATE, template_words())
        tok = AutoTokenizer.from_pretrained(str(folder))
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_SPECIAL], special_tokens=True)
        tok.padding_side = "right"
        Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tok,
                         video_processor=Qwen2VLVideoProcessor(),
                         chat_template=qparts.QWEN25_VL_CHAT_TEMPLATE).save_pretrained(str(folder))
    return AutoProcessor.from_pretrained(str(folder))


def tiny_edit_qwen25_vl(tokenizer):
    """Qwen-Image's tiny Qwen2.5-VL (``qwen_image_parts.tiny_qwen25_vl``'s sizes) with the tokenizer's vision token
    ids, so its vision tower fills the image's tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = dict(vocab_size=len(tokenizer), bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    vision = {k: tokenizer.convert_tokens_to_ids(t) for k, t in (
        ("image_token_id", IMAGE_TOKEN), ("video_token_id", VIDEO_TOKEN), ("vision_start_token_id", VISION_START),
        ("vision_end_token_id", VISION_END))}
    config = Qwen2_5_VLConfig(text_config={**qparts.TINY_QWEN25_VL_TEXT, **ids},
                              vision_config=qparts.TINY_QWEN25_VL_VISION, **ids, **vision)
    return Qwen2_5_VLForConditionalGeneration(config).eval()
