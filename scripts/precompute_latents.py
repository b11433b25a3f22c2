#!/usr/bin/env python
"""WebDataset shards -> shards of VAE latents (and, when asked, text-encoder outputs), for training
with ``dataset.type=latents`` (no VAE encode, optionally no text encoder, in the training loop).

    python scripts/precompute_latents.py --input "shards/{00000..00009}.tar" --pipeline PIPE_DIR --output OUT_DIR
        [--store mean_std|sample] [--dtype fp16|fp32] [--text-embeddings [--clip-skip N] [--max-length 77]
        [--family auto|NAME] [--text-dtype auto|fp16|fp32|bf16]] [--resolution 256] [--aspect-buckets [--bucket-step 64] [--max-aspect-ratio 2]]
        [--references N [--reference-key ref] [--reference-crop aligned|center]]
        [--batch-size 32] [--workers 4] [--device auto|cpu|cuda] [--vae-dtype fp32|bf16] [--seed 0] [--no-progress]
    torchrun --nproc_per_node 8 scripts/precompute_latents.py ...       (the shards are split across ranks)

Images go through the training data path's own stages (``sd_training.data``: metadata checks, header
probe, reduced-scale decode, resize of the short side to ``--resolution``, center crop; with
``--aspect-buckets`` resize and center crop to the image's aspect-ratio bucket instead, so bucketed
training can run from latents; no flip, no caption changes), so a latent is exactly the encoding of what ``dataset.type=WebDataset`` would feed
the VAE. Unreadable samples are skipped and counted, as in training.

Output (format: ``sd_training/data/latents.py``): one tar per input shard with the same basename,
``KEY.latents.npy`` (``(latent - shift_factor) * scaling_factor`` with the VAE's factors; ``mean_std``: [2C, h, w] posterior mean then
std, the default, so training can draw a fresh posterior sample every epoch or use the mean;
``sample``: [C, h, w], one sample drawn here, half the bytes), ``KEY.txt``, ``KEY.json`` (the original
metadata + ``latent_scaling_factor``, ``latent_store``), ``KEY.cls`` when present, and with
``--text-embeddings`` ``KEY.text.npy`` (the pipeline family's text conditioning, ``Family.text_encoding``:
one CLIP encoder's last hidden state [77, D], or two encoders' states [77, D1 + D2] and ``KEY.pooled.npy``)
plus ``OUT_DIR/empty.text.npy`` (the empty caption's, substituted on caption dropout, and
``empty.pooled.npy`` with pooled embeddings). ``OUT_DIR/latents_info.json``
records the settings, the scaling and shift factors, the counts and the bytes per sample (latents, text;
logged at the start); ``OUT_DIR/sizes.json`` the samples per shard.

Edit training (``--references N``): each input sample's N reference images (``KEY.ref.<ext>``,
``KEY.ref2.<ext>``... or ``--reference-key``'s names) go through the training path's reference stage
(``sd_training/data/references.py``: ``--reference-crop aligned`` through the target's crop, ``center`` on
their own) and are stored as ``KEY.ref.latents.npy``, ``KEY.ref2.latents.npy``... in the same store, dtype
and units as ``KEY.latents.npy`` (``--store sample``: each reference's own posterior draw); a sample
without its N references is skipped (``missing_reference``), as in training. ``latents_info.json``
records ``references`` and ``reference_crop``.

Edit families whose text reads the reference images (Qwen-Image-Edit(-Plus), ``--references N
--text-embeddings``): each caption is encoded with its sample's references as the loader gives them to the
step (``families/qwen_image_edit_text.py``), padded to the longest the run's sizes give, and each sample also
stores ``KEY.empty.text.npy`` (the empty caption read with its references, for caption dropout) instead of a
folder-wide ``empty.text.npy``; ``latents_info.json`` records ``text_references``, ``text_vl_images`` and
``empty_text: per_sample``.

Text storage (``--text-dtype``): ``auto`` (the default) stores the text arrays as the family asks
(``TextEncoding.storage_dtype``: bf16 for T5-sized states, whose [512, 4096] a caption are the bulk of
the folder: half fp32's bytes, fp32's range where fp16 may overflow, and the precision bf16 training
computes in anyway), else in ``--dtype`` as before. bf16 is stored as uint16 bit patterns
(``latents_info.json``: ``text_dtype: bfloat16``) and read back exactly.

Distribution and resume: shard ``i`` (in brace order) belongs to rank ``i % WORLD_SIZE`` (torchrun or
srun variables; no process group is needed, so ranks never wait for each other). A shard is written
to ``NAME.tar.tmp`` and renamed when complete, so an existing ``NAME.tar`` is never redone and a killed
run's ``.tmp`` is simply rewritten: rerun the same command to finish an interrupted job. Rerunning with
different settings into the same folder is refused. Whichever rank finishes the last shard writes the
final ``latents_info.json`` (``"complete": true``) and ``sizes.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import sys
import tarfile
import time
import types
import zlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

log = logging.getLogger("precompute_latents")
from sd_training.data.latents_info import (  # noqa: E402  (the folder's info file and records)
    DONE_DIR,
    DTYPES,
    TEXT_DTYPES,
    atomic_write,
    finish_if_complete,
    make_info,
    shift_factor,
    start_folder,
    text_dtype,
)
from sd_training.config.script_args import SEED_MAX, integer, number, out_folder  # noqa: E402
from sd_training.data.samples import SIZE_FIELDS  # noqa: E402  (the image path's size conditioning fields)
from sd_training.data.buckets import target_sizes  # noqa: E402  (the targets' sizes: square or buckets)
from sd_training.families.registry import FAMILIES

VAE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="WebDataset shards: brace pattern, folder of .tar, or several joined with '::'")
    p.add_argument("--pipeline", required=True, help="diffusers pipeline folder (vae/, and text_encoder/ + tokenizer/ for --text-embeddings) or a vae folder")
    p.add_argument("--output", required=True, type=out_folder, help="output folder (one tar per input shard, same basename)")
    p.add_argument("--store", default="mean_std", choices=("mean_std", "sample"), help="posterior mean and std (default) or one sample")
    p.add_argument("--dtype", default="fp16", choices=sorted(DTYPES), help="storage dtype of latents (and of text embeddings unless --text-dtype or the family says otherwise)")
    p.add_argument("--text-embeddings", action="store_true", help="also store the text encoder's outputs of each caption")
    p.add_argument("--family", default="auto", choices=("auto", *FAMILIES),
                   help="with --text-embeddings: the family whose text conditioning is stored (auto: from the "
                        "pipeline's model_index.json)")
    p.add_argument("--text-dtype", default="auto", choices=("auto", *TEXT_DTYPES),
                   help="with --text-embeddings: storage dtype of the text arrays (auto: the family's choice, "
                        "bf16 for T5-sized states; else --dtype)")
    p.add_argument("--clip-skip", type=integer(0, 64), default=0, help="with --text-embeddings: layers counted back from the last (0/1: last, 2: penultimate), 0 to 64")
    p.add_argument("--max-length", type=integer(1, 4096), default=None, help="with --text-embeddings: tokens per caption, 1 to 4096 (default: the tokenizer's, 77)")
    p.add_argument("--resolution", type=integer(8, 8192, multiple_of=8), default=256, help="pixels, 8 to 8192, a multiple of 8 (VAE downsampling): short side resized then center-cropped to this square (with --aspect-buckets: the buckets' area is resolution^2)")
    p.add_argument("--aspect-buckets", action="store_true", help="keep each image's aspect ratio: resize and center-crop it to its aspect-ratio bucket (as dataset.params.aspect_buckets does), so the latents have the bucket's shape")
    p.add_argument("--bucket-step", type=integer(8, 1024, multiple_of=8), default=64, help="with --aspect-buckets: pixels, bucket sides are multiples of this (8 to 1024, a multiple of 8)")
    p.add_argument("--max-aspect-ratio", type=number(1, 16), default=2.0, help="with --aspect-buckets: long side / short side of the most elongated bucket, 1 to 16")
    p.add_argument("--references", type=integer(0, 8), default=0,
                   help="edit training: reference images per sample, 0 to 8, stored as KEY.ref.latents.npy, "
                        "KEY.ref2.latents.npy... (0: none; dataset.params.references)")
    p.add_argument("--reference-key", default="ref", help="with --references: the input members' name, KEY.<key>.<ext>, "
                   "KEY.<key>2.<ext>... (dataset.params.reference_key)")
    p.add_argument("--reference-crop", default="aligned", choices=("aligned", "center"),
                   help="with --references: through the target's crop (aligned) or each on its own (center), as "
                        "dataset.params.reference_crop")
    p.add_argument("--batch-size", type=integer(1, 4096), default=32, help="images per VAE call, per rank, 1 to 4096")
    p.add_argument("--workers", type=integer(0, 256), default=4, help="image-decoding processes per rank, 0 to 256 (0: in the main process)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--vae-dtype", default="fp32", choices=sorted(VAE_DTYPES), help="precision of the VAE encode (fp16 overflows; see families/autoencoder_loss)")
    p.add_argument("--seed", type=integer(0, SEED_MAX), default=0, help="--store sample: seed of the posterior draws (per shard and sample)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if (args.clip_skip or args.max_length or args.family != "auto" or args.text_dtype != "auto") and not args.text_embeddings:
        p.error("--clip-skip, --max-length, --family and --text-dtype apply to --text-embeddings only")
    if (args.reference_key != "ref" or args.reference_crop != "aligned") and not args.references:
        p.error("--reference-key and --reference-crop apply to --references only")
    if (args.bucket_step != 64 or args.max_aspect_ratio != 2.0) and not args.aspect_buckets:
        p.error("--bucket-step and --max-aspect-ratio apply to --aspect-buckets only")
    return args


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def pipeline_family(args, strict: bool = True) -> str:
    """The family's name: ``--family``, else from the pipeline's model_index.json (the registry's
    detection; a folder without one: the default family). ``strict=False`` (latents only): a pipeline no
    family trains is read with the default family's VAE class, as before families chose it."""
    from sd_training.config import ConfigError
    from sd_training.families.registry import DEFAULT_FAMILY, detect_source

    try:
        return detect_source(args.family, args.pipeline, must=False, family_key="--family",
                             source_key="--pipeline") or DEFAULT_FAMILY
    except ConfigError as exn:
        if not strict:
            return DEFAULT_FAMILY
        raise SystemExit(f"precompute_latents: {exn}") from None


