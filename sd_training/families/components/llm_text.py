"""A decoder-only LLM as a text encoder: the families whose pipelines condition on an LLM's hidden states.

What each diffusers pipeline does in its ``encode_prompt`` (and what :class:`LLMTextSettings` says for it):

* ``ZImagePipeline._encode_prompt`` (Qwen3, ``Qwen3Model``): the prompt as one user message through the
  tokenizer's chat template (``add_generation_prompt=True, enable_thinking=True``), padded to
  ``max_sequence_length`` (512) and truncated, ``hidden_states[-2]``, then only the real tokens (a list of
  variable-length tensors): ``layers=(-2,)``, ``masked=True``.
* ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` (Qwen3, ``Qwen3ForCausalLM``): the same template with
  ``enable_thinking=False``, 512 tokens, ``hidden_states`` 9, 18 and 27 stacked per token and concatenated
  along the channels ([B, L, 3 D]); every padded token is conditioning: ``layers=(9, 18, 27)``,
  ``masked=False``.
* ``Flux2Pipeline._get_mistral_3_small_prompt_embeds`` (Mistral-3, an ``AutoProcessor``): a system message
  and the user's prompt as typed content parts (``[{"type": "text", ...}]``), tokenized by the chat template
  (``add_special_tokens=False``: the template writes the BOS; no generation prompt), ``[IMG]`` removed from
  prompts, layers 10, 20, 30: ``system=SYSTEM_MESSAGE``, ``content_parts=True``, ``add_special_tokens=False``,
  ``generation_prompt=False``, ``strip=("[IMG]",)``, ``layers=(10, 20, 30)``.
* ``QwenImagePipeline._get_qwen_prompt_embeds`` (Qwen2.5-VL): a format string with a system prompt (not the
  chat template), ``max_length + 34`` tokens, ``hidden_states[-1]``, the template's first 34 tokens dropped,
  real tokens only with a mask: ``template=<the string>``, ``drop_prefix=34``, ``layers=(-1,)``,
  ``masked=True``.

How it is wired:

* :class:`PromptTokenizer` is the tokenizer the data loader is given (``PipelineFamily.tokenizers``): it
  applies the template to each caption, pads to ``max_length`` (+ ``drop_prefix``) and truncates, as the
  pipeline does, and marks padding in the ids with :data:`PAD` (-1, no token's id), so the attention mask
  travels in the batch's ``input_ids`` exactly (a caption holding the pad token's text stays a real token).
  :func:`encode_llm` puts the tokenizer's pad id back before the LLM runs.
* :func:`encode_llm`: ids -> :class:`~.text.TextConditioning` (states [B, L, D] float32, the mask [B, L]
  where ``masked``): the chosen layers, the prefix dropped. The family turns it into its transformer's
  input (Z-Image: the list of real tokens, :func:`real_tokens`).
* Text dropout for guidance is the other families' ``dataset.params.caption_dropout``: a dropped caption is
  ``""``, encoded through the template as the pipelines encode their empty negative prompt (no zeroing).
* Latent shards store the states in bf16 (``TextEncoding(storage_dtype="bf16")``, :func:`text_encoding`);
  a masked family's shards hold the mask as one more channel, [L, D + 1] (0 / 1: exact in bf16), split
  again by :func:`split_mask` when the batch is read (the shards' fixed [L, D] layout needs no new member).
* Offline tokenizers: :func:`build_qwen_tokenizer`, a tiny real ``Qwen2Tokenizer`` (Qwen3's class) with a
  byte-level BPE of the ASCII bytes and a few hundred words, and a chat template like Qwen3's
  (``enable_thinking`` as the pipelines call it); :func:`build_mistral3_processor`, a tiny ``PixtralProcessor``
  (FLUX.2 dev's ``AutoProcessor``) with Mistral's control tokens and chat template (``llm_tokenizers``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ...config import ConfigError
from ...loading import load_component
from ...speed.precision import DTYPES
from .text import TextConditioning, TextEncoding

PAD = -1  # the id padding carries in the batches' input_ids (the attention mask); no token has it


@dataclass(frozen=True)
class LLMTextSettings:
    """How one pipeline's ``encode_prompt`` turns prompts into LLM states (see the module for each)."""

    layers: tuple[int, ...]  # hidden_states indices; several: stacked per token, concatenated on the channels
    max_length: int  # the pipeline's default max_sequence_length (tokens after the dropped prefix)
    limit: int  # the most tokens it takes (Family.text_limits)
    template: str = "chat"  # "chat": the tokenizer's chat template; else a format string with one {}
    system: str | None = None  # a system message before the user's (chat template)
    enable_thinking: bool | None = None  # passed to the chat template when set (Qwen3's)
    content_parts: bool = False  # message content as [{"type": "text", "text": ...}] (Mistral-3's processor)
    add_special_tokens: bool = True  # False where the template writes the BOS (apply_chat_template(tokenize=True))
    generation_prompt: bool = True  # the chat template's add_generation_prompt (FLUX.2 dev: False)
    drop_prefix: int = 0  # template tokens dropped from the front of the states (Qwen-Image's 34)
    masked: bool = False  # the conditioning is the real tokens only (a mask); False: every padded token
    strip: tuple[str, ...] = ()  # removed from prompts first (FLUX.2 dev's format_input removes "[IMG]")


