"""Per-sample stages, cheapest first: ``select`` (metadata, filters, captions: no pixel is decoded) and
``process`` (image header, size checks, bucket, reduced-scale decode, resize/crop/flip, caption
augmentation), then ``collate`` (stack, tokenize). Each stage counts what it drops, by reason; any other
exception a stage raises on a sample is caught by the stream (:mod:`.stream`), which skips the sample and
counts it as ``sample_error:<ExceptionType>``.

Besides pixels and token ids, every image batch carries SDXL's micro-conditioning, all (height, width)
or (y, x) in pixels, int64 [B, 2] (families that do not use them ignore them):

* ``original_size``: the source image's size, from the metadata's ``original_height`` /
  ``original_width`` (img2dataset's json) when both are there, else the image's own (full, EXIF-turned)
  size;
* ``crop_top_left``: the corner of the crop in the resized (cover-scaled) image, measured in the
  flipped image for flipped samples (see :class:`.transforms.Decoded`);
* ``target_size``: the bucket the sample was resized to (the pixel tensor's H, W).

The tokenizer may be one tokenizer or a sequence of them (SDXL: CLIP ViT-L's then OpenCLIP bigG's):
the first gives ``input_ids``, the k-th (k >= 2) ``input_ids_k``, each padded/truncated to its own
``model_max_length`` with its own pad token."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .buckets import assign_bucket, make_buckets
from .captions import CaptionAugment, TagRules, decode_caption, load_idx_to_prompt, parse_cls
from .filters import parse_filters
from .masks import MaskSettings, collate_weights, open_mask
from .references import ReferenceSettings, collate_references
from .sources import read_image_path
from .stats import Stats
from .transforms import ImageError, crop_like, decode_cropped, open_image, shown_size, to_pixel_values


class SampleProcessor:
    """Turns raw samples (see :mod:`.sources`) into training samples. Picklable (goes to workers)."""

    def __init__(self, params, kind: str, tokenizer) -> None:
        self.filters = parse_filters(dict(params.filters or {}))
        self.source_filters = None  # a mixture: one filter list per source (set by build_train_loader)
        self.tag_rules = TagRules(params.tags)
        self.use_tags = bool(params.tags.use_tags)
        self.idx_to_prompt = load_idx_to_prompt(params.idx_to_prompt) if params.idx_to_prompt is not None else None
        self.min_size = int(params.min_size)
        self.resolution = int(params.resolution)
        self.center_crop = bool(params.center_crop)
        self.flip_p = float(params.random_flip)
        self.fast_decode = bool(params.fast_decode)
        self.masks = MaskSettings(params)
        self.refs = ReferenceSettings(params)  # edit training: each sample's reference images (references.py)
        # scripts/preview_data.py: batches also carry each sample's source name (``sources``), whether its
        # caption was dropped (``caption_dropped``) and its cropped mask or None (``masks``).
        self.preview = False
        self.timeout = float(params.io_timeout)
        self.buckets = (
            make_buckets(self.resolution, int(params.bucket_step), float(params.max_aspect_ratio))
            if params.aspect_buckets
            else [(self.resolution, self.resolution)]
        )
        sep = str(params.tags.tag_separator)
        self.captions = CaptionAugment(params.shuffle_tags, params.keep_tags, params.caption_dropout, separator=sep)
        self.tokenizers = as_tokenizers(tokenizer)
        self.tokenizer = self.tokenizers[0]  # the first: ``input_ids``
        self.max_lengths = tuple(int(t.model_max_length) for t in self.tokenizers)  # each pads to its own
        self.max_length = self.max_lengths[0]

    # -- stage 1: cheap checks on metadata and caption ---------------------------------------------
    def select(self, raw: Dict[str, Any], stats: Stats) -> Optional[Dict[str, Any]]:
        stats.add("samples_read")
        where = f"{raw['url']} sample {raw['key']!r}"
        if raw.get("error"):  # the reader already knows this sample is unusable
            reason, detail = raw["error"]
            stats.skip(reason, f"{where}: {detail}")
            return None
        meta = raw.get("meta")
        if meta is None and raw.get("meta_raw") is not None:
            try:
                meta = json.loads(bytes(raw["meta_raw"]).decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as exn:
                stats.skip("bad_json", f"{where}: unparsable json ({exn})")
                return None
            if not isinstance(meta, dict):
                stats.skip("bad_json", f"{where}: json is a {type(meta).__name__}, not an object")
                return None
        filters = self.source_filters[raw["src"]] if self.source_filters is not None else self.filters
        if filters:
            failed = None
            for flt in filters:  # evaluate all: each filter's pass rate is its own, not conditional
                ok = flt(meta)
                stats.add(f"filter/{flt.key}/checked")
                if ok:
                    stats.add(f"filter/{flt.key}/passed")
                elif failed is None:
                    failed = flt
            if failed is not None:
                stats.add(f"skipped/filter:{failed.key}")  # expected and frequent: counted, not logged
                return None
        payload = self.payload(raw, meta)
        if payload is None:
            stats.skip(self.missing_payload, f"{where}: no {self.missing_payload[len('missing_'):]} member/column")
            return None
        if self.refs.count:
            why = self.refs.missing(raw)
            if why is not None:
                stats.skip("missing_reference", f"{where}: {why}")
                return None
        tags = None
        caption = ""
        if self.use_tags or raw.get("tags_mode"):
            tags, reason = self.tag_rules.check(meta)
            if reason is not None:
                if reason in ("missing_tags", "missing_metadata", "missing_score"):
                    stats.skip(reason, f"{where}: {reason.replace('_', ' ')}")
                else:
                    stats.add(f"skipped/{reason}")  # a rule doing its job, like a filter
                return None
        elif self.idx_to_prompt is not None:
            if raw.get("cls") is None:
                stats.skip("missing_cls", f"{where}: no class index (cls) for idx_to_prompt")
                return None
            try:
                idx = parse_cls(raw["cls"])
            except (ValueError, UnicodeDecodeError, TypeError, OverflowError) as exn:
                stats.skip("bad_cls", f"{where}: class index unreadable ({exn})")
                return None
            if idx not in self.idx_to_prompt:
                stats.skip("unknown_cls", f"{where}: class {idx} is not in idx_to_prompt")
                return None
            caption = idx  # resolved to a prompt in process(), where the sample's generator lives
        else:
            if raw.get("caption") is None:
                stats.skip("missing_caption", f"{where}: no caption member/column")
                return None
            try:
                caption = decode_caption(raw["caption"])
            except UnicodeError as exn:
                stats.skip("bad_caption_encoding", f"{where}: caption is not UTF-8 ({exn})")
                return None
            except TypeError as exn:
                stats.skip("bad_caption_type", f"{where}: {exn}")
                return None
        return {
            "key": raw["key"],
            "url": raw["url"],
            **payload,
            "caption": caption,
            "tags": tags,
            "meta_size": meta_size(meta),
        }

    # What select() carries to process(), None when the sample lacks it (counted as ``missing_payload``).
    missing_payload = "missing_image"

    def payload(self, raw: Dict[str, Any], meta: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if raw.get("image") is None and not raw.get("image_path"):
            return None
        return {"image": raw.get("image"), "image_path": raw.get("image_path"), "mask": raw.get("mask"),
                "mask_path": raw.get("mask_path"), "references": raw.get("references") or []}

    # -- stage 2: image work ------------------------------------------------------------------------
    def process(self, s: Dict[str, Any], rng: np.random.Generator, stats: Stats) -> Optional[Dict[str, Any]]:
        where = f"{s['url']} sample {s['key']!r}"
        # Draw the sample's random numbers first, in a fixed order, whatever the settings.
        flip = rng.random() < self.flip_p
        crop_rng = np.random.default_rng(rng.integers(2**63))
        caption_rng = np.random.default_rng(rng.integers(2**63))
        data = s["image"]
        if data is None:
            try:
                data = read_image_path(s["image_path"], self.timeout)
            except Exception as exn:  # missing file, HTTP error, timeout: skip the sample
                stats.skip("image_unreadable", f"{where}: cannot read {s['image_path']} ({exn})")
                return None
        try:
            img = open_image(data)
            if min(img.size) < self.min_size:
                stats.add("skipped/too_small")  # a size filter doing its job: counted, not logged
                return None
            # The bucket of the picture as shown: a phone photo stored landscape with an EXIF turn is portrait.
            mask = self._open_mask(s, shown_size(img))  # before the decode: a bad mask costs no decode
            refs = (self.refs.open(s["references"], shown_size(img), read_image_path, self.timeout)
                    if self.refs.count else [])  # headers only, before the decode: a bad pair costs no decode
            bucket = self.buckets[0] if len(self.buckets) == 1 else assign_bucket(*shown_size(img), self.buckets)
            decoded = decode_cropped(
                img,
                bucket[0],
                bucket[1],
                center_crop=self.center_crop,
                flip=flip,
                rng=crop_rng,
                fast_decode=self.fast_decode,
                keep_alpha=self.masks.from_alpha,
            )
            references = self.refs.decode(refs, decoded, self.fast_decode)  # no random draw: the target's geometry
        except ImageError as exn:
            stats.skip(exn.reason, f"{where}: {exn}")
            return None
        mask = crop_like(mask, decoded) if mask is not None else decoded.alpha
        if mask is not None:
            stats.add("samples_masked")
        caption = s["caption"]
        if isinstance(caption, int):  # a class index
            prompts = self.idx_to_prompt[caption]
            caption = prompts[int(caption_rng.integers(len(prompts)))] if len(prompts) > 1 else prompts[0]
        caption, dropped = self.captions.augment(caption, s["tags"], caption_rng)
        return {
            "pixels": decoded.pixels,
            "mask": mask,  # uint8 [H, W] cropped like the pixels, or None (masked_loss: see masks.py)
            "references": references,  # uint8 [H, W, 3] each, through the pixels' geometry (references.py)
            "caption": caption,
            "caption_dropped": dropped,
            "key": s["key"],
            "bucket": bucket,  # (width, height), as buckets.py has them
            # SDXL's micro-conditioning, (height, width) and (y, x): plain int tuples (picklable).
            "original_size": s.get("meta_size") or decoded.original_size,
            "crop_top_left": decoded.crop_top_left,
            "target_size": (int(bucket[1]), int(bucket[0])),
        }

    def _open_mask(self, s: Dict[str, Any], shown: Tuple[int, int]):
        """The sample's mask member/column/sidecar ("L", checked against the image's shown size), or None."""
        data = s.get("mask")
        if data is None and s.get("mask_path"):
            try:
                data = read_image_path(s["mask_path"], self.timeout)
            except Exception as exn:  # a missing file, an HTTP error, a timeout: skip the sample
                raise ImageError("mask_unreadable", f"cannot read the mask {s['mask_path']} ({exn})") from exn
        return open_mask(data, shown) if data is not None else None

    # -- stage 3: batch ---------------------------------------------------------------------------------
    def collate(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        import torch

        captions = [s["caption"] for s in samples]
        batch = {
            "pixel_values": to_pixel_values(np.stack([s["pixels"] for s in samples])),
            "input_ids": self.tokenize(captions),
        }
        for k in range(1, len(self.tokenizers)):
            batch[f"input_ids_{k + 1}"] = self.tokenize(captions, k)
        for name in SIZE_FIELDS:
            batch[name] = torch.tensor([s[name] for s in samples], dtype=torch.int64).reshape(len(samples), 2)
        batch.update(captions=captions, keys=[s["key"] for s in samples], epochs=[s["epoch"] for s in samples])
        weights = collate_weights(samples, self.masks)
        if weights is not None:
            batch["loss_weight"], batch["zero_weight_samples"] = weights
        if self.refs.count:
            batch["reference_values"] = collate_references(samples)  # uint8 [B, R, 3, H, W]
        if self.preview:
            batch.update(caption_dropped=[bool(s["caption_dropped"]) for s in samples],
                         masks=[s["mask"] for s in samples])
        return batch

    def tokenize(self, captions: List[str], which: int = 0):
        """Token ids int64 [B, model_max_length] of tokenizer ``which`` (0: the first), padded and truncated
        to that tokenizer's ``model_max_length`` with its own pad token."""
        import torch

        ids = self.tokenizers[which](
            captions, padding="max_length", truncation=True, max_length=self.max_lengths[which], return_tensors="pt"
        ).input_ids
        return ids.to(torch.long)


