"""The text encoder and its tokenizer: transformers CLIP folders, or open_clip models converted to CLIP.

Whatever the source, training and exported pipelines see a transformers ``CLIPTextModel`` and a
``CLIPTokenizer``, so a pipeline written by ``export.py`` is a standard diffusers one:

* ``type: clip``: a ``CLIPTextModel`` folder in diffusers layout (a pipeline's ``text_encoder/``).
  That covers SD 1.x (OpenAI CLIP ViT-L/14) and SD 2.x, whose OpenCLIP ViT-H/14 text tower diffusers
  already stores as a ``CLIPTextModel`` with its last layer removed (23 of 24 layers).
* ``type: open_clip``: an open_clip architecture by name plus a local checkpoint file. Only the text
  tower is built (a ViT-H vision tower is 630M parameters SD never uses), its weights are loaded from
  the checkpoint and copied into an equivalent ``CLIPTextModel`` (the mapping diffusers uses for SD 2's
  OpenCLIP checkpoints: ``in_proj`` split into q/k/v, ``c_fc``/``c_proj`` -> ``fc1``/``fc2``,
  ``ln_final`` -> ``final_layer_norm``). Its tokenizer is CLIP's BPE (the ids equal open_clip's) padding
  with id 0 (``!``) as open_clip and SD 2 do. With ``clip_skip: 2`` an OpenCLIP ViT-H-14 checkpoint gives
  exactly SD 2's text encoder.

Clip skip is baked in: the last ``clip_skip - 1`` layers are removed from the module returned here, so
its ``last_hidden_state`` (which passes the final layer norm) *is* the clip-skipped embedding, and an
exported pipeline samples with the conditioning it was trained with, no argument needed. (diffusers'
``pipe(..., clip_skip=N)`` is no alternative: with transformers 5 it fails, reaching for
``text_encoder.text_model``, which ``CLIPTextModel`` no longer has.) The number applied is recorded in
the encoder's ``config.json`` (``sd_training_clip_skip``), so building again from an exported pipeline
with the same ``clip_skip`` does not remove more layers.
"""

from __future__ import annotations

import copy
import difflib
import gzip
import importlib.util
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from ...config import ConfigError
from ...config.schema import TextEncoderConfig
from ...outputs.export import unwrap
from ...loading import load_component as _load
from ...optim import param_groups
from ...speed.precision import DTYPES, frozen_text_dtype
from .text import grad_if_trained
from .open_clip_text import clip_text_model_from_open_clip, load_open_clip_text_tower  # noqa: F401 (type open_clip)

log = logging.getLogger(__name__)

TYPES = ("clip", "open_clip")
# Written into the converted / truncated encoder's config.json: the clip_skip its layers already reflect.
CLIP_SKIP_KEY = "sd_training_clip_skip"
CLIP_VOCAB_SIZE = 49408  # the BPE vocabulary of OpenAI CLIP and of open_clip's default tokenizer
OPEN_CLIP_PAD = "!"  # id 0: open_clip pads with 0, and SD 2's tokenizer does the same


# ----------------------------------------------------------------------------------------------
# CLIP's tokenizer, built offline from the BPE file open_clip ships
# ----------------------------------------------------------------------------------------------

# CLIP's byte-level BPE: 256 byte tokens, the same 256 with the end-of-word marker, the merges,
# then the two special tokens. 49,408 entries in all for the stock merges file.
_BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"
_N_MERGES = 49152 - 256 - 2  # open_clip's SimpleTokenizer keeps this many merge lines


