"""Checks of the ``dataset`` section that need the data code (filters parse, ``idx_to_prompt`` loads)."""

from __future__ import annotations

from omegaconf import MISSING

from ..schema.dataset import (
    _ONLY_FOR,
    EXHAUSTED,
    LATENT_SAMPLINGS,
    SOURCE_OWN_KEYS,
    SOURCE_PARAM_KEYS,
    DatasetConfig,
    DatasetConfigError,
    DatasetParams,
    TagParams,
    _defaults,
    _value,
    canonical_type,
    plain_config,
)
from .captions import load_idx_to_prompt
from .filters import parse_filters


def validate_dataset_config(cfg: DatasetConfig) -> None:
    """Reject settings that cannot work, before anything is built. Raises :class:`DatasetConfigError`.

    Checks: the type is known; no key is set (to a non-default value) for a type it does not apply to;
    ranges of probabilities and sizes; filters parse (never ``eval``); ``idx_to_prompt`` loads;
    tag controls only with ``tags.use_tags`` or the folder ``metadata`` layout; precomputed text
    embeddings only with captions used as stored (caption dropout is fine).
    """
    cfg = plain_config(cfg)
    kind = canonical_type(cfg.type)
    p = cfg.params
    defaults = _defaults(DatasetParams)
    for key, types in _ONLY_FOR.items():
        value = _value(getattr(p, key))
        default = _value(defaults[key])
        if kind not in types and value != default:
            raise DatasetConfigError(
                f"dataset.params.{key}={value!r} does not apply to dataset.type={kind} "
                f"(it applies to {', '.join(sorted(types))}); remove it"
            )

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise DatasetConfigError(f"dataset.params.{key}={_value(getattr(p, key.split('.')[0]))!r}: {msg}")

    if p.path in (None, "", MISSING, "???"):
        raise DatasetConfigError("dataset.params.path is required: the shards, files or folder to train on")
    check_sources(p.sources)
    need(int(p.batch_size) >= 1, "batch_size", "must be >= 1")
    need(int(p.workers) >= 0, "workers", "must be >= 0")
    need(int(p.resolution) >= 8 and int(p.resolution) % 8 == 0, "resolution", "must be a multiple of 8 (VAE downsampling)")
    for key in ("random_flip", "caption_dropout", "shuffle_tags"):
        need(0.0 <= float(getattr(p, key)) <= 1.0, key, "is a probability: use a value in [0, 1]")
    need(int(p.keep_tags) >= 0, "keep_tags", "must be >= 0")
    need(int(p.min_size) >= 0, "min_size", "must be >= 0 pixels")
    need(int(p.shuffle_buffer) >= 1, "shuffle_buffer", "must be >= 1 sample (1: no shuffling)")
    need(int(p.canonical_readers) >= 0, "canonical_readers", "must be >= 0 (0: ranks x workers of the first start)")
    need(int(p.bucket_step) >= 8 and int(p.bucket_step) % 8 == 0, "bucket_step", "must be a multiple of 8 pixels")
    need(float(p.max_aspect_ratio) >= 1.0, "max_aspect_ratio", "must be >= 1.0")
    need(int(p.consider_every_nth) >= 1, "consider_every_nth", "must be >= 1")
    need(int(p.samples_per_shard) >= 0, "samples_per_shard", "must be >= 0 (0: automatic)")
    need(float(p.io_timeout) > 0, "io_timeout", "must be > 0 seconds")
    need(int(p.max_member_bytes) >= 1, "max_member_bytes", "must be >= 1 byte")
    need(str(p.layout) in ("auto", "flat", "metadata"), "layout", "choose auto, flat or metadata")
    need(len([k for k in str(p.image_keys).split(";") if k.strip()]) > 0, "image_keys", "name at least one member")
    need(len(str(p.csv_separator)) == 1, "csv_separator", "must be one character")
    need(str(p.latent_sampling) in LATENT_SAMPLINGS, "latent_sampling", "choose sample or mean")
    if p.text_embeddings:
        # A stored embedding is that of the caption as written; only dropout (to '') can be replayed on it.
        for key, on in (("shuffle_tags", float(p.shuffle_tags) > 0), ("tags.use_tags", bool(p.tags.use_tags)),
                        ("idx_to_prompt", _value(p.idx_to_prompt) is not None)):
            if on:
                raise DatasetConfigError(
                    f"dataset.params.{key} changes the caption, but dataset.params.text_embeddings=true uses the "
                    "embedding precomputed from the caption as stored: turn one of them off"
                )
    if int(p.resolution) % int(p.bucket_step) and p.aspect_buckets:
        raise DatasetConfigError(
            f"dataset.params.resolution={p.resolution} is not a multiple of bucket_step={p.bucket_step}"
        )

    parse_filters(_value(p.filters))  # raises naming the key
    if _value(p.idx_to_prompt) is not None:
        load_idx_to_prompt(_value(p.idx_to_prompt))

    tag_defaults = _defaults(TagParams)
    tags = p.tags
    tag_layout = kind == "folder" and p.layout in ("metadata", "auto")
    if not tags.use_tags and not tag_layout:
        for key, default in tag_defaults.items():
            if key != "use_tags" and _value(getattr(tags, key)) != _value(default):
                raise DatasetConfigError(
                    f"dataset.params.tags.{key} is set but tags are not used: set dataset.params.tags.use_tags=true "
                    "(or use dataset.type=folder with the metadata layout)"
                )
    if tags.use_tags and _value(p.idx_to_prompt) is not None:
        raise DatasetConfigError(
            "dataset.params.tags.use_tags and dataset.params.idx_to_prompt both choose the caption: keep one"
        )


def check_sources(sources) -> None:
    """``dataset.params.sources``: each entry a mapping with a path, a positive weight, known keys only."""
    if not sources:
        return
    names = set()
    for n, entry in enumerate(sources):
        where = f"dataset.params.sources[{n}]"
        if not isinstance(entry, dict):
            raise DatasetConfigError(f"{where} must be a mapping such as {{path: ..., weight: 1}}, got {entry!r}")
        unknown = sorted(set(entry) - set(SOURCE_OWN_KEYS) - set(SOURCE_PARAM_KEYS))
        if unknown:
            raise DatasetConfigError(f"{where}: unknown key(s) {unknown}; a source may set "
                                     f"{', '.join(SOURCE_OWN_KEYS + SOURCE_PARAM_KEYS)}")
        path = entry.get("path")
        if not path or "::" in str(path):
            raise DatasetConfigError(f"{where}.path={path!r}: one source's shards (brace notation, a folder or a "
                                     "file), not a '::' list: give each source an entry of its own")
        try:
            weight = float(entry.get("weight", 1.0))
        except (TypeError, ValueError):
            weight = -1.0
        if not weight > 0:
            raise DatasetConfigError(f"{where}.weight={entry.get('weight')!r}: must be a number > 0")
        if str(entry.get("exhausted", "restart")) not in EXHAUSTED:
            raise DatasetConfigError(f"{where}.exhausted={entry.get('exhausted')!r}: choose restart or drop")
        name = str(entry.get("name", path))
        if name in names:
            raise DatasetConfigError(f"{where}: two sources are named {name!r}; give them distinct names")
        names.add(name)
        if "filters" in entry:
            parse_filters(dict(entry["filters"] or {}))
    if all(str(e.get("exhausted", "restart")) == "drop" for e in sources):
        raise DatasetConfigError("dataset.params.sources: every source has exhausted: drop, so the stream would "
                                 "end; let at least one restart")

