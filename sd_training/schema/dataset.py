"""Schema of the ``dataset`` section: plain dataclasses, no data code.

Every key does something for at least one ``dataset.type``; ``sd_training.data.checks.validate_dataset_config``
rejects a key set (to a non-default value) for a type it does not apply to, naming the key and the type.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from ..fields import ConfigError, f


@dataclass
class TagParams:
    """Seed 000's metadata controls for tag datasets (a json ``tags`` list, an image-board ``score``)."""

    use_tags: bool = f(False, "build the caption from the json tag list instead of the caption member/column")
    tags_key: str = f("tags", "json field holding the sample's list of tags")
    blacklist_tags: List[str] = f([], "samples carrying any of these tags are skipped")
    non_caption_tags: List[str] = f([], "tags dropped from the caption (still used by the blacklist and scores)")
    replacements: Dict[str, str] = f({}, "substring -> replacement applied to every caption tag, in this order")
    tag_separator: str = f(", ", "string joining the tags into the caption")
    score_key: str = f("score", "json field holding the sample's score")
    abs_min_score: Optional[float] = f(None, "score units: skip samples scoring below this, before tag bonuses")
    min_score: Optional[float] = f(None, "score units: skip samples scoring below this after tag_bonus_scores")
    tag_bonus_scores: Dict[str, float] = f({}, "score units added per tag present, when checking min_score")
    score_tags: List[int] = f([], "score thresholds: a sample scoring above T gets the tag 'scrT' (highest T only)")


@dataclass
class DatasetParams:
    # --- where the data is -------------------------------------------------------------------------
    path: str = f(
        MISSING,
        "WebDataset/latents: shards in brace notation or a folder of .tar, several joined with '::' (local,"
        " http(s)://, pipe:); parquet: files/folders; CSV: files; folder: the dataset root",
    )
    sources: List[Dict[str, Any]] = f([], "a weighted mixture instead of path: a list of {path, weight, name, exhausted: restart|drop, and per-source " + ", ".join(("filters", "caption_key", "image_keys", "metadata_key", "image_column", "caption_column", "image_root", "cls_key")) + "}; each source's share of the selected samples is its weight")
    batch_size: int = f("${system.batch_size}", "images per device per micro-batch")
    workers: int = f("${system.workers}", "data-loading worker processes per device (0: load in the main process)")
    num_examples_to_see: int = f(
        "${experiment.num_examples_to_see}",
        "images to train on, all devices together (sets loader.steps_total; more than one epoch is logged)",
    )
    # --- images ------------------------------------------------------------------------------------
    resolution: int = f(512, "pixels: short side resized then cropped to resolution x resolution (bucket area; latents: must match the shards)")
    center_crop: bool = f(True, "center crop after resizing (False: random crop)")
    random_flip: float = f(0.0, "probability of a horizontal flip per sample")
    min_size: int = f(0, "pixels: skip samples whose source short side is smaller (0: keep all)")
    fast_decode: bool = f(True, "decode JPEGs at a reduced scale (PIL draft) when the source is >= 2x the target")
    aspect_buckets: bool = f(False, "group images into aspect-ratio buckets of ~resolution^2 pixels (no crop to square)")
    bucket_step: int = f(64, "pixels: bucket sides are multiples of this")
    max_aspect_ratio: float = f(2.0, "long side / short side of the most elongated bucket")
    # --- captions ----------------------------------------------------------------------------------
    caption_dropout: float = f(0.0, "probability of replacing a caption by '' (classifier-free guidance)")
    shuffle_tags: float = f(0.0, "probability of shuffling the caption's comma-separated tags (1.0: always)")
    keep_tags: int = f(0, "tags: the first N tags stay in place when shuffling")
    idx_to_prompt: Any = f(None, "classification datasets: {class index: prompt} or a JSON file of it (captions from cls)")
    cls_key: str = f("cls", "member (WebDataset) or column (parquet, CSV) holding the class index")
    tags: TagParams = f(TagParams, "tag-dataset controls (seed 000): blacklist, rewrites, scores")
    # --- metadata filters --------------------------------------------------------------------------
    filters: Dict[str, Any] = f({}, "metadata filters, e.g. {pwatermark: '<=0.5', status: 'in [ok, done]'}")
    # --- WebDataset members ------------------------------------------------------------------------
    caption_key: str = f("txt", "WebDataset: sample member holding the caption")
    image_keys: str = f("jpg;png;webp;jpeg", "WebDataset: sample members tried in order for the image, ';'-separated")
    metadata_key: str = f("json", "WebDataset: sample member holding the json metadata")
    # --- precomputed latent shards (scripts/precompute_latents.py) --------------------------------
    latent_sampling: str = f("sample", "latents: sample (mean + std * eps, fresh eps per sample and epoch) | mean (the posterior mean)")
    text_embeddings: bool = f(False, "latents: batches carry the stored text-encoder outputs (encoder_hidden_states) too")
    # --- table sources (parquet, CSV) --------------------------------------------------------------
    image_column: str = f("", "parquet/CSV: column with image bytes, a path or a URL ('': first of image, jpg, ...)")
    caption_column: str = f("", "parquet/CSV: column with the caption ('': first of caption, text, txt, title)")
    image_root: str = f("", "parquet/CSV: folder relative image paths are resolved against ('': the file's folder)")
    csv_separator: str = f(",", "CSV: field separator (a tab for .tsv)")
    allow_paths_outside_root: bool = f(False, "parquet/CSV/folder: image paths may lead outside image_root (or the file's folder): absolute, '..', symlinks")
    # --- local folders -----------------------------------------------------------------------------
    layout: str = f("auto", "folder: 'flat' (images/ + captions/), 'metadata' (metadata/**.json) or 'auto'")
    consider_every_nth: int = f(1, "folder: use only every n-th sample in sorted order (1: all)")
    samples_per_shard: int = f(0, "folder/CSV: samples per unit of work split across workers (0: automatic)")
    # --- order and distribution --------------------------------------------------------------------
    shuffle_buffer: int = f(1000, "samples held for shuffling per canonical reader (by default one per worker)")
    canonical_readers: int = f(0, "independent sample streams the run's batches are drawn from, fixed for the run: resuming on any rank count that divides them continues the same batches (0: ranks x workers of the first start)")
    resampled: bool = f(True, "draw shards with replacement (an infinite stream) instead of epochs over shards")
    io_timeout: float = f(30.0, "seconds without data before an http(s) or pipe: shard, or an image fetch, is given up (counted, skipped; a pipe: command is killed)")
    max_member_bytes: int = f(64 * 2**20, "tar members larger than this are skipped unread (counted): a decompression bomb cannot exhaust a worker")