def _bytes_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable-unicode table GPT-2 and CLIP use for byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def clip_bpe_path() -> Path:
    """Path of the CLIP BPE merges file that open_clip ships (found without importing open_clip)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("open_clip_torch is not installed; it ships the CLIP BPE file we build the tokenizer from")
    path = Path(list(spec.submodule_search_locations)[0]) / _BPE_FILE
    if not path.exists():
        raise RuntimeError(f"{path} is missing from the open_clip_torch install")
    return path


def write_clip_tokenizer(out_dir: str | os.PathLike, model_max_length: int = 77, pad_token: str = "<|endoftext|>") -> Path:
    """Write a transformers ``CLIPTokenizer`` folder (vocab.json, merges.txt, configs) to ``out_dir``.

    Its ids equal OpenAI CLIP's and open_clip's ("a photo of a cat" -> 49406 320 1125 539 320 2368 49407).
    ``pad_token``: CLIP pads with the end token; SDXL's second tokenizer (OpenCLIP's) pads with "!" (id 0).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(clip_bpe_path(), "rt", encoding="utf-8") as f:
        merges = f.read().split("\n")[1 : _N_MERGES + 1]
    merges = [tuple(m.split()) for m in merges]
    vocab = list(_bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab.extend("".join(m) for m in merges)
    vocab.extend(["<|startoftext|>", "<|endoftext|>"])
    (out / "vocab.json").write_text(json.dumps({tok: i for i, tok in enumerate(vocab)}, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n", encoding="utf-8")
    special = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": pad_token,
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "CLIPTokenizer", "model_max_length": model_max_length, **special})
    )
    return out


def build_clip_tokenizer(cache_dir: str | os.PathLike | None = None, model_max_length: int = 77,
                         pad_token: str = "<|endoftext|>"):
    """A ``CLIPTokenizer`` built offline; files are written to ``cache_dir`` (a temp dir if None)."""
    import tempfile

    from transformers import CLIPTokenizer

    folder = Path(cache_dir) if cache_dir else Path(tempfile.mkdtemp(prefix="clip_tokenizer_"))
    if not (folder / "vocab.json").exists():
        write_clip_tokenizer(folder, model_max_length, pad_token)
    # Load from the folder: passing vocab/merges paths as keyword arguments silently builds a broken
    # tokenizer in transformers 5 (see shared/notes/environment.md).
    return CLIPTokenizer.from_pretrained(str(folder))


def _error(message: str) -> ValueError:
    return ConfigError(message)


def validate_text_encoder_config(cfg: TextEncoderConfig, path: str = "model.text_encoder") -> None:
    """Checks that need no model; raises ConfigError naming the key."""
    if cfg.type not in TYPES:
        close = difflib.get_close_matches(str(cfg.type), TYPES, n=1)
        raise _error(f"'{path}.type' is '{cfg.type}', expected one of {', '.join(TYPES)}" + (f"; did you mean '{close[0]}'?" if close else ""))
    if cfg.dtype not in ("auto", *DTYPES):
        raise _error(f"'{path}.dtype' is '{cfg.dtype}', expected one of auto, {', '.join(DTYPES)}")
    if cfg.type == "open_clip":
        for key in ("open_clip_model", "open_clip_weights"):
            if not getattr(cfg, key):
                raise _error(f"'{path}.type' is open_clip: set '{path}.{key}'")
        if cfg.pretrained is not None:
            raise _error(f"'{path}.pretrained' is for type clip; with type open_clip the weights come from '{path}.open_clip_weights'")
        if cfg.open_clip_model.startswith("hf-hub:"):
            raise _error(
                f"'{path}.open_clip_model': hf-hub: names download at run time; "
                f"give the architecture name and a local '{path}.open_clip_weights'"
            )
        if not os.path.isfile(cfg.open_clip_weights):
            raise _error(
                f"'{path}.open_clip_weights' {cfg.open_clip_weights} is not a file (download the checkpoint first, e.g. "
                "open_clip_pytorch_model.bin of laion/CLIP-ViT-H-14-laion2B-s32B-b79K)"
            )
    else:
        for key in ("open_clip_model", "open_clip_weights"):
            if getattr(cfg, key) is not None:
                raise _error(f"'{path}.{key}' only applies to {path}.type=open_clip")
    if cfg.clip_skip < 0:
        raise _error(f"'{path}.clip_skip' must be >= 0, got {cfg.clip_skip}")
    if cfg.max_length is not None and cfg.max_length < 2:
        raise _error(f"'{path}.max_length' must be >= 2 (start and end tokens), got {cfg.max_length}")
    if cfg.train and cfg.dtype not in ("fp32", "auto"):
        raise _error(f"'{path}.train' keeps fp32 master weights: set '{path}.dtype=fp32' or auto (model.mixed_precision sets the compute dtype)")
    if cfg.learning_rate is not None:
        if not cfg.train:
            raise _error(f"'{path}.learning_rate' is set but '{path}.train' is False")
        if cfg.learning_rate < 0:
            raise _error(f"'{path}.learning_rate' must be >= 0, got {cfg.learning_rate}")