def load_models(args, device: torch.device):
    """The VAE (and the family's caption encoder, ``Family.text_encoding``), frozen, and a fingerprint of
    the VAE's weights."""
    family = FAMILIES[pipeline_family(args, strict=bool(args.text_embeddings))]
    vae = family.latent_vae(args.pipeline, "--pipeline", VAE_DTYPES[args.vae_dtype])  # the family's VAE class
    fingerprint = hashlib.sha1()
    for name, tensor in sorted(vae.state_dict().items()):  # which weights made these latents (~1 s for SD's VAE)
        fingerprint.update(name.encode())
        fingerprint.update(tensor.detach().float().contiguous().numpy().tobytes())
    vae = vae.to(device).eval().requires_grad_(False)
    encoder = None
    if args.text_embeddings:
        # An edit family whose text reads the references (Qwen-Image-Edit) is given their count and the targets' sizes
        edit = ({"references": args.references, "sizes": target_sizes(args.resolution, args.aspect_buckets,
                                                                          args.bucket_step, args.max_aspect_ratio)}
                if getattr(family, "text_reads_references", False) else {})
        try:  # as the training's text encoder (model.text_encoder.clip_skip / max_length) would see the caption
            encoder = family.text_encoding(args.pipeline, device, clip_skip=args.clip_skip, max_length=args.max_length,
                                           **edit)
        except (ValueError, NotImplementedError) as exn:
            raise SystemExit("precompute_latents: --text-embeddings (--clip-skip, --max-length, --family, "
                             f"--references): {exn}") from None
    return vae, fingerprint.hexdigest(), encoder