@dataclass
class DatasetConfig:
    type: str = f("WebDataset", "the source: WebDataset | parquet | CSV | folder | latents (shards of precomputed VAE latents)")
    params: DatasetParams = f(DatasetParams, "parameters of the source")


# Canonical type names and the spellings accepted for them.
TYPE_ALIASES = {
    "webdataset": "WebDataset",
    "wds": "WebDataset",
    "parquet": "parquet",
    "csv": "CSV",
    "tsv": "CSV",
    "folder": "folder",
    "local": "folder",
    "latents": "latents",
    "latent": "latents",
}

_IMAGE_TYPES = {"WebDataset", "parquet", "CSV", "folder"}

# Keys that only mean something for some types (every other key applies to all types).
_ONLY_FOR = {
    "caption_key": {"WebDataset", "latents"},
    "image_keys": {"WebDataset"},
    "metadata_key": {"WebDataset", "latents"},
    "image_column": {"parquet", "CSV"},
    "caption_column": {"parquet", "CSV"},
    "image_root": {"parquet", "CSV"},
    "csv_separator": {"CSV"},
    "allow_paths_outside_root": {"parquet", "CSV", "folder"},
    "max_member_bytes": {"WebDataset", "latents"},
    "layout": {"folder"},
    "consider_every_nth": {"folder"},
    "samples_per_shard": {"folder", "CSV"},
    "cls_key": {"WebDataset", "parquet", "CSV", "latents"},
    "idx_to_prompt": {"WebDataset", "parquet", "CSV", "latents"},
    # Pixel work: latent shards were decoded, resized and cropped once, by the precompute script.
    "center_crop": _IMAGE_TYPES,
    "random_flip": _IMAGE_TYPES,
    "min_size": _IMAGE_TYPES,
    "fast_decode": _IMAGE_TYPES,
    "aspect_buckets": _IMAGE_TYPES,
    "bucket_step": _IMAGE_TYPES,
    "max_aspect_ratio": _IMAGE_TYPES,
    "latent_sampling": {"latents"},
    "text_embeddings": {"latents"},
}

LATENT_SAMPLINGS = ("sample", "mean")


class DatasetConfigError(ConfigError):
    """A dataset configuration that cannot work; the message names the key and what to do."""


def is_latent_type(name: str) -> bool:
    """``dataset.type`` names latent shards (any accepted spelling); False for unknown names too."""
    return TYPE_ALIASES.get(str(name).strip().lower()) == "latents"


# What an entry of dataset.params.sources may set: the mixture's own keys, and the per-source reading keys.
SOURCE_OWN_KEYS = ("path", "weight", "name", "exhausted")
SOURCE_PARAM_KEYS = ("filters", "caption_key", "image_keys", "metadata_key", "image_column", "caption_column",
                     "image_root", "cls_key")
EXHAUSTED = ("restart", "drop")


def canonical_type(name: str) -> str:
    key = str(name).strip().lower()
    if key not in TYPE_ALIASES:
        raise DatasetConfigError(
            f"dataset.type: unknown source {name!r}; choose one of WebDataset, parquet, CSV, folder, latents"
        )
    return TYPE_ALIASES[key]


def _defaults(cls) -> Dict[str, Any]:
    out = {}
    for fld in fields(cls):
        if fld.default_factory is not dataclasses.MISSING:
            out[fld.name] = fld.default_factory()
        else:
            out[fld.name] = fld.default
    return out


def _value(x: Any) -> Any:
    """Plain Python value of an OmegaConf node or a dataclass (for comparisons with defaults)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(x, (DictConfig, ListConfig)):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if is_dataclass(x) and not isinstance(x, type):
        return {fld.name: _value(getattr(x, fld.name)) for fld in fields(x)}
    return x


def plain_config(cfg) -> DatasetConfig:
    """A ``DatasetConfig`` dataclass with plain Python values (from an OmegaConf node, interpolations resolved)."""
    if isinstance(cfg, DictConfig):
        try:
            return OmegaConf.to_object(cfg)
        except InterpolationResolutionError as exn:
            raise DatasetConfigError(f"dataset: {exn}".splitlines()[0] + " (set it or the key it refers to)") from exn
    return cfg