# ----------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------


def build_text_encoder(
    cfg: TextEncoderConfig, pipeline_src: str | None, device: torch.device, *,
    tokenizer_src: str | None = None, revision: str | None = None, gradient_checkpointing: bool = False,
    mixed_precision: str = "no",
):
    """The text encoder (``CLIPTextModel``) and its tokenizer (``CLIPTokenizer``), ready for the loop.

    ``pipeline_src`` is ``model.pretrained``; ``tokenizer_src`` is ``model.tokenizer.pretrained`` as
    set by the user (None: the pipeline's tokenizer for type clip, CLIP's BPE padding with 0 for
    type open_clip). ``revision`` applies to sources taken from ``pipeline_src``. The encoder comes
    back on ``device`` with clip skip applied and the tokenizer's ``model_max_length`` set to
    ``max_length``; frozen (eval, no grad, in ``dtype``; ``auto``: the ``mixed_precision`` of the run)
    unless ``train``, then fp32, train mode, requiring grad, with gradient checkpointing if asked.
    """
    from transformers import CLIPTextModel, CLIPTokenizer

    validate_text_encoder_config(cfg)
    rev = dict(revision=revision) if revision else {}
    if cfg.type == "clip":
        src = cfg.pretrained or pipeline_src
        if src is None:
            raise _error("the text encoder has no source: set model.pretrained or model.text_encoder.pretrained")
        text_encoder = _load(
            CLIPTextModel.from_pretrained, src, "text_encoder", "model.text_encoder.pretrained",
            **(rev if cfg.pretrained is None else {}),
        )
    else:
        tower = load_open_clip_text_tower(cfg.open_clip_model, cfg.open_clip_weights)
        text_encoder = clip_text_model_from_open_clip(tower)
        del tower

    tok_src = tokenizer_src or (pipeline_src or cfg.pretrained if cfg.type == "clip" else None)
    if tok_src is not None:
        tokenizer = _load(
            CLIPTokenizer.from_pretrained, tok_src, "tokenizer", "model.tokenizer.pretrained",
            **(rev if tokenizer_src is None and tok_src == pipeline_src else {}),
        )
    else:
        vocab = text_encoder.config.vocab_size
        if vocab != CLIP_VOCAB_SIZE:
            raise _error(
                f"the open_clip model '{cfg.open_clip_model}' has a {vocab}-token vocabulary, not CLIP's BPE ({CLIP_VOCAB_SIZE}): "
                "set model.tokenizer.pretrained to a matching CLIPTokenizer folder"
            )
        tokenizer = open_clip_tokenizer(text_encoder.config.max_position_embeddings)

    apply_clip_skip(text_encoder, cfg.clip_skip)
    _set_max_length(tokenizer, text_encoder, cfg.max_length)

    place_text_encoder(text_encoder, device, cfg.train, gradient_checkpointing,
                       frozen_text_dtype(cfg.dtype, mixed_precision))
    log.info(
        "text encoder: %s, %d layers (clip_skip %d), hidden size %d, max_length %d, %s",
        cfg.type, text_encoder.config.num_hidden_layers, cfg.clip_skip, text_encoder.config.hidden_size,
        tokenizer.model_max_length, "trained" if cfg.train else f"frozen {frozen_text_dtype(cfg.dtype, mixed_precision)}",
    )
    return text_encoder, tokenizer


def _set_max_length(tokenizer, text_encoder, max_length: int | None) -> None:
    """The data layer and exported pipelines both pad/truncate to ``tokenizer.model_max_length``."""
    limit = text_encoder.config.max_position_embeddings
    if max_length is None:
        if tokenizer.model_max_length > limit:  # a tokenizer saved without it reports a huge sentinel
            tokenizer.model_max_length = limit
        return
    if max_length > limit:
        raise _error(f"'model.text_encoder.max_length' {max_length} exceeds the text encoder's {limit} position embeddings")
    tokenizer.model_max_length = max_length


