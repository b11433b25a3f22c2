"""``latents_info.json`` of a latent-shard folder as ``scripts/precompute_latents.py`` writes it: the
settings (a rerun with other ones is refused), the scaling and shift factors, the storage dtypes, the bytes
per sample, and when every shard is in place the counts (``sizes.json`` beside it). The reader's side of
the format is ``latents.py``."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from .latents import (EMPTY_POOLED_FILE, EMPTY_TEXT_FILE, FORMAT, FORMAT_VERSION, INFO_FILE, PER_SAMPLE, npy_bytes,
                      to_stored)

log = logging.getLogger("precompute_latents")

DTYPES = {"fp16": np.float16, "fp32": np.float32}
TEXT_DTYPES = {"fp16": "float16", "fp32": "float32", "bf16": "bfloat16"}  # --text-dtype -> text_dtype
DONE_DIR = ".done"  # per-shard records (samples, skips), written before the shard is renamed into place


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def shift_factor(vae) -> float:
    """The VAE's shift factor (0 for VAEs without one: SD's)."""
    return float(getattr(vae.config, "shift_factor", None) or 0.0)


def text_dtype(args, encoder) -> Optional[str]:
    """``latents_info.json``'s ``text_dtype``: --text-dtype, with auto the family's choice, else --dtype."""
    if encoder is None:
        return None
    choice = args.text_dtype if args.text_dtype != "auto" else getattr(encoder, "storage_dtype", None) or args.dtype
    return TEXT_DTYPES[choice]


# Recorded for provenance only: a rerun may change them (moved folders, another batch size).
PROVENANCE = ("input", "vae_source", "text_encoder_source", "batch_size", "workers", "device")


def make_info(args, vae, fingerprint: str, names: List[str], encoder, text_shape,
              pooled_shape=None) -> Dict[str, Any]:
    cfg = vae.config
    channels = int(cfg.latent_channels)
    down = 2 ** (len(cfg.block_out_channels) - 1)
    side = args.resolution // down
    latent_shape = [2 * channels if args.store == "mean_std" else channels, side, side]
    tdtype = text_dtype(args, encoder)
    refs = int(getattr(args, "references", 0) or 0)  # edit training's reference latents per sample
    image_text = bool(getattr(encoder, "image_conditioned", False))  # an edit family's text, read with the references
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "latent_scaling_factor": float(cfg.scaling_factor),
        "latent_shift_factor": shift_factor(vae),
        "latent_store": args.store,
        "latent_dtype": np.dtype(DTYPES[args.dtype]).name,
        "latent_channels": channels,
        "latent_shape": latent_shape,
        "downsample_factor": down,
        "resolution": args.resolution,
        "center_crop": True,
        # Present only with --aspect-buckets (folders made without it keep their info unchanged).
        **({"aspect_buckets": {"bucket_step": args.bucket_step, "max_aspect_ratio": args.max_aspect_ratio}}
           if args.aspect_buckets else {}),
        "vae_fingerprint": fingerprint,
        "vae_dtype": args.vae_dtype,
        "seed": args.seed if args.store == "sample" else None,
        # edit training: KEY.ref.latents.npy, KEY.ref2.latents.npy... per sample (0: none), and how they were cropped
        "references": refs,
        **({"reference_crop": args.reference_crop} if refs else {}),
        "text_embeddings": bool(args.text_embeddings),
        "text_shape": list(text_shape) if text_shape else None,
        "pooled_shape": list(pooled_shape) if pooled_shape else None,
        "text_dtype": tdtype,
        "bytes_per_sample": bytes_per_sample(latent_shape, np.dtype(DTYPES[args.dtype]).itemsize, tdtype,
                                             text_shape, pooled_shape, refs, 2 if image_text else 1),
        # The family's layout tag (PipelineFamily.text_tag; None: the single-encoder layout of older folders)
        "text_family": encoder.tag if encoder is not None else None,
        "clip_skip": args.clip_skip if args.text_embeddings else None,
        "empty_text_file": EMPTY_TEXT_FILE if args.text_embeddings and not image_text else None,
        # Present only for an edit family's text: what it was read with (a run reading otherwise refuses it), and
        # each sample's own empty caption (KEY.empty.text.npy) in place of empty.text.npy
        **({"text_references": encoder.references, "text_vl_images": encoder.vl_rule, "empty_text": PER_SAMPLE}
           if image_text else {}),
        "shards": names,
        # provenance
        "input": args.input,
        "vae_source": os.path.abspath(args.pipeline),
        "text_encoder_source": os.path.abspath(args.pipeline) if args.text_embeddings else None,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "device": args.device,
    }


def bytes_per_sample(latent_shape, latent_itemsize: int, tdtype: Optional[str], text_shape,
                     pooled_shape, references: int = 0, texts: int = 1) -> Dict[str, int]:
    """Array bytes of one sample (``.npy`` headers and tar headers, about 1.1 KiB a member, not counted);
    latents at the square ``--resolution`` (aspect buckets: about the same area); ``references``: the
    reference latents (edit training), each the target's size; ``texts``: text arrays per sample (2: an edit
    family's caption and its own empty caption)."""
    def numel(shape) -> int:
        return int(np.prod(shape)) if shape else 0

    text_size = 2 if tdtype in ("bfloat16", "float16") else 4
    return {"latents": numel(latent_shape) * latent_itemsize,
            "text": texts * (numel(text_shape) + numel(pooled_shape)) * text_size if tdtype else 0,
            **({"references": references * numel(latent_shape) * latent_itemsize} if references else {})}