def encode_images(vae, pixels: torch.Tensor, scale: float, shift: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std in the denoiser's units, ``(mean - shift) * scale`` and ``std * scale``, float32
    on the CPU (``pixels``: uint8, or float in [-1, 1]); a sample of them is ``(latent - shift) * scale``.
    The encode is the training's (``families.components.vae.encode``)."""
    from sd_training.data.transforms import unit_range
    from sd_training.families.components.vae import encode

    mean, std = encode(vae, unit_range(pixels.to(next(vae.parameters()).device)), scale, shift, with_std=True)
    return mean.cpu(), std.cpu()


# ----------------------------------------------------------------------------------------------
# Reading: the training data path's stages, one shard at a time
# ----------------------------------------------------------------------------------------------


def input_params(args):
    from sd_training.data import DatasetConfig, validate_dataset_config

    cfg = DatasetConfig()
    p = cfg.params
    p.path, p.resolution = args.input, args.resolution
    p.batch_size, p.workers, p.num_examples_to_see = 1, 0, 0
    p.center_crop, p.random_flip, p.caption_dropout, p.shuffle_tags = True, 0.0, 0.0, 0.0
    p.aspect_buckets, p.bucket_step, p.max_aspect_ratio = args.aspect_buckets, args.bucket_step, args.max_aspect_ratio
    p.references, p.reference_key, p.reference_crop = args.references, args.reference_key, args.reference_crop
    validate_dataset_config(cfg)
    return p


def output_name(unit: str) -> str:
    """'.../shard-0001.tar' (or .tar.gz, or a URL) -> 'shard-0001.tar'."""
    base = os.path.basename(unit.split("?", 1)[0])
    stem = base.split(".tar", 1)[0] if ".tar" in base else os.path.splitext(base)[0]
    return stem + ".tar"


class ShardSamples(torch.utils.data.IterableDataset):
    """Decoded samples of the given shards: ``("sample", name, dict)`` items then ``("end", name, stats)``.

    With DataLoader workers, worker ``w`` reads shards ``w, w + W, ...`` of the list whole, so the
    samples of one shard arrive in order (interleaved with other shards' samples)."""

    def __init__(self, source, params, shards: List[Tuple[str, str]], tokenizer_len: int):
        self.source, self.params, self.shards, self.tokenizer_len = source, params, shards, tokenizer_len

    def __iter__(self) -> Iterator[tuple]:
        from sd_training.data.samples import SampleProcessor
        from sd_training.data.sources import ShardError
        from sd_training.data.stats import Stats

        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            torch.set_num_threads(1)
        # process() never tokenizes: the processor only reads model_max_length.
        proc = SampleProcessor(self.params, "WebDataset", types.SimpleNamespace(model_max_length=self.tokenizer_len))
        for unit, name in self.shards[wid::nw]:
            stats = Stats()
            error = None
            try:
                for j, raw in enumerate(self.source.read(unit, stats)):
                    s = proc.select(raw, stats)
                    if s is None:
                        continue
                    # Center crop and no flip: the generator is drawn from but changes nothing.
                    out = proc.process(s, np.random.default_rng(j), stats)
                    if out is None:
                        continue
                    meta = json.loads(bytes(raw["meta_raw"]).decode("utf-8")) if raw.get("meta_raw") is not None else {}
                    cls = raw.get("cls")
                    yield ("sample", name, {"key": out["key"], "caption": out["caption"], "meta": meta,
                                            "cls": bytes(cls) if isinstance(cls, (bytes, bytearray)) else cls,
                                            "pixels": out["pixels"], "references": out["references"],
                                            **{k: out[k] for k in SIZE_FIELDS}})
            except ShardError as exn:
                error = str(exn)
            yield ("end", name, {"counts": dict(stats.counts), "error": error})


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def _as_is(item):
    return item


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), mtime, 0o644
    tar.addfile(info, io.BytesIO(data))


