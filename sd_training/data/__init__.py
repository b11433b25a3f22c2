"""Training data: sources (WebDataset, parquet, CSV, folders), filters, captions, buckets, resumable loader.

    loader = build_train_loader(cfg.dataset, tokenizer=tok, rank=r, world_size=n, seed=cfg.seed)
    # SDXL: tokenizer=(tok, tok_2) adds batch["input_ids_2"] (tok_2's length and padding)
    for batch in loader:            # forever
        batch["pixel_values"], batch["input_ids"], batch["captions"]
        batch["original_size"], batch["crop_top_left"], batch["target_size"]  # int64 [B, 2], (h, w) / (y, x)
        batch["sample_seeds"]  # int64 [B]: each sample's seed for the step's noise and timesteps
        # dataset.params.masked_loss: batch["loss_weight"] float32 [B, 1, H/8, W/8] when a sample has a mask,
        # and batch["zero_weight_samples"]: how many of its samples have weight 0 everywhere (an int)
        # dataset.params.references=R (edit training): batch["reference_values"] uint8 [B, R, 3, H, W], each
        # reference through its target's crop (see data/references.py); latent shards: batch["reference_latents"]
        # dataset.type=latents: batch["latents"] (scaled) instead of pixel_values, and with
        # dataset.params.text_embeddings batch["encoder_hidden_states"]; see data/latents.py
    ckpt["data"] = loader.state_dict()      # ... later: loader.load_state_dict([every rank's saved state])
    log(loader.stats())
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, List

from ..config.dataset import (
    SOURCE_PARAM_KEYS,
    DatasetConfig,
    DatasetConfigError,
    DatasetParams,
    TagParams,
    canonical_type,
    plain_config,
)
from .buckets import bucket_table
from .checks import validate_dataset_config
from .filters import parse_filters
from .folders import FolderSource
from .latents import LatentSampleProcessor, LatentShardSource, check_latent_sources
from .loader import TrainLoader, describe
from .samples import SampleProcessor
from .sources import REMOTE, Source, WebDatasetSource, split_sources
from .stats import log
from .stream import Plan
from .tables import CSVSource, ParquetSource

__all__ = [
    "DatasetConfig",
    "DatasetConfigError",
    "DatasetParams",
    "TagParams",
    "TrainLoader",
    "build_train_loader",
    "validate_dataset_config",
]


def _as_int(value: Any, key: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DatasetConfigError(f"dataset.params.{key}={value!r} is not an integer (unresolved interpolation?)") from None


STAT_SAMPLE = 32  # shards per source that start-up looks at (a 200,000-shard path is not stat'ed in full)


def _spread(items: List[str], k: int) -> List[str]:
    """Up to ``k`` items evenly spaced over ``items``, the first and the last included."""
    if len(items) <= k:
        return list(items)
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)]


def _check_local_units(kind: str, sources: List[Source]) -> None:
    """Missing local shards, judged from at most STAT_SAMPLE evenly spaced shards per source (every rank
    asks the filesystem the same few questions, not one per shard): all of them missing is an error naming
    the source; some missing is a warning (missing shards are skipped and counted when read)."""
    if kind not in ("WebDataset", "latents"):
        return
    for src in sources:
        local = [u for u in src.units if not REMOTE.match(u)]
        looked = _spread(local, STAT_SAMPLE)
        missing = [u for u in looked if not os.path.exists(u.removeprefix("file:"))]
        if looked and len(missing) == len(looked) and len(local) == len(src.units):
            raise DatasetConfigError(
                f"dataset.params.path: none of the {len(src.units)} shard(s) of source {src.name!r} exists "
                f"(looked at {len(looked)}, first: {missing[0]}); check the path and the brace range"
            )
        if missing:
            log.warning(
                "data: %d of the %d shards looked at (of %d) in %s do not exist (e.g. %s); missing shards are "
                "skipped and counted", len(missing), len(looked), len(src.units), src.name, missing[0],
            )


# dataset.type (canonical name) -> the reader of one '::'-separated path element
READERS = {"WebDataset": WebDatasetSource, "latents": LatentShardSource, "parquet": ParquetSource, "CSV": CSVSource,
           "folder": FolderSource}


def source_params(params) -> List[Any]:
    """The params each source is read with: one per '::' element of ``path``, or per entry of ``sources``
    (the entry's reading keys over the section's)."""
    if not params.sources:
        specs = split_sources(params.path)
        if not specs:
            raise DatasetConfigError("dataset.params.path is empty")
        return [dataclasses.replace(params, path=spec) for spec in specs]
    out = []
    for entry in params.sources:
        own = {k: entry[k] for k in SOURCE_PARAM_KEYS if k in entry}
        out.append(dataclasses.replace(params, path=str(entry["path"]), **own))
    return out


def build_sources(kind: str, params) -> List[Source]:
    """The sources of ``dataset.params.path`` (or ``sources``) for ``dataset.type`` (canonical name)."""
    if kind not in READERS:
        raise DatasetConfigError(f"dataset.type={kind}: no reader")  # canonical_type() rejects it earlier
    sources = [READERS[kind](sp.path, sp) for sp in source_params(params)]
    for src, entry in zip(sources, params.sources or []):
        if "name" in entry:
            src.name = str(entry["name"])
    return sources


def build_train_loader(cfg: DatasetConfig, *, tokenizer, rank: int, world_size: int, seed: int) -> TrainLoader:
    """The training loader of one rank (see :class:`TrainLoader` for batches, resume and stats).

    ``tokenizer``: one tokenizer, or a tuple/list of them (SDXL: ``(tokenizer, tokenizer_2)``): the first
    gives ``input_ids``, the second ``input_ids_2`` (its own ``model_max_length`` and pad token). Latent
    shards (``dataset.type=latents``) use the first only.
    """
    cfg = plain_config(cfg)
    validate_dataset_config(cfg)
    kind = canonical_type(cfg.type)
    p = cfg.params
    batch_size = _as_int(p.batch_size, "batch_size")
    workers = _as_int(p.workers, "workers")
    try:
        num_examples = int(p.num_examples_to_see)
    except (TypeError, ValueError):
        num_examples = None
    seed = int(seed) % 2**63  # numpy seeds must be non-negative; -1 style seeds map deterministically
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")

    sources = build_sources(kind, p)
    units = [(i, u) for i, src in enumerate(sources) for u in src.units]
    if not units:
        raise DatasetConfigError(f"dataset.params.path={p.path!r}: found no shard, file or row group to read")
    _check_local_units(kind, sources)
    readers = _as_int(p.canonical_readers, "canonical_readers")
    slots = readers or world_size * max(1, workers)
    if readers and readers % world_size:
        raise DatasetConfigError(
            f"dataset.params.canonical_readers={readers} cannot be split over {world_size} ranks: use a multiple of "
            f"the rank count (a number with many divisors, such as 48, 96 or 192, lets a run resume on many layouts)"
        )
    if len(units) < slots:
        msg = (
            f"dataset: {len(units)} units of work ({'shards' if kind in ('WebDataset', 'latents') else 'row groups/chunks'}) "
            + (f"for dataset.params.canonical_readers = {slots} readers" if readers else
               f"for {world_size} rank(s) x {max(1, workers)} worker(s) = {slots} readers")
        )
        if not p.resampled:
            raise DatasetConfigError(
                msg + ": finite mode gives each reader whole units, so some would get none. Use more shards "
                "(scripts/make_shards.py --samples-per-shard), fewer workers, or dataset.params.resampled=true"
            )
        log.warning("%s: fewer units than readers; resampled mode draws with replacement so this works, "
                    "but readers often read the same shard at the same time", msg)

    latent_scale, latents_info = None, None
    if kind == "latents":
        latent_scale = check_latent_sources(sources, p)
        proc = LatentSampleProcessor(p, kind, tokenizer, sources)
        latents_info = next((s.info for s in sources if s.info is not None), None)
    else:
        proc = SampleProcessor(p, kind, tokenizer)
    if p.sources:  # each source's own filters (its entry's, else the section's)
        proc.source_filters = [parse_filters(dict(sp.filters or {})) for sp in source_params(p)]
    mixture = {}
    if p.sources:
        mixture = dict(weights=[float(e.get("weight", 1.0)) for e in p.sources],
                       exhausted=[str(e.get("exhausted", "restart")) for e in p.sources])
    plan = Plan(
        sources=sources,
        units=units,
        seed=seed,
        rank=int(rank),
        world_size=int(world_size),
        workers=workers,
        resampled=bool(p.resampled),
        batch_size=batch_size,
        shuffle_buffer=_as_int(p.shuffle_buffer, "shuffle_buffer"),
        readers=readers,
        **mixture,
    )
    if plan.workers_per_rank < max(1, workers):
        log.warning("data: %d worker(s) per rank asked, %d used: each must serve the same number of the rank's %d "
                    "canonical readers (dataset.params.canonical_readers)", workers, plan.workers_per_rank,
                    plan.readers_per_rank)
    loader = TrainLoader(plan, proc, num_examples_to_see=num_examples, kind=kind, canonical_readers=readers)
    loader.latent_scaling_factor = latent_scale
    loader.latents_info = latents_info
    for line in describe(loader):
        log.info(line)
    if p.aspect_buckets:
        log.info("data: aspect buckets (w x h, ratio): %s", bucket_table(proc.buckets))
    return loader
