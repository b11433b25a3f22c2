"""Local folders (seed 000's two layouts). A unit is a chunk of files in sorted order.

``flat``::

    root/images/1.png        root/captions/1.txt     (sub-folders allowed: images/a/2.jpg <-> captions/a/2.txt)

  With no ``images/`` folder, captions are looked up next to the images (``root/x.jpg`` + ``root/x.txt``,
  kohya's layout).

``metadata``::

    root/metadata/**/N.json  {"tags": [...], "score": 55, "path": "images/287/2877648.png", ...}

  ``path`` is relative to the root; captions are built from the tags (``dataset.params.tags``), and the
  whole json is the metadata the filters see. ``consider_every_nth`` keeps every n-th json in sorted order.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..config.dataset import DatasetConfigError
from .masks import sidecar, source_mask_key
from .references import sidecar_pattern, sidecar_references, source_reference_key
from .sources import Source, outside_root_error
from .stats import Stats, describe_error, error_reason
from .tables import auto_chunk

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def _walk(folder: str, suffixes, but: Optional[str] = None, refs=None) -> List[str]:
    """Paths relative to ``folder``, sorted, of files ending with ``suffixes`` (and not with ``but``, nor
    matching the reference sidecars' pattern ``refs``)."""
    out = []
    for d, dirs, files in os.walk(folder):
        dirs.sort()
        for f in files:
            if f.lower().endswith(suffixes) and not (but and f.lower().endswith(but)) and not (refs and refs.search(f)):
                out.append(os.path.relpath(os.path.join(d, f), folder))
    return sorted(out)


class FolderSource(Source):
    def __init__(self, spec: str, params):
        root = os.path.abspath(spec)
        if not os.path.isdir(root):
            raise DatasetConfigError(f"dataset.params.path: {spec!r} is not a folder (dataset.type=folder)")
        layout = str(params.layout)
        if layout == "auto":
            layout = "metadata" if os.path.isdir(os.path.join(root, "metadata")) else "flat"
        self.root, self.layout = root, layout
        self.allow_outside = bool(params.allow_paths_outside_root)
        # masked_loss: NAME.<mask_key> beside NAME.jpg is the image's mask, not an image of the set
        self.mask_key = source_mask_key(params)
        masks = "." + self.mask_key if self.mask_key else None
        # edit training: NAME.ref.<ext>, NAME.ref2.<ext>... beside NAME.jpg are its references, not images
        self.reference_key, self.references = source_reference_key(params), int(params.references)
        refs = sidecar_pattern(self.reference_key)
        if layout == "metadata":
            meta_dir = os.path.join(root, "metadata")
            if not os.path.isdir(meta_dir):
                raise DatasetConfigError(f"dataset.params.layout=metadata: {root} has no metadata/ folder")
            items: List[Any] = [os.path.join("metadata", p) for p in _walk(meta_dir, (".json",))]
        else:
            img_dir = os.path.join(root, "images")
            if os.path.isdir(img_dir):
                cap_dir = os.path.join(root, "captions")
                items = [
                    (os.path.join("images", p), os.path.join("captions", os.path.splitext(p)[0] + ".txt"), os.path.splitext(p)[0])
                    for p in _walk(img_dir, IMAGE_SUFFIXES, masks, refs)
                ]
                if not os.path.isdir(cap_dir):
                    raise DatasetConfigError(f"dataset.params.path: {root} has images/ but no captions/ folder")
            else:
                items = [(p, os.path.splitext(p)[0] + ".txt", os.path.splitext(p)[0])
                         for p in _walk(root, IMAGE_SUFFIXES, masks, refs)]
        n_every = int(params.consider_every_nth)
        items = items[::n_every]
        if not items:
            raise DatasetConfigError(f"dataset.params.path: no {'metadata json' if layout == 'metadata' else 'image'} found in {root}")
        chunk = auto_chunk(len(items), int(params.samples_per_shard))
        units = [tuple(items[k : k + chunk]) for k in range(0, len(items), chunk)]
        super().__init__(name=spec, units=units, num_samples=len(items))

    def describe(self, unit) -> str:
        first = unit[0] if isinstance(unit[0], str) else unit[0][0]
        return f"{self.root}/{first} (+{len(unit) - 1} more)"

    def read(self, unit: Tuple[Any, ...], stats: Stats) -> Iterator[Dict[str, Any]]:
        for item in unit:
            if self.layout == "metadata":
                yield self._metadata_sample(item)
            else:
                yield self._flat_sample(*item)

    def _flat_sample(self, image_rel: str, caption_rel: str, key: str) -> Dict[str, Any]:
        caption: Optional[bytes] = None
        try:
            with open(os.path.join(self.root, caption_rel), "rb") as fh:
                caption = fh.read()
        except OSError:
            caption = None  # counted as missing_caption by the select stage
        return {
            "key": key,
            "url": self.root,
            "image": None,
            "image_path": os.path.join(self.root, image_rel),
            "caption": caption,
            "meta": None,
            "cls": None,
            "mask_path": sidecar(os.path.join(self.root, image_rel), self.mask_key),
            "references": sidecar_references(os.path.join(self.root, image_rel), self.reference_key, self.references),
        }

    def _metadata_sample(self, json_rel: str) -> Dict[str, Any]:
        key = os.path.splitext(json_rel)[0]
        base = {"key": key, "url": os.path.join(self.root, json_rel)}
        try:
            with open(os.path.join(self.root, json_rel), "rb") as fh:
                meta = json.loads(fh.read().decode("utf-8"))
        except (OSError, ValueError, UnicodeDecodeError) as exn:
            return {**base, "error": ("bad_json", f"unreadable metadata ({exn})")}
        except Exception as exn:  # RecursionError (json nested too deep), MemoryError...
            return {**base, "error": (error_reason(exn), f"unreadable metadata ({describe_error(exn)})")}
        if not isinstance(meta, dict) or not isinstance(meta.get("path"), str):
            return {**base, "error": ("missing_image", "metadata has no 'path' of an image")}
        image_path = os.path.join(self.root, meta["path"])
        error = outside_root_error(image_path, self.root, self.allow_outside)
        if error:
            return {**base, "error": error}
        return {
            **base,
            "image": None,
            "image_path": image_path,
            "caption": None,
            "meta": meta,
            "cls": None,
            "tags_mode": True,
            "mask_path": sidecar(image_path, self.mask_key),
            "references": sidecar_references(image_path, self.reference_key, self.references),
        }
