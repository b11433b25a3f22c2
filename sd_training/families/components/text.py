"""The shape every text encoder gives a family, whatever the encoder (CLIP, T5, and the decoder-only LLM
encoders later families add beside them): token ids of each tokenizer in, :class:`TextConditioning` out.

* ``TextConditioning(states, pooled, mask)``: the tokens the denoiser attends to ([B, L, D] float32), the
  pooled embedding ([B, P] float32, None where the family has none) and the attention mask ([B, L] bool,
  True for real tokens; None: every token counts, as for CLIP and T5 padded to a fixed length);
* an encoder function ``encode_ids(encoders, ids) -> (states, pooled[, mask])`` per family composes its
  encoders (``clip.encode_text``, ``t5.encode_t5``, SDXL's / SD3's / Flux's ``encode_prompts``);
* :class:`TextEncoding` binds the tokenizers and encoders of a pipeline folder to that function: captions
  in, conditioning out (latent shards store it: ``scripts/precompute_latents.py --text-embeddings``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch


class TextConditioning(NamedTuple):
    states: torch.Tensor  # [B, L, D] float32: the text tokens the denoiser attends to
    pooled: torch.Tensor | None  # [B, P] float32; None: the family conditions on no pooled embedding
    mask: torch.Tensor | None = None  # [B, L] bool, True for real tokens; None: every token counts


def grad_if_trained(module: torch.nn.Module):
    """The grad mode a text encoder runs in: gradients flow into it only when it has trainable parameters
    (``model.text_encoder.train``, or a LoRA on it); a frozen encoder builds no graph."""
    return torch.set_grad_enabled(torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()))


class TextEncoding:
    """How a family's captions become the text conditioning latent shards store
    (``scripts/precompute_latents.py --text-embeddings``): the tensors its training computes online.

    ``encode_ids(encoders, ids)``: the family's own conditioning from each tokenizer's ids, (states,
    pooled) or a :class:`TextConditioning`. :meth:`conditioning` gives it for captions; :meth:`encode` as
    float32 numpy, the shards' ``text.npy`` and ``pooled.npy`` members (``data/latents.py``). ``tag`` is
    what ``latents_info.json`` records as ``text_family`` (``PipelineFamily.text_tag``), so a run of another
    family refuses them. ``storage_dtype``: how the shards store the text arrays by default
    (``--text-dtype auto``): ``bf16`` for large states (T5's), None for the script's ``--dtype``."""

    def __init__(self, tag: str | None, tokenizers: Sequence, encoders: Sequence[torch.nn.Module],
                 encode_ids: Callable[[Sequence[torch.nn.Module], list[torch.Tensor]], tuple],
                 storage_dtype: str | None = None):
        self.tag, self.tokenizers, self.encoders, self._encode_ids = tag, list(tokenizers), list(encoders), encode_ids
        self.storage_dtype = storage_dtype

    @property
    def max_length(self) -> int:
        """Tokens per caption of the first tokenizer."""
        return int(self.tokenizers[0].model_max_length)

    @torch.no_grad()
    def conditioning(self, captions: list[str]) -> TextConditioning:
        """The captions' conditioning on the encoders' device, each tokenizer padding to its own length."""
        device = next(self.encoders[0].parameters()).device
        ids = [tok(captions, padding="max_length", truncation=True, max_length=tok.model_max_length,
                   return_tensors="pt").input_ids.to(device) for tok in self.tokenizers]
        return TextConditioning(*self._encode_ids(self.encoders, ids))

    def encode(self, captions: list[str]) -> tuple[np.ndarray, np.ndarray | None]:
        """(states, pooled or None) as float32 numpy: what latent shards store. Shards have no mask field: a
        family whose conditioning has a mask folds it into its states (``llm_text.with_mask``, a last channel)."""
        out = self.conditioning(captions)
        if out.mask is not None:
            raise NotImplementedError("latent shards store no attention mask: fold it into the states (llm_text.with_mask) "
                                      "to store this family's text")
        pooled = None if out.pooled is None else out.pooled.float().cpu().numpy()
        return out.states.float().cpu().numpy(), pooled


__all__ = ["TextConditioning", "TextEncoding", "grad_if_trained"]
