"""Image decoding and geometry: header probe, reduced-scale JPEG decode, resize, crop, flip.

The order matters for speed: the header (size, format) is read without decoding, so too-small images are
dropped for free and JPEGs much larger than the target are decoded at 1/2, 1/4 or 1/8 scale by libjpeg
(PIL ``draft``), which is several times faster than a full decode followed by a resize.
"""

from __future__ import annotations

import io
import warnings
from typing import NamedTuple, Optional, Tuple

import numpy as np
from PIL import Image


class ImageError(Exception):
    """An image that cannot be used; ``reason`` is the skip counter name."""

    def __init__(self, reason: str, msg: str):
        super().__init__(msg)
        self.reason = reason


def open_image(data: bytes) -> Image.Image:
    """Open (header only, nothing decoded yet). Images above PIL's ``MAX_IMAGE_PIXELS`` (~89 Mpx,
    a decompression-bomb guard) are refused instead of letting a worker allocate gigabytes."""
    if not data:
        raise ImageError("empty_image", "0 bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exn:
        raise ImageError("image_too_large", str(exn)) from exn
    except Exception as exn:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ValueError...
        raise ImageError("corrupt_image", f"cannot identify image ({exn})") from exn


EXIF_ORIENTATION = 0x0112
_TRANSPOSES = {
    2: [Image.Transpose.FLIP_LEFT_RIGHT], 3: [Image.Transpose.ROTATE_180], 4: [Image.Transpose.FLIP_TOP_BOTTOM],
    5: [Image.Transpose.TRANSPOSE], 6: [Image.Transpose.ROTATE_270], 7: [Image.Transpose.TRANSVERSE],
    8: [Image.Transpose.ROTATE_90],
}


def _orient(img: Image.Image, orientation: int) -> Image.Image:
    """Apply an EXIF orientation (1-8) to an image that no longer carries its EXIF (after convert)."""
    for op in _TRANSPOSES.get(orientation, []):
        img = img.transpose(op)
    return img


def cover_size(width: int, height: int, out_w: int, out_h: int) -> Tuple[int, int]:
    """Size of ``width x height`` scaled (aspect kept) to cover ``out_w x out_h`` exactly on one side."""
    scale = max(out_w / width, out_h / height)
    return max(out_w, round(width * scale)), max(out_h, round(height * scale))


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB; transparent pixels become white (what a viewer shows), not the black of a plain convert;
    16-bit and 32-bit greyscale rescaled to 8 bits (PIL's convert clips them: 16-bit PNGs became white)."""
    if img.mode == "RGB":
        img.load()
        return img
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or (img.mode == "I" and a.max() > 255) else 255.0
        if img.mode == "F":
            top = 1.0 if a.max() <= 1.0 else 255.0
        grey = np.clip(a / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


class Decoded(NamedTuple):
    """What :func:`decode_cropped` made. Sizes and positions are (height, width) / (y, x), as SDXL's
    micro-conditioning wants them.

    * ``pixels``: uint8 [out_h, out_w, 3];
    * ``original_size``: (height, width) of the source as shown (EXIF orientation applied), at full size:
      a JPEG decoded at reduced scale (``fast_decode``) still reports its full size;
    * ``crop_top_left``: (y, x) of the crop's top-left corner in the resized (cover-scaled) image, in
      pixels. With ``flip`` x is measured in the flipped resized image (``resized_w - x - out_w``, as
      diffusers' SDXL training example does): the crop's corner in the picture the model is shown.
    """

    pixels: np.ndarray
    original_size: Tuple[int, int]
    crop_top_left: Tuple[int, int]
    # The crop as fractions (x0, y0, x1, y1) of the picture as shown, before the flip, and the flip: what
    # :func:`crop_like` repeats on a mask of the picture's size.
    box: Tuple[float, float, float, float] = (0.0, 0.0, 1.0, 1.0)
    flipped: bool = False
    alpha: Optional[np.ndarray] = None  # ``keep_alpha``: uint8 [out_h, out_w], the alpha channel cropped alike


def shown_size(img: Image.Image) -> Tuple[int, int]:
    """(width, height) of ``img`` (from :func:`open_image`) as shown: swapped when its EXIF orientation
    turns it by 90 degrees. Reads the header only; raises :class:`ImageError` as a decode would."""
    width, height = img.size
    return (height, width) if _orientation(img) in (5, 6, 7, 8) else (width, height)


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation (1-8; 1: as stored) of ``img`` (from :func:`open_image`)."""
    if img.format not in ("JPEG", "TIFF", "WEBP", "PNG"):
        return 1
    try:
        return img.getexif().get(EXIF_ORIENTATION, 1)
    except Exception as exn:  # an unreadable EXIF block: as a failed decode (PIL raises many types)
        raise ImageError("corrupt_image", f"decode failed ({exn})") from exn


def decode_cropped(
    img: Image.Image,
    out_w: int,
    out_h: int,
    *,
    center_crop: bool,
    flip: bool,
    rng: Optional[np.random.Generator],
    fast_decode: bool = True,
    keep_alpha: bool = False,
) -> Decoded:
    """Decode ``img`` (from :func:`open_image`), resize to cover ``out_w x out_h``, crop, maybe flip.

    Returns the pixels (uint8 HxWx3) with the source's size and the crop's corner (see :class:`Decoded`).
    ``rng`` picks the random crop offset (``center_crop=False``): two draws, whatever is reported. The
    crop is taken in source coordinates and resized in one step (PIL ``resize(box=...)``): the same
    pixels as resizing the whole image and cropping, without computing the pixels that would be cropped
    away. ``keep_alpha``: the image's alpha channel (None without one) goes through the same geometry.
    """
    width, height = img.size
    alpha = None
    try:
        orientation = _orientation(img)
        turned = orientation in (5, 6, 7, 8)  # stored rotated by 90 degrees: width and height swap when shown
        shown_w, shown_h = (height, width) if turned else (width, height)
        if fast_decode and img.format == "JPEG":
            need_w, need_h = cover_size(shown_w, shown_h, out_w, out_h)
            if turned:
                need_w, need_h = need_h, need_w
            if need_w * 2 <= width:  # at least a 2x reduction is possible: let libjpeg do it (DCT scaling)
                img.draft("RGB", (need_w, need_h))  # picks the smallest 1/2^k scale still >= the request
        alpha = alpha_channel(img) if keep_alpha else None
        img = _to_rgb(img)
        if orientation != 1:  # the camera's EXIF orientation: train on the picture as it is shown
            img = _orient(img, orientation)
            alpha = _orient(alpha, orientation) if alpha is not None else None
    except ImageError:
        raise
    except Exception as exn:  # truncated or corrupt data shows up at decode time
        raise ImageError("corrupt_image", f"decode failed ({exn})") from exn
    rw, rh = cover_size(img.width, img.height, out_w, out_h)  # the resized size, before cropping
    if center_crop or rng is None:
        left, top = (rw - out_w) // 2, (rh - out_h) // 2
    else:
        left = int(rng.integers(0, rw - out_w + 1))
        top = int(rng.integers(0, rh - out_h + 1))
    sx, sy = img.width / rw, img.height / rh  # source pixels per output pixel
    box = (left * sx, top * sy, (left + out_w) * sx, (top + out_h) * sy)
    fractions = (left / rw, top / rh, (left + out_w) / rw, (top + out_h) / rh)
    if img.size != (out_w, out_h) or box != (0, 0, out_w, out_h):
        img = img.resize((out_w, out_h), Image.BICUBIC, box=box, reducing_gap=None)
    if flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
        left = rw - left - out_w  # the crop's corner in the flipped resized image (diffusers' SDXL example)
    arr = np.asarray(img, dtype=np.uint8)
    if arr.shape != (out_h, out_w, 3):  # defensive: PIL modes we did not foresee
        raise ImageError("corrupt_image", f"unexpected decoded shape {arr.shape}")
    out = Decoded(arr, (int(shown_h), int(shown_w)), (int(top), int(left)), fractions, bool(flip))
    return out._replace(alpha=crop_like(alpha, out)) if alpha is not None else out


def alpha_channel(img: Image.Image) -> Optional[Image.Image]:
    """The alpha channel ("L") of an image that has one (RGBA, LA, PA, a palette with transparency), else None."""
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (img.mode == "P" and "transparency" in img.info):
        return img.convert("RGBA").getchannel("A")
    return None


def crop_like(mask: Image.Image, decoded: Decoded) -> np.ndarray:
    """uint8 [out_h, out_w] (or [out_h, out_w, 3] of an RGB picture) of a picture of the source's shown aspect
    (a mask, an edit pair's reference; any scale: the crop is in fractions), cropped, resized (the same
    bicubic filter) and flipped as ``decoded``'s pixels."""
    w, h = mask.size
    x0, y0, x1, y1 = decoded.box
    out_h, out_w = decoded.pixels.shape[:2]
    mask = mask.resize((out_w, out_h), Image.BICUBIC, box=(x0 * w, y0 * h, x1 * w, y1 * h), reducing_gap=None)
    if decoded.flipped:
        mask = mask.transpose(Image.FLIP_LEFT_RIGHT)
    return np.array(mask, dtype=np.uint8)  # writable (torch's worker transfer converts it)


def decode_like(img: Image.Image, decoded: Decoded, fast_decode: bool = True) -> np.ndarray:
    """uint8 [out_h, out_w, 3] of another picture of the same framing as ``decoded``'s source (an edit pair's
    reference; from :func:`open_image`, any size of the same aspect) through ``decoded``'s crop box, bicubic
    resize and flip (:func:`crop_like`), turned by its own EXIF orientation first. A JPEG much larger than
    needed is decoded at reduced scale, as :func:`decode_cropped` does. Raises :class:`ImageError`."""
    out_h, out_w = decoded.pixels.shape[:2]
    x0, y0, x1, y1 = decoded.box
    try:
        orientation = _orientation(img)
        if fast_decode and img.format == "JPEG":
            # The whole picture at the scale where the crop box is out_w x out_h (the target's cover size).
            need_w, need_h = int(np.ceil(out_w / max(x1 - x0, 1e-6))), int(np.ceil(out_h / max(y1 - y0, 1e-6)))
            if orientation in (5, 6, 7, 8):
                need_w, need_h = need_h, need_w
            if need_w * 2 <= img.width:
                img.draft("RGB", (need_w, need_h))
        img = _to_rgb(img)
        if orientation != 1:
            img = _orient(img, orientation)
    except ImageError:
        raise
    except Exception as exn:  # truncated or corrupt data shows up at decode time
        raise ImageError("corrupt_image", f"decode failed ({exn})") from exn
    arr = crop_like(img, decoded)
    if arr.shape != (out_h, out_w, 3):  # defensive: PIL modes we did not foresee
        raise ImageError("corrupt_image", f"unexpected decoded shape {arr.shape}")
    return arr


def to_pixel_values(images: np.ndarray):
    """uint8 [B,H,W,3] -> uint8 tensor [B,3,H,W] (contiguous). Batches leave the loader workers as bytes
    (a quarter of float32's shared memory, pinned copies and host-to-device traffic); the consumer
    normalises them on its device with :func:`unit_range`."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous()


def unit_range(pixels):
    """Pixels as float32 in [-1, 1]: uint8 batches are scaled (x / 127.5 - 1, on the tensor's device);
    floating-point ones are taken as already in range."""
    import torch

    if pixels.dtype == torch.uint8:
        return pixels.float().div_(127.5).sub_(1.0)
    return pixels