def load_pipeline_clip(pipeline: str, device: torch.device, max_length: int | None = None):
    """The pipeline folder's CLIP tokenizer and text encoder (frozen, on ``device``), the tokenizer cut
    to ``max_length`` tokens (None: the encoder's positions) as ``model.text_encoder.max_length`` would
    (``scripts/precompute_latents.py --text-embeddings``)."""
    from transformers import CLIPTextModel, CLIPTokenizer

    tokenizer = _load(CLIPTokenizer.from_pretrained, pipeline, "tokenizer", "the pipeline's tokenizer/")
    text_encoder = _load(CLIPTextModel.from_pretrained, pipeline, "text_encoder", "the pipeline's text_encoder/")
    limit = text_encoder.config.max_position_embeddings
    if max_length is not None:
        if max_length > limit:
            raise ValueError(f"max_length {max_length} exceeds the text encoder's {limit} positions")
        tokenizer.model_max_length = max_length
    elif tokenizer.model_max_length > limit:  # a tokenizer saved without it reports a huge sentinel
        tokenizer.model_max_length = limit
    return tokenizer, text_encoder.to(device).eval().requires_grad_(False)


def text_model_of(text_encoder):
    """The module that holds ``embeddings`` / ``encoder`` / ``final_layer_norm``, under DDP / compile
    wrappers and across transformers 4 (which nests them in ``.text_model``) and 5."""
    te = unwrap(text_encoder)
    return te.text_model if hasattr(te, "text_model") else te


def place_text_encoder(text_encoder, device: torch.device, train: bool, gradient_checkpointing: bool,
                       frozen_dtype: torch.dtype) -> None:
    """Trained: fp32, train mode, requiring grad (with gradient checkpointing if asked). Frozen: eval,
    no grad, in ``frozen_dtype``. On ``device`` either way."""
    if train:
        text_encoder.to(device=device, dtype=torch.float32)
        text_encoder.requires_grad_(True)
        text_encoder.train()
        if gradient_checkpointing:
            # transformers 5 renamed it; the old name still works there but warns.
            enable = getattr(text_encoder, "activation_checkpointing_enable", None) or text_encoder.gradient_checkpointing_enable
            enable()
    else:
        text_encoder.requires_grad_(False)
        text_encoder.eval()
        text_encoder.to(device=device, dtype=frozen_dtype)


def apply_clip_skip(text_encoder, clip_skip: int):
    """Remove the last layers so ``last_hidden_state`` is the clip-skipped embedding; in place, returned.

    0 or 1 leave the encoder as loaded (seed 002: "a value of 0 or 1 does nothing"). N >= 2 counts from
    the original model: an encoder whose config records that clip skip K was already applied loses
    N - K more layers (none when N == K); N < K cannot be undone and is an error. An SD 2 encoder from
    diffusers records nothing, so N counts from its 23 layers, as in EveryDream2.
    """
    if clip_skip <= 1:
        return text_encoder
    baked = max(int(getattr(text_encoder.config, CLIP_SKIP_KEY, 0) or 0), 1)
    if clip_skip < baked:
        raise _error(
            f"'model.text_encoder.clip_skip' is {clip_skip} but this text encoder was saved with clip_skip {baked} "
            f"applied ({CLIP_SKIP_KEY} in its config.json): its last layers are gone. Use clip_skip {baked} (or 0: as is)"
        )
    core = text_model_of(text_encoder)
    layers = list(core.encoder.layers)
    drop = clip_skip - baked
    if drop >= len(layers):
        raise _error(f"'model.text_encoder.clip_skip' {clip_skip} leaves no layer of the {len(layers)}-layer text encoder")
    if drop:
        core.encoder.layers = torch.nn.ModuleList(layers[: len(layers) - drop])
        text_encoder.config.num_hidden_layers = len(layers) - drop
    setattr(text_encoder.config, CLIP_SKIP_KEY, clip_skip)
    return text_encoder


