"""Masked loss, the data side: each sample's mask, cropped like its image, as a weight on the latent grid.

Where a mask comes from (``dataset.params.masked_loss: true``):

* WebDataset: the member ``KEY.<mask_key>`` (default ``KEY.mask.png``) of the sample's shard;
* parquet/CSV: the column ``mask_column`` (default ``mask``): image bytes, Hugging Face's ``{"bytes",
  "path"}`` struct, or a path resolved as image paths are (``image_root``, the outside-the-root rule);
* folder: the sidecar ``NAME.<mask_key>`` beside ``NAME.jpg`` (such files are not images of the set);
* ``mask_from_alpha: true``: the image's own alpha channel (any source), instead of the above.

A mask is a greyscale picture of the image *as shown* (its EXIF orientation applied, as a viewer shows it and
as a mask is painted over it): 255 trains fully, 0 not at all; a colour mask is read as its luma, a
transparent pixel as 0. A mask of another size than the image is a bad sample (``skipped/mask_size_mismatch``,
logged with its shard or file and key); an undecodable one ``skipped/corrupt_mask``; one whose file cannot
be read ``skipped/mask_unreadable``. A sample without a mask trains everywhere (weight 1); ``samples_masked``
counts those with one.

The mask goes through the image's geometry (:func:`.transforms.crop_like`: the same crop box, bicubic
resize and flip; aspect buckets included) and is averaged over each ``LATENT_DOWNSAMPLE`` x
``LATENT_DOWNSAMPLE`` cell (kohya's ``interpolate(mode="area")``) to the latent grid. The weight is then
OneTrainer's ``clamp(mask, unmasked_weight, 1)``, divided by its mean with ``mask_normalize``. A batch
holding any masked sample carries ``loss_weight`` float32 [B, 1, H/8, W/8]; the objective multiplies the
per-element loss by it before the mean (``objective.weight_elements``), so with the default
``unmasked_weight: 0`` a sample whose mask is all black contributes exactly zero loss and gradient, and
the batch's loss is still the mean over all its samples (kohya's reduction).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from PIL import Image

from .transforms import ImageError, _orient, _orientation, _to_rgb, open_image

# Pixels per latent cell: the VAE downsampling of every family here. A VAE with another factor is served by
# the objective, which resamples the weight to the latents' grid (area) when the sizes differ.
LATENT_DOWNSAMPLE = 8


class MaskSettings:
    """The masked-loss keys of ``dataset.params`` (picklable: goes to the loader workers)."""

    def __init__(self, params) -> None:
        self.enabled = bool(params.masked_loss)
        self.from_alpha = self.enabled and bool(params.mask_from_alpha)
        self.unmasked_weight = float(params.unmasked_weight)
        self.normalize = bool(params.mask_normalize)

    @property
    def reads_files(self) -> bool:
        """Sources look for a mask member / column / sidecar."""
        return self.enabled and not self.from_alpha


def source_mask_key(params) -> Optional[str]:
    """The member extension / sidecar suffix a source reads masks from, None when it reads none."""
    if not params.masked_loss or params.mask_from_alpha:
        return None
    return str(params.mask_key).strip().lower().lstrip(".")


def sidecar(image_path: str, suffix: Optional[str]) -> Optional[str]:
    """``NAME.<suffix>`` beside ``NAME.jpg`` when it exists (None: no mask for that image)."""
    if not suffix:
        return None
    path = os.path.splitext(image_path)[0] + "." + suffix
    return path if os.path.isfile(path) else None


def _grey(img: Image.Image) -> Image.Image:
    """A mask as "L": luma of colour, transparent pixels as 0, 16-bit greys rescaled (as images are)."""
    if img.mode == "L":
        img.load()
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (0, 0, 0, 255)), rgba).convert("L")
    return _to_rgb(img).convert("L")


def open_mask(data: bytes, shown: Tuple[int, int]) -> Image.Image:
    """The mask of ``data`` as "L", turned by its own EXIF orientation, checked against ``shown`` (the
    image's (width, height) as shown). Raises :class:`ImageError` (``corrupt_mask``, ``mask_size_mismatch``)."""
    try:
        img = open_image(data)
        size = img.size
        turned = _orientation(img) in (5, 6, 7, 8)
    except ImageError as exn:
        raise ImageError("corrupt_mask", f"mask: {exn}") from exn
    as_shown = (size[1], size[0]) if turned else size
    if as_shown != tuple(shown):
        hint = (" (masks are of the picture as shown: this image has an EXIF turn)"
                if (size[1], size[0]) == tuple(shown) else "")
        raise ImageError("mask_size_mismatch", f"the mask is {as_shown[0]}x{as_shown[1]} px, the image "
                         f"{shown[0]}x{shown[1]}{hint}: a mask must have its image's size")
    try:
        orientation = _orientation(img)
        grey = _grey(img)
        return _orient(grey, orientation) if orientation != 1 else grey
    except ImageError as exn:
        raise ImageError("corrupt_mask", f"mask: {exn}") from exn
    except Exception as exn:  # truncated or corrupt data shows up at decode time
        raise ImageError("corrupt_mask", f"mask: decode failed ({exn})") from exn


def latent_weight(mask: np.ndarray, settings: MaskSettings) -> np.ndarray:
    """float32 [h, w] weight of a uint8 [H, W] mask: area mean per latent cell, clamped, maybe normalised."""
    f = LATENT_DOWNSAMPLE
    height, width = mask.shape
    if height % f or width % f:
        raise ValueError(f"a {width}x{height} px mask does not tile the {f}x{f} px latent cells")
    grid = (mask.astype(np.float32) / 255.0).reshape(height // f, f, width // f, f).mean(axis=(1, 3))
    grid = np.clip(grid, settings.unmasked_weight, 1.0)
    if settings.normalize:
        mean = float(grid.mean())
        if mean > 0:  # an all-zero mask (unmasked_weight 0) stays zero: the sample trains nothing
            grid = grid / np.float32(mean)
    return grid.astype(np.float32)


def collate_weights(samples: List[Dict[str, Any]], settings: MaskSettings):
    """(``loss_weight`` float32 [B, 1, h, w], the number of its samples whose weight is 0 everywhere) of a batch
    holding a masked sample (weight 1 for the others), or None when no sample of it has a mask (the batch trains
    as without masked loss). The count is a plain int made here, in the loader, so the trainer can tell a
    batch that trains nothing without reading a tensor (``run.step_guards``)."""
    import torch

    masks = [s.get("mask") for s in samples]
    if not settings.enabled or all(m is None for m in masks):
        return None
    height, width = samples[0]["pixels"].shape[:2]
    f = LATENT_DOWNSAMPLE
    out = np.ones((len(samples), 1, height // f, width // f), np.float32)
    for i, m in enumerate(masks):
        if m is not None:
            out[i, 0] = latent_weight(m, settings)
    zero = int((out.reshape(len(samples), -1).max(axis=1) <= 0).sum())
    return torch.from_numpy(out), zero
