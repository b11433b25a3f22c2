"""Reference images of edit training, the data side: where each sample's references come from, how they are
checked, decoded through the target's geometry and batched.

Where the references come from (``dataset.params.references: R``, R > 0; the first is named ``ref``, the k-th
``ref<k>``, from ``reference_key`` / ``reference_column``):

* WebDataset: the members ``KEY.ref.<ext>``, ``KEY.ref2.<ext>``... of the sample (any image extension of
  :data:`IMAGE_EXTENSIONS`, the first found in that order);
* parquet/CSV: the columns ``reference``, ``reference2``... (image bytes, Hugging Face's ``{"bytes", "path"}``
  struct, or a path resolved as image paths are: ``image_root``, the outside-the-root rule), or one
  ``reference`` column holding a list of them (parquet);
* folder: the sidecars ``NAME.ref.<ext>``, ``NAME.ref2.<ext>``... beside ``NAME.jpg`` (such files are not
  images of the set).

A raw sample (:mod:`.sources`) carries ``references``: a list of R entries, each ``(bytes, path)`` (one of the
two set) or None where that reference is absent.

Every sample must have its R references: one absent is skipped as ``missing_reference``, one that cannot be
decoded ``corrupt_reference``, one whose file cannot be read ``reference_unreadable``, and (``reference_crop:
aligned``) one of another aspect ratio than its target (by more than :data:`ASPECT_TOLERANCE`)
``reference_aspect_mismatch``; each logged with its shard or file and key.

Geometry (``reference_crop``): ``aligned`` repeats the target's crop box (in fractions of the picture as
shown), bicubic resize and flip on each reference (:func:`.transforms.decode_like`): a pixel of the reference
lands where the same pixel of the target does, aspect buckets included; ``center`` resizes each reference to
cover the target's size on its own, crops its centre and flips it with the target. Neither draws a random
number: the target's draws (crop, flip, caption) are those of a run without references, so resume and masked
loss keep their streams. Batches carry ``reference_values`` uint8 [B, R, 3, H, W] (H, W: ``pixel_values``').
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..config.dataset import DatasetConfigError
from .transforms import Decoded, ImageError, decode_cropped, decode_like, open_image, shown_size

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")
# Aspect ratios of a pair that differ by less than this are one ratio (a side rounded to a multiple of 8 or
# 16 by the tool that made the pair moves a 1024 px picture's ratio by up to 1.6%; 1% lets a 1-px rounding of
# small pictures through and refuses any real other framing).
ASPECT_TOLERANCE = 0.01

# (bytes, path): one reference as a source read it (one of the two set); None: the sample has no such reference.
RawReference = Optional[Tuple[Optional[bytes], Optional[str]]]


def reference_names(base: str, count: int) -> List[str]:
    """The names of ``count`` references from ``base``: ``ref``, ``ref2``, ``ref3``..."""
    return [base] + [f"{base}{k}" for k in range(2, count + 1)]


def source_reference_key(params) -> Optional[str]:
    """The member / sidecar base name references are read from (``ref``), None when none are read."""
    if not int(params.references):
        return None
    return str(params.reference_key).strip().lower().strip(".")


def tar_references(members: Dict[str, Any], key: Optional[str], count: int) -> List[RawReference]:
    """The references of one tar sample (its members by extension): ``KEY.ref.<ext>``, ``KEY.ref2.<ext>``..."""
    if not key:
        return []
    out: List[RawReference] = []
    for name in reference_names(key, count):
        data = next((members[f"{name}.{ext}"] for ext in IMAGE_EXTENSIONS if f"{name}.{ext}" in members), None)
        out.append((data, None) if data is not None else None)
    return out


def sidecar_references(image_path: str, key: Optional[str], count: int) -> List[RawReference]:
    """The sidecars ``NAME.ref.<ext>``, ``NAME.ref2.<ext>``... beside ``NAME.<ext>`` that exist."""
    if not key:
        return []
    stem = os.path.splitext(image_path)[0]
    out: List[RawReference] = []
    for name in reference_names(key, count):
        path = next((p for p in (f"{stem}.{name}.{ext}" for ext in IMAGE_EXTENSIONS) if os.path.isfile(p)), None)
        out.append((None, path) if path else None)
    return out


def sidecar_pattern(key: Optional[str]) -> Optional["re.Pattern"]:
    """The file names of reference sidecars (``x.ref.jpg``, ``x.ref2.png``): not images of a folder set."""
    if not key:
        return None
    return re.compile(rf"\.{re.escape(key)}\d*\.({'|'.join(IMAGE_EXTENSIONS)})$", re.IGNORECASE)


def table_reference_columns(columns: Sequence[str], params, where: str) -> List[str]:
    """The columns references are read from: ``reference``, ``reference2``... as far as they exist ([] without
    references). The first must exist; a table whose first column holds lists needs no others."""
    count = int(params.references)
    if not count:
        return []
    names = reference_names(str(params.reference_column), count)
    if names[0] not in columns:
        raise DatasetConfigError(f"dataset.params.reference_column={names[0]!r} (dataset.params.references={count}): "
                                 f"{where} has no such column (columns: {list(columns)})")
    return [c for c in names if c in columns]


def table_cells(row: Dict[str, Any], cols: Sequence[str], count: int) -> List[Any]:
    """The reference cells of one row, ``count`` of them (None where absent): one list-valued first column, or
    one cell per column."""
    if not cols:
        return []
    first = row.get(cols[0])
    if isinstance(first, (list, tuple, np.ndarray)):
        cells = list(first)
    else:
        cells = [row.get(c) for c in cols]
    return (cells + [None] * count)[:count]


class ReferenceSettings:
    """The reference keys of ``dataset.params`` (picklable: goes to the loader workers)."""

    def __init__(self, params) -> None:
        self.count = int(params.references)
        self.crop = str(params.reference_crop)
        self.names = reference_names(str(params.reference_key), self.count)

    def missing(self, raw: Dict[str, Any]) -> Optional[str]:
        """Why the raw sample lacks a reference (the first absent one named), None when it has all."""
        refs = raw.get("references") or []
        for k in range(self.count):
            if k >= len(refs) or refs[k] is None:
                return f"no reference {k + 1} of {self.count} ({self.names[k]} member/column/sidecar)"
        return None

    def open(self, refs: Sequence[RawReference], shown: Tuple[int, int], read, timeout: float) -> list:
        """The references opened (headers only), checked against the target's ``shown`` (width, height).
        ``read(path, timeout)`` reads a path's bytes. Raises :class:`ImageError` with the reference's reason."""
        out = []
        for k, (data, path) in enumerate(refs[: self.count]):
            name = self.names[k]
            if data is None:
                try:
                    data = read(path, timeout)
                except Exception as exn:  # a missing file, an HTTP error, a timeout: skip the sample
                    raise ImageError("reference_unreadable",
                                     f"cannot read the reference {name} {path} ({exn})") from exn
            try:
                img = open_image(data)
                size = shown_size(img)
            except ImageError as exn:
                raise ImageError("corrupt_reference", f"reference {name}: {exn}") from exn
            if self.crop == "aligned" and abs(size[0] * shown[1] / (size[1] * shown[0]) - 1) > ASPECT_TOLERANCE:
                raise ImageError("reference_aspect_mismatch", f"reference {name} is {size[0]}x{size[1]} px, its "
                                 f"target {shown[0]}x{shown[1]}: reference_crop=aligned needs one aspect ratio "
                                 "(reference_crop=center resizes each reference on its own)")
            out.append(img)
        return out

    def decode(self, images: list, decoded: Decoded, fast_decode: bool) -> List[np.ndarray]:
        """uint8 [H, W, 3] of each opened reference through the target's geometry (no random draw)."""
        out_h, out_w = decoded.pixels.shape[:2]
        out = []
        for name, img in zip(self.names, images):
            try:
                if self.crop == "aligned":
                    out.append(decode_like(img, decoded, fast_decode))
                else:
                    out.append(decode_cropped(img, out_w, out_h, center_crop=True, flip=decoded.flipped, rng=None,
                                              fast_decode=fast_decode).pixels)
            except ImageError as exn:
                raise ImageError("corrupt_reference", f"reference {name}: {exn}") from exn
        return out


def collate_references(samples: List[Dict[str, Any]]):
    """``reference_values`` uint8 [B, R, 3, H, W] of a batch's samples (each with R references)."""
    import torch

    stacked = np.stack([np.stack(s["references"]) for s in samples])  # [B, R, H, W, 3]
    return torch.from_numpy(stacked).permute(0, 1, 4, 2, 3).contiguous()
