"""The ``dataset`` section: its schema (plain dataclasses, no data code) and its rules, checked once.

Every key does something for at least one ``dataset.type``; ``check_dataset`` rejects a key set (to a
non-default value) for a type it does not apply to, naming the key and the type. The data package adds
the checks that need its code (filters parse, ``idx_to_prompt`` loads): ``sd_training.data.checks``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from .fields import ConfigError, check_fields, f

# What an entry of dataset.params.sources may set: the mixture's own keys, and the per-source reading keys.
SOURCE_OWN_KEYS = ("path", "weight", "name", "exhausted")
SOURCE_PARAM_KEYS = ("filters", "caption_key", "image_keys", "metadata_key", "image_column", "caption_column",
                     "image_root", "cls_key", "mask_key", "mask_column", "reference_key", "reference_column")
EXHAUSTED = ("restart", "drop")


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
    abs_min_score: Optional[float] = f(None, "score units: skip samples scoring below this, before tag bonuses", ge=None)
    min_score: Optional[float] = f(None, "score units: skip samples scoring below this after tag_bonus_scores", ge=None)
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
    sources: List[Dict[str, Any]] = f([], "a weighted mixture instead of path: a list of {path, weight, name, exhausted: restart|drop, and per-source " + ", ".join(SOURCE_PARAM_KEYS) + "}; each source's share of the selected samples is its weight")
    batch_size: int = f("${system.batch_size}", "images per device per micro-batch", ge=1)
    workers: int = f("${system.workers}", "data-loading worker processes per device (0: load in the main process)")
    num_examples_to_see: int = f(
        "${experiment.num_examples_to_see}",
        "images to train on, all devices together (sets loader.steps_total; more than one epoch is logged)",
    )
    # --- images ------------------------------------------------------------------------------------
    resolution: int = f(512, "pixels: short side resized then cropped to resolution x resolution (bucket area; latents: must match the shards); a multiple of 8, at most 8192", ge=8, le=8192)
    center_crop: bool = f(True, "center crop after resizing (False: random crop)")
    random_flip: float = f(0.0, "probability of a horizontal flip per sample", le=1)
    min_size: int = f(0, "pixels: skip samples whose source short side is smaller (0: keep all)")
    fast_decode: bool = f(True, "decode JPEGs at a reduced scale (PIL draft) when the source is >= 2x the target")
    aspect_buckets: bool = f(False, "group images into aspect-ratio buckets of ~resolution^2 pixels (no crop to square)")
    bucket_step: int = f(64, "pixels: bucket sides are multiples of this (itself a multiple of 8)", ge=8)
    max_aspect_ratio: float = f(2.0, "long side / short side of the most elongated bucket", ge=1)
    # --- captions ----------------------------------------------------------------------------------
    caption_dropout: float = f(0.0, "probability of replacing a caption by '' (classifier-free guidance)", le=1)
    shuffle_tags: float = f(0.0, "probability of shuffling the caption's comma-separated tags (1.0: always)", le=1)
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
    latent_sampling: str = f("sample", "latents: sample: mean + std * eps, fresh eps per sample and epoch; mean: the posterior mean", choices=("sample", "mean"))
    text_embeddings: bool = f(False, "latents: batches carry the stored text-encoder outputs (encoder_hidden_states) too")
    # --- table sources (parquet, CSV) --------------------------------------------------------------
    image_column: str = f("", "parquet/CSV: column with image bytes, a path or a URL ('': first of image, jpg, ...)")
    caption_column: str = f("", "parquet/CSV: column with the caption ('': first of caption, text, txt, title)")
    image_root: str = f("", "parquet/CSV: folder relative image paths are resolved against ('': the file's folder)")
    csv_separator: str = f(",", "CSV: field separator (a tab for .tsv)")
    allow_paths_outside_root: bool = f(False, "parquet/CSV/folder: image paths may lead outside image_root (or the file's folder): absolute, '..', symlinks")
    # --- local folders -----------------------------------------------------------------------------
    layout: str = f("auto", "folder: flat: images/ + captions/; metadata: metadata/**.json; auto: whichever is there", choices=("auto", "flat", "metadata"))
    consider_every_nth: int = f(1, "folder: use only every n-th sample in sorted order (1: all)", ge=1)
    samples_per_shard: int = f(0, "folder/CSV: samples per unit of work split across workers (0: automatic)")
    # --- masked loss (sd_training/data/masks.py) ---------------------------------------------------
    masked_loss: bool = f(False, "weight the loss by a per-sample mask (WebDataset: member mask_key; parquet/CSV: column mask_column; folder: the sidecar NAME.<mask_key> beside NAME.jpg; or the alpha channel: mask_from_alpha), cropped, resized and flipped with the image: white trains fully, black not at all; samples without a mask train everywhere. Image data only (latent shards store no mask)")
    mask_key: str = f("mask.png", "masked_loss, WebDataset: the member holding the mask (KEY.mask.png); folder: the sidecar's suffix (NAME.mask.png beside NAME.jpg)")
    mask_column: str = f("mask", "masked_loss, parquet/CSV: the column holding the mask: image bytes, or a path resolved as image paths are (empty: no mask)")
    mask_from_alpha: bool = f(False, "masked_loss: the image's own alpha channel is its mask (opaque trains) instead of a member/column/sidecar; images without alpha train everywhere")
    unmasked_weight: float = f(0.0, "masked_loss: the least loss weight, weight = clamp(mask, unmasked_weight, 1) as OneTrainer (whose default is 0.1); 0: masked-out pixels train nothing (kohya)", le=1)
    mask_normalize: bool = f(False, "masked_loss: divide each sample's weights by their mean, so a small mask trains as strongly as a whole image (OneTrainer's normalize_masked_area_loss); false: the mean over all latent elements (kohya)")
    # --- reference images of edit training (sd_training/data/references.py) ------------------------
    references: int = f(0, "reference images per sample (edit training: Flux Kontext, Qwen-Image-Edit, FLUX.2 references): WebDataset members KEY.<reference_key>.<ext> then KEY.<reference_key>2.<ext> ...; parquet/CSV columns reference_column, reference_column2 ... (or one column holding a list); folder sidecars NAME.<reference_key>.<ext> beside NAME.jpg. A sample with fewer is skipped (missing_reference). 0: text-to-image data", ge=0, le=8)
    reference_key: str = f("ref", "references, WebDataset: the first reference is the member KEY.ref.<ext> (any image extension), the k-th KEY.ref<k>.<ext>; folder: the sidecars NAME.ref.<ext>, NAME.ref<k>.<ext>")
    reference_column: str = f("reference", "references, parquet/CSV: the column of the first reference (image bytes, HF's {bytes, path} struct, or a path resolved as image paths are), the k-th is <column><k>; or one column holding a list of them")
    reference_crop: str = f("aligned", "references: aligned: each reference goes through its target's crop, resize and flip (pixel-aligned pairs: Kontext, Qwen-Image-Edit; a reference of another aspect ratio is skipped, reference_aspect_mismatch); center: each reference is resized to cover the target's size on its own and center-cropped, flipped with the target (FLUX.2's subject/style references)", choices=("aligned", "center"))
    # --- order and distribution --------------------------------------------------------------------
    shuffle_buffer: int = f(1000, "samples held for shuffling per canonical reader (by default one per worker; 1: no shuffling)", ge=1)
    canonical_readers: int = f(0, "independent sample streams the run's batches are drawn from, fixed for the run: resuming on any rank count that divides them continues the same batches (0: ranks x workers of the first start)")
    resampled: bool = f(True, "draw shards with replacement (an infinite stream) instead of epochs over shards")
    io_timeout: float = f(30.0, "seconds without data before an http(s) or pipe: shard, or an image fetch, is given up (counted, skipped; a pipe: command is killed)", gt=0)
    max_member_bytes: int = f(64 * 2**20, "tar members larger than this are skipped unread (counted): a decompression bomb cannot exhaust a worker", ge=1)


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
ONLY_FOR = {
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
    "mask_key": {"WebDataset", "folder"},
    "mask_column": {"parquet", "CSV"},
    "reference_key": {"WebDataset", "folder"},
    "reference_column": {"parquet", "CSV"},
    "reference_crop": _IMAGE_TYPES,
}
# The masked-loss keys that mean something only with masked_loss on (latent shards refuse masked_loss itself).
MASK_KEYS = ("mask_key", "mask_column", "mask_from_alpha", "unmasked_weight", "mask_normalize")


class DatasetConfigError(ConfigError):
    """A dataset configuration that cannot work; the message names the key and what to do."""


def is_latent_type(name: str) -> bool:
    """``dataset.type`` names latent shards (any accepted spelling); False for unknown names too."""
    return TYPE_ALIASES.get(str(name).strip().lower()) == "latents"


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


def plain_value(x: Any) -> Any:
    """Plain Python value of an OmegaConf node or a dataclass (for comparisons with defaults)."""
    if OmegaConf.is_config(x):
        return OmegaConf.to_container(x, resolve=True)
    if is_dataclass(x) and not isinstance(x, type):
        return {fld.name: plain_value(getattr(x, fld.name)) for fld in fields(x)}
    return x


def plain_config(cfg) -> DatasetConfig:
    """A ``DatasetConfig`` dataclass with plain Python values (from an OmegaConf node, interpolations resolved)."""
    if isinstance(cfg, DictConfig):
        try:
            return OmegaConf.to_object(cfg)
        except InterpolationResolutionError as exn:
            raise DatasetConfigError(f"dataset: {exn}".splitlines()[0] + " (set it or the key it refers to)") from exn
    return cfg


def check_dataset(cfg) -> DatasetConfig:
    """The ``dataset`` section's rules (no data code): the type is known; no key is set (to a non-default
    value) for a type it does not apply to; every key's declared choices and range; the mixture's entries;
    tag controls only with ``tags.use_tags`` or the folder ``metadata`` layout; precomputed text
    embeddings only with captions used as stored. Raises ``DatasetConfigError`` naming the key; returns
    the plain config."""
    cfg = plain_config(cfg)
    kind = canonical_type(cfg.type)
    p = cfg.params
    defaults = _defaults(DatasetParams)
    check_mask_keys(kind, p, defaults)
    for key, types in ONLY_FOR.items():
        value = plain_value(getattr(p, key))
        if kind not in types and value != plain_value(defaults[key]):
            raise DatasetConfigError(
                f"dataset.params.{key}={value!r} does not apply to dataset.type={kind} "
                f"(it applies to {', '.join(sorted(types))}); remove it"
            )
    if p.path in (None, "", MISSING):
        raise DatasetConfigError("dataset.params.path is required: the shards, files or folder to train on")
    check_sources(p.sources)
    try:
        check_fields(cfg, "dataset.")
    except DatasetConfigError:
        raise
    except ConfigError as exn:
        raise DatasetConfigError(str(exn)) from None

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise DatasetConfigError(f"dataset.params.{key}={plain_value(getattr(p, key.split('.')[0]))!r}: {msg}")

    need(int(p.resolution) % 8 == 0, "resolution", "must be a multiple of 8 (the VAE downsamples by 8)")
    need(int(p.bucket_step) % 8 == 0, "bucket_step", "must be a multiple of 8 pixels")
    need(len([k for k in str(p.image_keys).split(";") if k.strip()]) > 0, "image_keys", "name at least one member")
    need(len(str(p.csv_separator)) == 1, "csv_separator", "must be one character")
    if p.text_embeddings:
        # A stored embedding is that of the caption as written; only dropout (to '') can be replayed on it.
        for key, on in (("shuffle_tags", float(p.shuffle_tags) > 0), ("tags.use_tags", bool(p.tags.use_tags)),
                        ("idx_to_prompt", plain_value(p.idx_to_prompt) is not None)):
            if on:
                raise DatasetConfigError(
                    f"dataset.params.{key} changes the caption, but dataset.params.text_embeddings=true uses the "
                    "embedding precomputed from the caption as stored: turn one of them off"
                )
    if int(p.resolution) % int(p.bucket_step) and p.aspect_buckets:
        raise DatasetConfigError(
            f"dataset.params.resolution={p.resolution} is not a multiple of bucket_step={p.bucket_step}"
        )
    tags = p.tags
    tag_layout = kind == "folder" and p.layout in ("metadata", "auto")
    if not tags.use_tags and not tag_layout:
        for key, default in _defaults(TagParams).items():
            if key != "use_tags" and plain_value(getattr(tags, key)) != plain_value(default):
                raise DatasetConfigError(
                    f"dataset.params.tags.{key} is set but tags are not used: set dataset.params.tags.use_tags=true "
                    "(or use dataset.type=folder with the metadata layout)"
                )
    if tags.use_tags and plain_value(p.idx_to_prompt) is not None:
        raise DatasetConfigError(
            "dataset.params.tags.use_tags and dataset.params.idx_to_prompt both choose the caption: keep one"
        )
    return cfg


def check_mask_keys(kind: str, p: DatasetParams, defaults: Dict[str, Any]) -> None:
    """Masked loss: image data only (a latent shard stores no mask, and its crop is fixed); its other keys
    only with ``masked_loss`` on (never silently ignored)."""
    if p.masked_loss and kind == "latents":
        raise DatasetConfigError(
            "dataset.params.masked_loss=true: latent shards store no mask (scripts/precompute_latents.py writes "
            "none), so the loss cannot be weighted; train on the images (dataset.type WebDataset, parquet, CSV or "
            "folder) or turn masked_loss off"
        )
    if not p.masked_loss:
        for key in MASK_KEYS:
            if plain_value(getattr(p, key)) != plain_value(defaults[key]):
                raise DatasetConfigError(f"dataset.params.{key}={plain_value(getattr(p, key))!r} only applies "
                                         "with dataset.params.masked_loss=true: set it, or remove the key")
        for n, entry in enumerate(p.sources or []):
            for key in set(MASK_KEYS) & set(entry if isinstance(entry, dict) else ()):
                raise DatasetConfigError(f"dataset.params.sources[{n}].{key} only applies with "
                                         "dataset.params.masked_loss=true: set it, or remove the key")


def check_sources(sources) -> None:
    """``dataset.params.sources``: each entry a mapping with a path, a positive weight, known keys only
    (its filters are parsed by the data package)."""
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
    if all(str(e.get("exhausted", "restart")) == "drop" for e in sources):
        raise DatasetConfigError("dataset.params.sources: every source has exhausted: drop, so the stream would "
                                 "end; let at least one restart")