class ShardWriter:
    """One output shard being written: batches its samples through the VAE (and text encoder)."""

    def __init__(self, out: Path, name: str, args, models, scale: float):
        from sd_training.data.stats import Stats

        self.out, self.name, self.args, self.scale = out, name, args, scale
        self.vae, self.encoder = models
        self.tmp = out / f"{name}.tmp"
        self.tar = tarfile.open(self.tmp, "w")
        self.pending: Dict[tuple, List[Dict[str, Any]]] = {}  # per pixel shape (aspect buckets): one VAE call each
        self.written = 0
        self.encoded = 0  # samples through the VAE so far: a sample's position, seeding its posterior draw
        self.stats = Stats()
        self.mtime = time.time()
        self.shard_seed = zlib.crc32(name.encode())

    def add(self, sample: Dict[str, Any]) -> int:
        shape = tuple(sample["pixels"].shape)
        group = self.pending.setdefault(shape, [])
        group.append(sample)
        return self.flush(shape) if len(group) >= self.args.batch_size else 0

    def flush(self, shape: Optional[tuple] = None) -> int:
        """Encode and write the pending samples of one pixel shape (None: of every shape)."""
        if shape is None:
            return sum(self.flush(s) for s in sorted(self.pending))
        return self._write(self.pending.pop(shape, []))

    def _write(self, batch: List[Dict[str, Any]]) -> int:
        from sd_training.data.latents import (EMPTY_TEXT_MEMBER, LATENTS_MEMBER, REFERENCE_BASE, from_stored, npy_bytes,
                                              to_stored)
        from sd_training.data.references import reference_names
        from sd_training.data.transforms import to_pixel_values

        if not batch:
            return 0
        dtype = DTYPES[self.args.dtype]
        shift = shift_factor(self.vae)
        tdtype = text_dtype(self.args, self.encoder)
        mean, std = encode_images(self.vae, to_pixel_values(np.stack([s["pixels"] for s in batch])), self.scale, shift)
        refs = [encode_images(self.vae, to_pixel_values(np.stack([s["references"][k] for s in batch])),
                              self.scale, shift) for k in range(self.args.references)]  # edit training: each reference as the target, [(mean, std)]
        texts, pooled, empties = self._texts(batch)
        n = 0
        for i, s in enumerate(batch):
            index, self.encoded = self.encoded, self.encoded + 1
            arr = self._stored(mean[i], std[i], [self.args.seed, self.shard_seed, index], dtype)
            ref_arrs = [self._stored(m[i], sd[i], [self.args.seed, self.shard_seed, index, 1 + k], dtype)
                        for k, (m, sd) in enumerate(refs)]
            if not all(np.isfinite(a).all() for a in (arr, *ref_arrs)):  # an overflowing VAE, or beyond fp16's range
                self.stats.skip("latents_nonfinite", f"{self.name} sample {s['key']!r}: non-finite latents in {self.args.dtype}")
                continue
            text = to_stored(texts[i], tdtype) if texts is not None else None
            pool = to_stored(pooled[i], tdtype) if pooled is not None else None
            if text is not None and not (np.isfinite(from_stored(text, tdtype)).all()
                                         and (pool is None or np.isfinite(from_stored(pool, tdtype)).all())):
                self.stats.skip("text_nonfinite", f"{self.name} sample {s['key']!r}: non-finite text embedding in {tdtype}")
                continue
            key = s["key"]
            meta = dict(s["meta"])
            # The size micro-conditioning of this crop: (h, w) of the source, (y, x) of the crop, (h, w) out.
            meta.update(latent_scaling_factor=self.scale, latent_store=self.args.store,
                        **({"latent_shift_factor": shift} if shift else {}), **{k: list(s[k]) for k in SIZE_FIELDS})
            _add(self.tar, f"{key}.latents.npy", npy_bytes(arr), self.mtime)
            for name, ref in zip(reference_names(REFERENCE_BASE, len(ref_arrs)), ref_arrs):
                _add(self.tar, f"{key}.{name}.{LATENTS_MEMBER}", npy_bytes(ref), self.mtime)
            _add(self.tar, f"{key}.txt", s["caption"].encode("utf-8"), self.mtime)
            _add(self.tar, f"{key}.json", json.dumps(meta).encode("utf-8"), self.mtime)
            if s["cls"] is not None:
                _add(self.tar, f"{key}.cls", s["cls"] if isinstance(s["cls"], bytes) else str(s["cls"]).encode(), self.mtime)
            if texts is not None:
                _add(self.tar, f"{key}.text.npy", npy_bytes(text), self.mtime)
            if empties is not None:  # the empty caption read with this sample's references (caption dropout)
                _add(self.tar, f"{key}.{EMPTY_TEXT_MEMBER}", npy_bytes(to_stored(empties[i], tdtype)), self.mtime)
            if pool is not None:
                _add(self.tar, f"{key}.pooled.npy", npy_bytes(pool), self.mtime)
            self.written += 1
            n += 1
        return n

    def _texts(self, batch: List[Dict[str, Any]]):
        """(states, pooled, each sample's empty caption's states or None) of a batch's captions; an edit family's
        text (``image_conditioned``) is read with each sample's references, as the loader gives them to the step."""
        if self.encoder is None:
            return None, None, None
        captions = [s["caption"] for s in batch]
        if not getattr(self.encoder, "image_conditioned", False):
            return (*self.encoder.encode(captions), None)
        from sd_training.data.references import collate_references

        refs = collate_references(batch)  # uint8 [B, R, 3, H, W]: the step's reference_values
        texts, pooled = self.encoder.encode(captions, refs)
        return texts, pooled, self.encoder.encode([""] * len(batch), refs)[0]

    def _stored(self, mean: torch.Tensor, std: torch.Tensor, seed: List[int], dtype) -> np.ndarray:
        """One latent as stored: ``mean_std`` [2C, h, w], or ``sample`` [C, h, w] drawn from its own ``seed``."""
        if self.args.store == "mean_std":
            return torch.cat([mean, std]).numpy().astype(dtype)
        rng = np.random.default_rng(seed)
        return (mean.numpy() + std.numpy() * rng.standard_normal(mean.shape, dtype=np.float32)).astype(dtype)

    def close(self, read: Dict[str, Any]) -> Dict[str, Any]:
        """Flush, then make the shard visible: its record first, the tar last (the completion mark)."""
        self.flush()
        self.tar.close()
        counts = {**read["counts"], **{k: v for k, v in self.stats.counts.items()}}
        record = {
            "samples": self.written,
            "skipped": {k[len("skipped/"):]: v for k, v in counts.items() if k.startswith("skipped/")},
        }
        (self.out / DONE_DIR).mkdir(exist_ok=True)
        atomic_write(self.out / DONE_DIR / f"{self.name}.json", json.dumps(record).encode())
        os.replace(self.tmp, self.out / self.name)
        return record


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Precompute this rank's shards; returns a summary (also logged)."""
    args = parse(sys.argv[1:] if argv is None else argv)
    from tqdm import tqdm

    from sd_training.data import build_sources
    from sd_training.data.latents import INFO_FILE
    from sd_training.distributed import pick_device, probe_env

    layout = probe_env()
    rank, world = layout["rank"], layout["world_size"]
    device = pick_device(args.device, layout["local_rank"])
    params = input_params(args)
    sources = build_sources("WebDataset", params)
    units = [(i, u) for i, src in enumerate(sources) for u in src.units]
    names = [output_name(u) for _, u in units]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise SystemExit(f"precompute_latents: two input shards would both be written as {dup}; give the sources distinct names")

    vae, fingerprint, encoder = load_models(args, device)
    scale = float(vae.config.scaling_factor)
    empty = empty_pooled = text_shape = None
    if getattr(encoder, "image_conditioned", False):  # each sample stores its own empty caption (its references)
        text_shape = encoder.text_shape
    elif encoder is not None:
        empty, empty_pooled = encoder.encode([""])
        empty, text_shape = empty[0], empty[0].shape
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    info = make_info(args, vae, fingerprint, names, encoder, text_shape,
                     empty_pooled.shape[1:] if empty_pooled is not None else None)
    start_folder(out, rank, info, empty, empty_pooled)

    mine = [k for k in range(len(units)) if k % world == rank]
    todo = [k for k in mine if not (out / names[k]).exists()]
    log.info("rank %d/%d: %d of %d shards are mine, %d already done, %d to write (device %s)",
             rank, world, len(mine), len(units), len(mine) - len(todo), len(todo), device)
    summary = {"rank": rank, "world_size": world, "shards_mine": len(mine), "shards_written": [], "shards_failed": [],
               "samples": 0, "skipped": {}}
    by_source: Dict[int, List[Tuple[str, str]]] = {}
    for k in todo:
        by_source.setdefault(units[k][0], []).append((units[k][1], names[k]))
    models = (vae, encoder)
    max_len = encoder.max_length if encoder is not None else 77
    with tqdm(total=len(todo), unit="shard", desc=f"latents rank {rank}", disable=args.no_progress) as bar:
        for src, shards in by_source.items():
            data = ShardSamples(sources[src], params, shards, max_len)
            workers = min(args.workers, len(shards))
            items = iter(data)
            if workers:  # collate_fn: hand the items over as they are (no numpy -> tensor conversion)
                items = iter(torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers, collate_fn=_as_is))
            writers: Dict[str, ShardWriter] = {}
            for kind, name, payload in items:
                if name not in writers:
                    writers[name] = ShardWriter(out, name, args, models, scale)
                if kind == "sample":
                    summary["samples"] += writers[name].add(payload)
                    continue
                writer = writers.pop(name)
                if payload["error"]:  # missing or unreadable input shard: not marked done, so a rerun retries it
                    writer.tar.close()
                    writer.tmp.unlink(missing_ok=True)
                    log.error("rank %d: %s", rank, payload["error"])
                    summary["shards_failed"].append(name)
                    bar.update(1)
                    continue
                before = writer.written
                record = writer.close(payload)
                summary["samples"] += writer.written - before
                summary["shards_written"].append(name)
                log.info("rank %d wrote %s (%d samples)", rank, name, record["samples"])
                for k, v in record["skipped"].items():
                    summary["skipped"][k] = summary["skipped"].get(k, 0) + v
                bar.update(1)
                bar.set_postfix(samples=summary["samples"])
    summary["complete"] = finish_if_complete(out, info)
    log.info("rank %d: wrote %d shards (%d samples; skipped %s)%s%s", rank, len(summary["shards_written"]),
             summary["samples"], summary["skipped"] or "none",
             f"; FAILED {summary['shards_failed']}" if summary["shards_failed"] else "",
             f"; all {len(names)} shards complete: {out / INFO_FILE}" if summary["complete"] else "")
    return summary


if __name__ == "__main__":
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    result = main()
    sys.exit(1 if result["shards_failed"] else 0)
