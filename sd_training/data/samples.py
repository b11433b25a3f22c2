"""Per-sample stages, cheapest first: ``select`` (metadata, filters, captions: no pixel is decoded) and
``process`` (image header, size checks, bucket, reduced-scale decode, resize/crop/flip, caption
augmentation), then ``collate`` (stack, tokenize). Each stage counts what it drops, by reason."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

import numpy as np

from .buckets import assign_bucket, make_buckets
from .captions import CaptionAugment, TagRules, decode_caption, load_idx_to_prompt, parse_cls
from .filters import parse_filters
from .sources import read_image_path
from .stats import Stats
from .transforms import ImageError, decode_resized, open_image, to_pixel_values


class SampleProcessor:
    """Turns raw samples (see :mod:`.sources`) into training samples. Picklable (goes to workers)."""

    def __init__(self, params, kind: str, tokenizer) -> None:
        self.filters = parse_filters(dict(params.filters or {}))
        self.tag_rules = TagRules(params.tags)
        self.use_tags = bool(params.tags.use_tags)
        self.idx_to_prompt = load_idx_to_prompt(params.idx_to_prompt) if params.idx_to_prompt is not None else None
        self.min_size = int(params.min_size)
        self.resolution = int(params.resolution)
        self.center_crop = bool(params.center_crop)
        self.flip_p = float(params.random_flip)
        self.fast_decode = bool(params.fast_decode)
        self.timeout = float(params.io_timeout)
        self.buckets = (
            make_buckets(self.resolution, int(params.bucket_step), float(params.max_aspect_ratio))
            if params.aspect_buckets
            else [(self.resolution, self.resolution)]
        )
        sep = str(params.tags.tag_separator)
        self.captions = CaptionAugment(params.shuffle_tags, params.keep_tags, params.caption_dropout, separator=sep)
        self.tokenizer = tokenizer
        self.max_length = int(tokenizer.model_max_length)

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
        if self.filters:
            failed = None
            for flt in self.filters:  # evaluate all: each filter's pass rate is its own, not conditional
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
            except (ValueError, UnicodeDecodeError, TypeError) as exn:
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
        return {"key": raw["key"], "url": raw["url"], **payload, "caption": caption, "tags": tags}

    # What select() carries to process(), None when the sample lacks it (counted as ``missing_payload``).
    missing_payload = "missing_image"

    def payload(self, raw: Dict[str, Any], meta: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if raw.get("image") is None and not raw.get("image_path"):
            return None
        return {"image": raw.get("image"), "image_path": raw.get("image_path")}

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
            width, height = img.size
            if min(width, height) < self.min_size:
                stats.add("skipped/too_small")  # a size filter doing its job: counted, not logged
                return None
            bucket = self.buckets[0] if len(self.buckets) == 1 else assign_bucket(width, height, self.buckets)
            pixels = decode_resized(
                img,
                bucket[0],
                bucket[1],
                center_crop=self.center_crop,
                flip=flip,
                rng=crop_rng,
                fast_decode=self.fast_decode,
            )
        except ImageError as exn:
            stats.skip(exn.reason, f"{where}: {exn}")
            return None
        caption = s["caption"]
        if isinstance(caption, int):  # a class index
            prompts = self.idx_to_prompt[caption]
            caption = prompts[int(caption_rng.integers(len(prompts)))] if len(prompts) > 1 else prompts[0]
        caption = self.captions(caption, s["tags"], caption_rng)
        return {"pixels": pixels, "caption": caption, "key": s["key"], "bucket": bucket}

    # -- stage 3: batch ---------------------------------------------------------------------------------
    def collate(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        captions = [s["caption"] for s in samples]
        batch = {
            "pixel_values": to_pixel_values(np.stack([s["pixels"] for s in samples])),
            "input_ids": self.tokenize(captions),
            "captions": captions,
            "keys": [s["key"] for s in samples],
            "epochs": [s["epoch"] for s in samples],
        }
        return batch

    def tokenize(self, captions: List[str]):
        import torch

        ids = self.tokenizer(
            captions, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        ).input_ids
        return ids.to(torch.long)
