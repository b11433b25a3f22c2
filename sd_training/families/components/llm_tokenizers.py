"""Tiny LLM tokenizers and text encoders built offline, for the tiny pipelines of the LLM families.

* :func:`build_qwen_tokenizer`: a real ``Qwen2Tokenizer`` (the class Qwen3's and Qwen2.5-VL's folders name)
  with Qwen's pre-tokenizer and byte-level BPE over a small vocabulary: the 256 byte symbols (so any
  caption tokenizes), merges that spell a few hundred whole words (T5's tiny word list) with and without a
  leading space, and Qwen's special tokens (``<|endoftext|>`` pads, ``<|im_start|>``, ``<|im_end|>``,
  ``<think>``, ``</think>``); its chat template writes what Qwen3's writes for plain text messages,
  ``enable_thinking=False`` adding the empty think block (Flux2KleinPipeline) and True or unset adding
  none (ZImagePipeline). Saved with ``save_pretrained``, loaded by ``AutoTokenizer`` offline.
* :func:`tiny_qwen3`: a random-weight ``Qwen3Model`` / ``Qwen3ForCausalLM`` of a few layers for it.
* :func:`build_mistral3_processor`: a ``PixtralProcessor`` (what ``AutoProcessor`` loads for Mistral-Small-3.x,
  FLUX.2 dev's tokenizer) around a byte-level BPE tokenizer with Mistral's control tokens at their ids
  (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``[INST]`` 3, ``[/INST]`` 4, ``[IMG]`` 10, ``<pad>`` 11, ``[IMG_BREAK]``
  12, ``[IMG_END]`` 13, ``[SYSTEM_PROMPT]`` 17, ``[/SYSTEM_PROMPT]`` 18; left padding as Mistral's) and a chat
  template writing what Mistral-Small-3.1's writes for a system and user messages of text parts;
  :func:`tiny_mistral3`: a random-weight ``Mistral3ForConditionalGeneration`` (tiny Mistral text model, tiny
  Pixtral vision tower) for it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .t5 import _WORDS

QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")

# Qwen3's template for messages of plain text (no tools), with its generation prompt and think switch.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# A tiny Qwen3 (Z-Image's and FLUX.2 klein's text encoder class) for tiny pipelines.
TINY_QWEN3 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)


def _byte_symbols() -> list[str]:
    """GPT-2's reversible byte -> printable-unicode table, in byte order (Qwen's byte-level BPE uses it)."""
    from .clip import _bytes_to_unicode

    table = _bytes_to_unicode()
    return [table[b] for b in range(256)]


def _vocab_and_merges(specials: tuple[str, ...] = QWEN_SPECIAL) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte symbols, then each word spelled by merges left to right, then ``Ġ`` (a leading space) + the word,
    then ``specials``."""
    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    def merge(a: str, b: str) -> None:
        if a + b not in vocab:
            merges.append((a, b))
            vocab[a + b] = len(vocab)

    for word in dict.fromkeys(_WORDS):
        for i in range(1, len(word)):
            merge(word[:i], word[i])
        merge("\u0120", word)  # " word": the space symbol, then the whole word
    for token in specials:
        vocab[token] = len(vocab)
    return vocab, merges


def whole_words(vocab: dict[str, int], merges: list[tuple[str, str]], words) -> None:
    """Append merges (at the lowest priority) that make each of ``words`` (byte-level symbols) one token: the
    pieces the merges so far leave are joined left to right, again until one is left (a merge added for one word
    cannot change one made before: BPE applies the lower-ranked merges first)."""
    from tokenizers.models import BPE

    for word in words:
        while True:
            pieces = [t.value for t in BPE(vocab=vocab, merges=merges).tokenize(word)]
            if len(pieces) == 1:
                break
            joined = pieces[0] + pieces[1]
            merges.append((pieces[0], pieces[1]))
            vocab.setdefault(joined, len(vocab))