# The micro-conditioning fields of an image sample and batch: (height, width) or (y, x), int64 [B, 2].
SIZE_FIELDS = ("original_size", "crop_top_left", "target_size")


def as_tokenizers(tokenizer) -> Tuple[Any, ...]:
    """One tokenizer, or a tuple/list of them (SDXL: two), as a non-empty tuple."""
    toks = tuple(tokenizer) if isinstance(tokenizer, (tuple, list)) else (tokenizer,)
    if not toks or any(t is None for t in toks):
        raise ValueError(f"data: tokenizer must be a tokenizer or a non-empty tuple/list of them, got {tokenizer!r}")
    return toks


def _positive_int(value: Any) -> Optional[int]:
    """``value`` as a positive int when it is one (json ints, integral floats, numpy ints), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value) if value > 0 else None
    if isinstance(value, (float, np.floating)) and np.isfinite(value) and float(value).is_integer() and value > 0:
        return int(value)
    return None


def meta_size(meta: Optional[Dict[str, Any]]) -> Optional[Tuple[int, int]]:
    """(height, width) of the source image from its metadata (img2dataset's ``original_height`` /
    ``original_width``), None unless both are positive integers."""
    if not isinstance(meta, dict):
        return None
    h, w = _positive_int(meta.get("original_height")), _positive_int(meta.get("original_width"))
    return (h, w) if h is not None and w is not None else None