# Fields added after the format's first folders, and the value that means the same for a folder without them.
LEGACY = {"latent_shift_factor": 0.0, "bytes_per_sample": None, "references": 0}


def check_settings(path: Path, info: Dict[str, Any]) -> None:
    """An existing latents_info.json must describe the same settings (the shards would mix otherwise)."""
    if not path.exists():
        return
    old = json.loads(path.read_text())
    for key, value in LEGACY.items():  # a folder written before a field: the field's old meaning
        if key not in old and (value is None or info.get(key) == value):
            old[key] = info.get(key)
    if "text_dtype" not in old:
        old["text_dtype"] = old.get("latent_dtype") if old.get("text_embeddings") else None
    skip = set(PROVENANCE) | {"count", "complete", "skipped", "sizes"}
    diff = [k for k in sorted(set(old) | set(info)) if k not in skip and old.get(k) != info.get(k)]
    if diff:
        shown = ", ".join(f"{k}: {old.get(k)!r} -> {info.get(k)!r}" for k in diff if k not in ("shards", "vae_fingerprint"))
        raise SystemExit(
            f"precompute_latents: {path.parent} holds latents made with other settings ({', '.join(diff)}"
            f"{'; ' + shown if shown else ''}). Use another --output folder, or the same settings to resume"
        )


def finish_if_complete(out: Path, info: Dict[str, Any]) -> bool:
    """When every shard is in place, write sizes.json and the final latents_info.json (idempotent)."""
    records = {}
    for name in info["shards"]:
        rec = out / DONE_DIR / f"{name}.json"
        if not (out / name).exists() or not rec.exists():
            return False
        records[name] = json.loads(rec.read_text())
    if info.get("empty_text_file") and not (out / info["empty_text_file"]).exists():
        return False
    skipped: Dict[str, int] = {}
    for r in records.values():
        for k, v in r["skipped"].items():
            skipped[k] = skipped.get(k, 0) + v
    sizes = {name: r["samples"] for name, r in records.items()}
    atomic_write(out / "sizes.json", json.dumps(sizes, indent=1).encode())
    final = {**info, "count": sum(sizes.values()), "skipped": skipped, "complete": True}
    atomic_write(out / "latents_info.json", json.dumps(final, indent=1).encode())
    return True


def start_folder(out: Path, rank: int, info: Dict[str, Any], empty: Optional[np.ndarray],
                 empty_pooled: Optional[np.ndarray]) -> None:
    """Refuse a folder made with other settings, log the bytes per sample, and (rank 0) write the
    unfinished ``latents_info.json`` and the empty caption's text arrays."""
    check_settings(out / INFO_FILE, info)
    per = info["bytes_per_sample"]
    log.info("bytes per sample: latents %s (%s, %s), text %s%s", f"{per['latents']:,}", info["latent_dtype"],
             info["latent_store"], f"{per['text']:,}", f" ({info['text_dtype']})" if info["text_dtype"] else "")
    if rank != 0:
        return
    if not (out / INFO_FILE).exists():
        atomic_write(out / INFO_FILE, json.dumps({**info, "complete": False}, indent=1).encode())
    if empty is not None and not (out / EMPTY_TEXT_FILE).exists():
        atomic_write(out / EMPTY_TEXT_FILE, npy_bytes(to_stored(empty, info["text_dtype"])))
    if empty_pooled is not None and not (out / EMPTY_POOLED_FILE).exists():
        atomic_write(out / EMPTY_POOLED_FILE, npy_bytes(to_stored(empty_pooled[0], info["text_dtype"])))