# -- prompts and tokens ---------------------------------------------------------------------------
def render(tokenizer, prompt: str, s: LLMTextSettings) -> str:
    """The text the pipeline tokenizes for ``prompt``: its chat template or format string applied."""
    for text in s.strip:
        prompt = prompt.replace(text, "")
    if s.template != "chat":
        return s.template.format(prompt)
    content = [{"type": "text", "text": prompt}] if s.content_parts else prompt
    messages = [{"role": "user", "content": content}]
    if s.system is not None:
        system = [{"type": "text", "text": s.system}] if s.content_parts else s.system
        messages.insert(0, {"role": "system", "content": system})
    kwargs = {} if s.enable_thinking is None else {"enable_thinking": s.enable_thinking}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=s.generation_prompt, **kwargs)


class _Ids:
    def __init__(self, input_ids: torch.Tensor):
        self.input_ids = input_ids

    def __getitem__(self, key):
        return getattr(self, key)


class PromptTokenizer:
    """The pipeline's tokenizer with its template, as the data loader calls a tokenizer: captions in, ids
    [B, model_max_length] out, padding marked :data:`PAD` (see the module)."""

    def __init__(self, tokenizer, settings: LLMTextSettings, max_length: int | None = None):
        self.tokenizer, self.settings = tokenizer, settings
        # a processor (Mistral-3's) renders the template; its text tokenizer tokenizes
        self.text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        self.max_length = int(max_length or settings.max_length)
        self.model_max_length = self.max_length + settings.drop_prefix  # what is tokenized (prefix included)

    @property
    def pad_token_id(self) -> int:
        return int(self.text_tokenizer.pad_token_id)

    def __len__(self) -> int:
        return len(self.text_tokenizer)

    def __call__(self, captions, padding="max_length", truncation=True, max_length=None, return_tensors="pt",
                 **_ignored):
        """Ids of ``captions`` (a str or a list), each padded to ``max_length`` (None: ``model_max_length``) and
        truncated, as the pipelines tokenize (the other arguments are the loader's and always these)."""
        captions = [captions] if isinstance(captions, str) else list(captions)
        texts = [render(self.tokenizer, c, self.settings) for c in captions]
        enc = self.text_tokenizer(texts, padding="max_length", truncation=True,
                                  max_length=int(max_length or self.model_max_length),
                                  add_special_tokens=self.settings.add_special_tokens, return_tensors="pt")
        ids = enc["input_ids"].to(torch.long)
        return _Ids(ids.masked_fill(enc["attention_mask"] == 0, PAD))


# -- the encoder ----------------------------------------------------------------------------------
def encode_llm(encoder: torch.nn.Module, ids: torch.Tensor, pad_token_id: int,
               settings: LLMTextSettings) -> TextConditioning:
    """:class:`PromptTokenizer` ids [B, T] -> (states [B, T - drop_prefix, D x layers] float32, no pooled,
    the mask [B, L] bool where ``settings.masked``), as the pipeline's encode_prompt (frozen: no gradient)."""
    ids = ids.to(encoder.device)
    mask = ids != PAD
    with torch.no_grad():
        out = encoder(input_ids=ids.masked_fill(~mask, pad_token_id), attention_mask=mask.long(),
                      output_hidden_states=True, use_cache=False)
    layers = [out.hidden_states[k] for k in settings.layers]
    # [B, layers, L, D] -> [B, L, layers x D]: each token's layers side by side (FLUX.2's permute + reshape)
    states = torch.stack(layers, dim=2).flatten(2) if len(layers) > 1 else layers[0]
    states, mask = states[:, settings.drop_prefix:].float(), mask[:, settings.drop_prefix:]
    return TextConditioning(states, None, mask if settings.masked else None)


