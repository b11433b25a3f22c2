"""The T5 text encoder shared by the transformer families (SD3's ``text_encoder_3``, Flux's ``text_encoder_2``).

* A tiny T5 tokenizer built offline (no sentencepiece, no hub): a Unigram model of the ``tokenizers``
  library with T5's layout (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, Metaspace pre-tokenizer, ``</s>``
  appended), saved as ``tokenizer.json`` so ``T5TokenizerFast.from_pretrained(folder)`` loads it offline.
  Its pieces are the ASCII characters (so any caption tokenizes) and a few hundred whole words.
* Loading a ``T5EncoderModel`` and its tokenizer from a pipeline root or a component folder, frozen on the
  device in the run's frozen dtype (T5 overflows in fp16: ``auto`` never picks fp16 for it).
* :func:`encode_t5`: token ids -> the last hidden states, float32, as the pipelines' ``_get_t5_prompt_embeds``.
"""

from __future__ import annotations

import math
import os
import string
from pathlib import Path

import torch

from ...loading import load_component
from ...speed.precision import DTYPES

# A tiny T5 encoder for tiny pipelines: 128 channels (wider than the two tiny CLIPs' 64 + 64 states that
# SD3 pads to T5's width), 2 layers.
TINY_T5 = dict(d_model=128, d_kv=16, d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=8,
               relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
               feed_forward_proj="gated-gelu", is_encoder_decoder=True, pad_token_id=0, eos_token_id=1,
               decoder_start_token_id=0)

_WORDS = """a an the of and or with without in on at to from by for over under near behind above below
photo picture image painting drawing render sketch portrait close up view scene background foreground
red green blue yellow orange purple pink brown black white gray grey cyan magenta gold silver dark light
bright pale small large big tiny huge round square circle triangle diamond star shape shapes line lines
cat dog bird horse cow fish man woman person people child face hand tree trees flower flowers grass sky
cloud clouds sun moon water sea ocean river lake mountain mountains hill road street city house building
car boat train plane table chair room wall window door floor snow rain night day morning evening
beautiful old new young high low style art digital oil watercolor realistic detailed simple one two three
is are has have this that it its his her their there""".split()


def _vocab() -> list[tuple[str, float]]:
    """T5's layout: pad, eos, unk, then the pieces (log-probability scores: longer pieces score higher
    per character, so whole words win over spelling them out)."""
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces += [(c, -8.0) for c in chars] + [("\u2581" + c, -7.0) for c in chars]
    seen = {p for p, _ in pieces}
    for word in dict.fromkeys(_WORDS):
        piece = "\u2581" + word
        if piece not in seen:
            pieces.append((piece, -5.0 - math.log(len(word))))
            seen.add(piece)
    return pieces


def write_t5_tokenizer(out_dir: str | os.PathLike, model_max_length: int = 512) -> Path:
    """Write a T5 tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``) to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import T5TokenizerFast

    vocab = _vocab()
    tok = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
    ])
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"],
                                                       special_tokens=[("</s>", 1)])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0,
                           model_max_length=model_max_length)
    fast.save_pretrained(str(out))
    return out


def build_t5_tokenizer(folder: str | os.PathLike, model_max_length: int = 512):
    """The tiny T5 tokenizer, written to ``folder`` (if not there yet) and loaded from it."""
    from transformers import T5TokenizerFast

    if not (Path(folder) / "tokenizer.json").exists():
        write_t5_tokenizer(folder, model_max_length)
    return T5TokenizerFast.from_pretrained(str(folder))


def tiny_t5_encoder(vocab_size: int):
    """A random-weight ``T5EncoderModel`` of :data:`TINY_T5`'s sizes (torch's RNG)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab_size, **TINY_T5))


def t5_frozen_dtype(requested: str, mixed_precision: str) -> torch.dtype:
    """The dtype a frozen T5 is stored in: ``auto`` is bf16 under bf16 training, else fp32 (T5's activations
    overflow fp16); an explicit ``model.text_encoder.dtype`` is kept."""
    if requested == "auto":
        return torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    return DTYPES[requested]


def load_t5_tokenizer(src: str, subfolder: str, what: str, max_length: int, **kwargs):
    """The T5 tokenizer of ``src`` (a pipeline root through ``subfolder``, or the folder itself), padding
    and truncating to ``max_length`` tokens."""
    from transformers import T5TokenizerFast

    tokenizer = load_component(T5TokenizerFast.from_pretrained, src, subfolder, what, **kwargs)
    tokenizer.model_max_length = int(max_length)
    return tokenizer


def load_t5_encoder(src: str, subfolder: str, what: str, device: torch.device | None = None,
                    dtype: torch.dtype = torch.float32, **kwargs) -> torch.nn.Module:
    """The ``T5EncoderModel`` of ``src``, frozen (eval, no grad) on ``device`` in ``dtype`` (None: the CPU)."""
    from transformers import T5EncoderModel

    encoder = load_component(T5EncoderModel.from_pretrained, src, subfolder, what, **kwargs)
    return frozen_t5(encoder, device or torch.device("cpu"), dtype)


def frozen_t5(encoder: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    encoder.requires_grad_(False)
    encoder.eval()
    return encoder.to(device=device, dtype=dtype)


def encode_t5(encoder: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Token ids [B, L] -> T5's last hidden states [B, L, d_model] in float32 (no gradient: T5 is frozen)."""
    with torch.no_grad():
        return encoder(input_ids.to(encoder.device))[0].float()


def tokenize_t5(tokenizer, captions: list[str], max_length: int) -> torch.Tensor:
    """Ids as the pipelines tokenize for T5: padded to ``max_length``, truncated, ``</s>`` appended."""
    return tokenizer(captions, padding="max_length", max_length=max_length, truncation=True, add_special_tokens=True,
                     return_tensors="pt").input_ids


__all__ = ["TINY_T5", "write_t5_tokenizer", "build_t5_tokenizer", "tiny_t5_encoder", "t5_frozen_dtype",
           "load_t5_tokenizer", "load_t5_encoder", "frozen_t5", "encode_t5", "tokenize_t5"]
