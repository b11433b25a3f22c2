"""A tiny Mistral-3 text encoder and its processor built offline, for FLUX.2 dev's tiny pipeline.

* :func:`build_mistral_processor`: a real ``PixtralProcessor`` (the class FLUX.2 dev's ``tokenizer/`` folder
  names) over a byte-level BPE tokenizer (the 256 byte symbols, so any caption tokenizes, and merges that spell
  a few hundred whole words) with Mistral's special tokens (``<s>``, ``</s>``, ``<pad>``, ``[INST]``,
  ``[SYSTEM_PROMPT]``, the image tokens the processor looks up) and a chat template that writes what Mistral
  Small 3.1's writes for text messages: ``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]``, the
  content given as a string or as typed text parts. Saved with ``save_pretrained``, loaded by
  ``AutoProcessor`` offline.
* :func:`tiny_mistral3`: a random-weight ``Mistral3ForConditionalGeneration`` (a tiny Mistral language model
  and a one-layer Pixtral vision tower) for it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .components.t5 import _WORDS

MISTRAL_SPECIAL = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                   "[IMG]", "[IMG_BREAK]", "[IMG_END]")
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}{%- endfor %}"
)
# 30 language-model layers (the pipeline reads hidden state 30) of 16 channels -> 48-wide text states.
TINY_MISTRAL3 = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=30, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8)


def _tokenizer():
    """The byte-level BPE (special tokens first, then the byte symbols, then the words' merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    from .components.clip import _bytes_to_unicode

    table = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(MISTRAL_SPECIAL)}
    for b in range(256):
        vocab[table[b]] = len(vocab)
    merges: list[tuple[str, str]] = []

    def merge(a: str, b: str) -> None:
        if a + b not in vocab:
            merges.append((a, b))
            vocab[a + b] = len(vocab)

    for word in dict.fromkeys(_WORDS):
        for i in range(1, len(word)):
            merge(word[:i], word[i])
        merge("\u0120", word)  # " word"
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL_SPECIAL])
    return tok


def write_mistral_processor(out_dir: str | os.PathLike, model_max_length: int = 1024) -> Path:
    """Write the tiny processor folder (tokenizer, image processor, chat template)."""
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>", model_max_length=model_max_length)
    processor = PixtralProcessor(image_processor=PixtralImageProcessor(patch_size=16, size={"longest_edge": 64}),
                                 tokenizer=fast, patch_size=16, spatial_merge_size=1,
                                 chat_template=MISTRAL_CHAT_TEMPLATE)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(str(out))
    return out


def build_mistral_processor(folder: str | os.PathLike):
    """The tiny processor, written to ``folder`` (if not there yet) and loaded from it."""
    from transformers import AutoProcessor

    if not (Path(folder) / "processor_config.json").exists():
        write_mistral_processor(folder)
    return AutoProcessor.from_pretrained(str(folder))


def tiny_mistral3(processor, **sizes):
    """A random-weight ``Mistral3ForConditionalGeneration`` (torch's RNG): a Mistral language model of
    ``sizes`` and a one-layer Pixtral vision tower of the same width."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    text = MistralConfig(vocab_size=len(processor.tokenizer), max_position_embeddings=1024, **sizes)
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=8, image_size=64, patch_size=16)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=processor.image_token_id,
                            spatial_merge_size=1, vision_feature_layer=-1)
    return Mistral3ForConditionalGeneration(config)


__all__ = ["MISTRAL_SPECIAL", "MISTRAL_CHAT_TEMPLATE", "TINY_MISTRAL3", "write_mistral_processor",
           "build_mistral_processor", "tiny_mistral3"]