def real_tokens(states: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The real tokens of each sample (``states[i][mask[i]]``): Z-Image's list of variable-length states."""
    return [s[m] for s, m in zip(states, mask.to(states.device))]


def with_mask(cond: TextConditioning) -> torch.Tensor:
    """What latent shards store: the states, and for a masked conditioning the mask as a last channel."""
    if cond.mask is None:
        return cond.states
    return torch.cat([cond.states, cond.mask.unsqueeze(-1).to(cond.states.dtype)], dim=-1)


def split_mask(stored: torch.Tensor, masked: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`with_mask` undone: (states [B, L, D], mask [B, L] bool or None)."""
    if not masked:
        return stored, None
    return stored[..., :-1], stored[..., -1] > 0.5


def frozen_dtype(requested: str, mixed_precision: str) -> torch.dtype:
    """A frozen LLM's dtype: ``auto`` is bf16 under bf16 training, else fp32 (never fp16: LLM activations
    overflow it); an explicit ``model.text_encoder.dtype`` is kept."""
    if requested == "auto":
        return torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    return DTYPES[requested]


def _architecture(src: str, subfolder: str) -> str | None:
    """The transformers class a local component folder's config.json names (None: not found locally)."""
    for folder in (Path(src) / subfolder, Path(src)):
        conf = folder / "config.json"
        if conf.is_file():
            archs = json.loads(conf.read_text()).get("architectures") or []
            return archs[0] if archs else None
    return None


def load_llm(src: str, subfolder: str, what: str, device: torch.device | None = None,
             dtype: torch.dtype = torch.float32, **kwargs) -> torch.nn.Module:
    """The LLM of ``src`` (a pipeline root through ``subfolder``, or the component folder) as the class its
    config.json names (Qwen3Model, Qwen3ForCausalLM, Mistral3ForConditionalGeneration, ...; else
    AutoModel), frozen (eval, no grad) on ``device`` in ``dtype``."""
    import transformers

    name = _architecture(src, subfolder) if os.path.isdir(src) else None
    cls = getattr(transformers, name, None) if name else None
    if name and cls is None:
        raise ConfigError(f"'{what}': {src} names the class {name}, which this transformers does not have")
    encoder = load_component((cls or transformers.AutoModel).from_pretrained, src, subfolder, what, **kwargs)
    encoder.requires_grad_(False)
    encoder.eval()
    return encoder.to(device=device or torch.device("cpu"), dtype=dtype)


def load_tokenizer(src: str, subfolder: str, what: str, settings: LLMTextSettings, max_length: int | None = None,
                   **kwargs) -> PromptTokenizer:
    """The pipeline's tokenizer (``AutoTokenizer``; a processor where the folder holds one) with its template."""
    from transformers import AutoTokenizer

    tok = load_component(AutoTokenizer.from_pretrained, src, subfolder, what, **kwargs)
    return PromptTokenizer(tok, settings, max_length)


def check_length(max_length: int | None, settings: LLMTextSettings, key: str, who: str) -> int:
    """``max_length`` (None: the pipeline's default) within the pipeline's limit, else a ValueError naming ``key``."""
    n = int(max_length or settings.max_length)
    if n > settings.limit:
        raise ValueError(f"{key}: {who} takes at most {settings.limit} text tokens, got {n}")
    return n


def text_encoding(tag: str, tokenizer: PromptTokenizer, encoder: torch.nn.Module,
                  settings: LLMTextSettings) -> TextEncoding:
    """How latent shards store this LLM's conditioning: :func:`with_mask` of :func:`encode_llm`, in bf16."""

    def encode(encoders: Sequence[torch.nn.Module], ids: list[torch.Tensor]):
        return with_mask(encode_llm(encoders[0], ids[0], tokenizer.pad_token_id, settings)), None

    return TextEncoding(tag, [tokenizer], [encoder], encode, storage_dtype="bf16")


def stored_width(hidden_size: int, settings: LLMTextSettings) -> int:
    """Channels of the stored states: the layers side by side, + 1 for the mask of a masked family."""
    return hidden_size * len(settings.layers) + int(settings.masked)


from .llm_tokenizers import (  # noqa: E402 (re-exported)
    QWEN3_CHAT_TEMPLATE,
    TINY_QWEN3,
    build_mistral3_processor,
    build_qwen_tokenizer,
    tiny_mistral3,
    tiny_qwen3,
)

__all__ = ["PAD", "LLMTextSettings", "PromptTokenizer", "render", "encode_llm", "real_tokens", "with_mask",
           "split_mask", "frozen_dtype", "load_llm", "load_tokenizer", "check_length", "text_encoding",
           "stored_width", "QWEN3_CHAT_TEMPLATE", "TINY_QWEN3", "build_mistral3_processor", "tiny_mistral3",
           "build_qwen_tokenizer", "tiny_qwen3"]