def encode_text(text_encoder, input_ids: torch.Tensor, clip_skip: int = 0) -> torch.Tensor:
    """Token ids -> the hidden states the UNet cross-attends to (float32).

    ``clip_skip`` counts back from the last layer (seed 002 / kohya / EveryDream convention): 0 or 1 =
    the last layer's output; N >= 2 = the output of layer ``num_layers - N + 1`` (2 = penultimate),
    then the final layer norm. diffusers' ``clip_skip`` argument counts one lower (its 1 = our 2).
    ``build_text_encoder`` already bakes ``model.text_encoder.clip_skip`` into the module it returns
    (its last layers are dropped), so the training loop calls this with the default 0; the argument is
    for an encoder loaded as is (evaluating a stock pipeline with clip skip).

    Gradients flow only when the encoder has trainable parameters (text-encoder training); a frozen
    encoder runs under no_grad, as it always did.
    """
    with grad_if_trained(text_encoder):
        if clip_skip <= 1:
            hidden = text_encoder(input_ids, return_dict=False)[0]
        else:
            out = text_encoder(input_ids, output_hidden_states=True, return_dict=False)
            states = out[2]  # (last_hidden_state, pooler_output, hidden_states): embeddings + one per layer
            if clip_skip >= len(states):
                raise ValueError(f"clip_skip={clip_skip} but the text encoder has only {len(states) - 1} layers")
            hidden = text_model_of(text_encoder).final_layer_norm(states[-clip_skip])
    # A frozen encoder stored in fp16/bf16 (model.text_encoder.dtype) must not hand the fp32 UNet a
    # half tensor outside autocast. A no-op for fp32 encoders.
    return hidden.float()


def clip_skip_of(text_encoder) -> int:
    """The clip skip the encoder's layers reflect (1: the last layer, also for an encoder that records none)."""
    return max(int(getattr(text_encoder.config, CLIP_SKIP_KEY, 0) or 0), 1)


def open_clip_tokenizer(context_length: int = 77):
    """A ``CLIPTokenizer`` whose ids equal open_clip's ``tokenize`` (CLIP BPE, padded with id 0)."""
    # The tokenizer keeps its vocabulary in memory: the folder it is read from can go.
    with tempfile.TemporaryDirectory(prefix="open_clip_tokenizer_") as tmp:
        tokenizer = build_clip_tokenizer(tmp, model_max_length=context_length)
    tokenizer.pad_token = OPEN_CLIP_PAD
    return tokenizer


# ----------------------------------------------------------------------------------------------
# Training and export helpers
# ----------------------------------------------------------------------------------------------


def text_encoder_param_groups(
    text_encoder, cfg: TextEncoderConfig, base_lr: float, weight_decay: float,
    exclude_norm_and_bias: bool = True, lr_scale: float = 1.0,
) -> list[dict]:
    """The optimizer parameter groups of a trained text encoder ([] when frozen), named "text_encoder".

    ``base_lr`` is the UNet's peak LR (after ``optimizer.scale_lr``); ``cfg.learning_rate``, when set,
    is multiplied by the same ``lr_scale``. Decay / no-decay split as the UNet's (``optim.param_groups``).
    The LR schedule (a LambdaLR) scales every group's own peak by the same factor, so warmup and decay
    apply to both.
    """
    if not cfg.train:
        return []
    lr = cfg.learning_rate * lr_scale if cfg.learning_rate is not None else base_lr
    groups = param_groups(text_encoder, weight_decay, exclude_norm_and_bias, lr=lr)
    return [dict(g, name="text_encoder") for g in groups]


def text_encoder_for_pipeline(text_encoder):
    """The encoder a pipeline (export, sample grid) should hold: an fp32 copy of a half-precision one.

    A pipeline casts its prompt embeddings to the text encoder's dtype and hands them to the fp32 UNet
    outside autocast, which fails for fp16/bf16; saving it as fp32 also keeps exports uniform.
    """
    if all(p.dtype == torch.float32 for p in text_encoder.parameters()):
        return text_encoder
    return copy.deepcopy(text_encoder).float()


__all__ = [
    "TextEncoderConfig", "validate_text_encoder_config", "build_text_encoder", "apply_clip_skip", "open_clip_tokenizer",
    "load_open_clip_text_tower", "clip_text_model_from_open_clip", "text_encoder_param_groups", "text_encoder_for_pipeline",
    "encode_text", "load_pipeline_clip",
]