def write_qwen_tokenizer(out_dir: str | os.PathLike, model_max_length: int = 1024,
                         chat_template: str = QWEN3_CHAT_TEMPLATE, words=()) -> Path:
    """Write the tiny Qwen tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``, chat template);
    ``words``: byte-level words made single tokens (:func:`whole_words`), as a large vocabulary has them."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _vocab_and_merges()
    whole_words(vocab, merges, words)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL], special_tokens=True)
    tok.chat_template = chat_template
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return out


def build_qwen_tokenizer(folder: str | os.PathLike, model_max_length: int = 1024,
                         chat_template: str = QWEN3_CHAT_TEMPLATE, words=()):
    """The tiny Qwen tokenizer (:func:`write_qwen_tokenizer`'s), written to ``folder`` (if not there yet) and
    loaded from it."""
    from transformers import AutoTokenizer

    if not (Path(folder) / "tokenizer.json").exists():
        write_qwen_tokenizer(folder, model_max_length, chat_template, words)
    return AutoTokenizer.from_pretrained(str(folder))


def tiny_qwen3(vocab_size: int, causal_lm: bool = False, **sizes):
    """A random-weight ``Qwen3Model`` (``causal_lm``: ``Qwen3ForCausalLM``) of :data:`TINY_QWEN3`'s sizes,
    ``sizes`` overriding them (torch's RNG)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(vocab_size=vocab_size, **{**TINY_QWEN3, **sizes})
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config)


MISTRAL_SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 10: "[IMG]", 11: "<pad>",
                   12: "[IMG_BREAK]", 13: "[IMG_END]", 17: "[SYSTEM_PROMPT]", 18: "[/SYSTEM_PROMPT]"}
MISTRAL_RESERVED = 20  # ids below this are control tokens (unused ones <SPECIAL_n>), as in Mistral's tekken vocabulary
# Mistral-Small-3.1's template for system / user / assistant messages whose content is a string or text parts
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = namespace(v='') %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{%- set text.v = text.v + part['text'] %}"
    "{%- elif part['type'] == 'image' %}{%- set text.v = text.v + '[IMG]' %}{%- endif %}{%- endfor %}"
    "{%- set text = text.v %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
TINY_MISTRAL3_TEXT = dict(model_type="mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                          rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None)
TINY_PIXTRAL = dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                    intermediate_size=32, image_size=32, patch_size=8, num_channels=3)


def write_mistral3_processor(out_dir: str | os.PathLike, model_max_length: int = 1024) -> Path:
    """Write the tiny Mistral-3 processor folder (tokenizer, image processor, chat template)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    vocab, merges = _vocab_and_merges(())
    control = {MISTRAL_SPECIAL.get(i, f"<SPECIAL_{i}>"): i for i in range(MISTRAL_RESERVED)}
    vocab = {**control, **{t: i + MISTRAL_RESERVED for t, i in vocab.items()}}
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", padding_side="left", model_max_length=model_max_length)
    tok.add_tokens(list(control), special_tokens=True)
    processor = PixtralProcessor(image_processor=PixtralImageProcessor(patch_size=TINY_PIXTRAL["patch_size"]),
                                 tokenizer=tok, patch_size=TINY_PIXTRAL["patch_size"], spatial_merge_size=2,
                                 chat_template=MISTRAL3_CHAT_TEMPLATE)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(str(out))
    return out


def build_mistral3_processor(folder: str | os.PathLike, model_max_length: int = 1024):
    """The tiny Mistral-3 processor, written to ``folder`` (if not there yet) and loaded with ``AutoProcessor``."""
    from transformers import AutoProcessor

    if not (Path(folder) / "tokenizer.json").exists():
        write_mistral3_processor(folder, model_max_length)
    return AutoProcessor.from_pretrained(str(folder))


def tiny_mistral3(vocab_size: int, **text_sizes):
    """A random-weight ``Mistral3ForConditionalGeneration``: :data:`TINY_MISTRAL3_TEXT` (``text_sizes``
    overriding it) and a tiny Pixtral vision tower (torch's RNG)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=11)
    config = Mistral3Config(text_config={**TINY_MISTRAL3_TEXT, **text_sizes, "vocab_size": vocab_size, **ids},
                            vision_config=TINY_PIXTRAL, image_token_index=10, spatial_merge_size=2,
                            vision_feature_layer=-1, **ids)
    return Mistral3ForConditionalGeneration(config)


__all__ = ["QWEN_SPECIAL", "QWEN3_CHAT_TEMPLATE", "TINY_QWEN3", "write_qwen_tokenizer", "build_qwen_tokenizer",
           "tiny_qwen3", "MISTRAL3_CHAT_TEMPLATE", "write_mistral3_processor", "build_mistral3_processor",
           "tiny_mistral3"]
