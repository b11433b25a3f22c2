"""A small, real, captioned dataset of coloured shapes, written as WebDataset shards (deterministic).

Each sample is a JPEG of one shape on a plain background, its caption ("a red circle on a blue
background") and json metadata (width, height, shape, colour, background). The quickstart trains on it;
the tests use it as a realistic stand-in for img2dataset output.

The edit set (:func:`write_edit_shards`, :func:`edit_sample`) pairs a shape on a background that is not
blue (the reference, ``KEY.ref.jpg``) with the same shape on blue (the target, ``KEY.jpg``) under the
instruction "make the background blue"; :func:`score_edit` reads a model's edit back from its pixels.
"""

from __future__ import annotations

import io
import json
import os
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from PIL import Image, ImageDraw

COLOURS: Dict[str, Tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (30, 60, 220),
    "yellow": (240, 210, 40),
    "purple": (130, 40, 170),
    "orange": (245, 130, 20),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle", "diamond")


RADIUS = (0.25, 0.4)  # the shape's half-size, as a fraction of the image side (drawn uniformly)
OFFSET = 0.1  # the largest shift of its centre, as a fraction of the image side


def draw_shape(shape: str, colour: str, background: str, width: int, height: int, rng: np.random.Generator,
               radius: Tuple[float, float] = RADIUS, offset: float = OFFSET) -> Image.Image:
    """One image: ``shape`` in ``colour`` on ``background``, size and position jittered by ``rng``
    (half-size uniform in ``radius`` x the side, centre shifted by up to ``offset`` x the side). The
    random draws do not depend on ``radius`` and ``offset``: other ranges move the same shapes."""
    img = Image.new("RGB", (width, height), COLOURS[background])
    d = ImageDraw.Draw(img)
    side = min(width, height)
    r = side * float(rng.uniform(radius[0], radius[1]))
    cx = width / 2 + float(rng.uniform(-offset, offset)) * width
    cy = height / 2 + float(rng.uniform(-offset, offset)) * height
    _outline(d, shape, cx, cy, r, r, COLOURS[colour])
    return img


def _outline(d: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, rx: float, ry: float, fill) -> None:
    """Fill ``shape`` centred on (cx, cy) with half-width ``rx`` and half-height ``ry``: the one geometry
    both the drawing (:func:`draw_shape`) and the reading (:func:`read_shape_image`) use."""
    if shape == "circle":
        d.ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=fill)
    elif shape == "square":
        d.rectangle([cx - rx, cy - ry, cx + rx, cy + ry], fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - ry), (cx - rx, cy + ry), (cx + rx, cy + ry)], fill=fill)
    elif shape == "diamond":
        d.polygon([(cx, cy - ry), (cx + rx, cy), (cx, cy + ry), (cx - rx, cy)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; one of {SHAPES}")


def a_or_an(word: str) -> str:
    """The article before ``word`` in a caption: "an orange", "a red" (the colour and word names here start
    with their sound's letter)."""
    return "an" if word[:1] in ("a", "e", "i", "o", "u") else "a"


def shape_sample(index: int, size, seed: int = 0, fmt: str = "jpg", radius: Tuple[float, float] = RADIUS,
                 offset: float = OFFSET):
    """(key, image bytes, caption, metadata) of sample ``index``; ``size`` is an int or (width, height);
    ``radius`` and ``offset``: see :func:`draw_shape`."""
    rng = np.random.default_rng([seed, index])
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    names = list(COLOURS)
    colour = names[int(rng.integers(len(names)))]
    background = names[int(rng.integers(len(names) - 1))]
    if background == colour:  # never the same colour twice: the shape must be visible
        background = names[-1]
    width, height = (size, size) if isinstance(size, int) else size
    img = draw_shape(shape, colour, background, width, height, rng, radius, offset)
    buf = io.BytesIO()
    if fmt == "jpg":
        img.save(buf, format="JPEG", quality=92)
    else:
        img.save(buf, format=fmt.upper())
    caption = f"{a_or_an(colour)} {colour} {shape} on {a_or_an(background)} {background} background"
    meta = {"width": width, "height": height, "shape": shape, "colour": colour, "background": background, "index": index}
    return f"{index:08d}", buf.getvalue(), caption, meta


def write_shapes_shards(
    out_dir: str,
    n_samples: int,
    n_shards: int,
    size: int = 64,
    seed: int = 0,
    *,
    prefix: str = "shapes",
    sizes: Optional[list] = None,
    radius: Tuple[float, float] = RADIUS,
    offset: float = OFFSET,
) -> str:
    """Write ``n_samples`` shape images into ``n_shards`` tar shards (plus ``sizes.json``).

    Returns the brace pattern, e.g. ``out_dir/shapes-{000000..000003}.tar``. ``sizes`` (a list of
    (width, height)) cycles through several image sizes instead of ``size x size``; ``radius`` and
    ``offset``: the shapes' size and position jitter (see :func:`draw_shape`).
    """
    return _write_shards(out_dir, n_samples, n_shards, prefix, lambda index: shape_sample(
        index, sizes[index % len(sizes)] if sizes else size, seed, radius=radius, offset=offset))


def word_sample(index: int, word: str, shape: str, colour: str, backgrounds: Sequence[str], size: int = 64,
                seed: int = 0, radius: Tuple[float, float] = RADIUS, offset: float = OFFSET):
    """(key, JPEG bytes, caption, metadata) of sample ``index`` of a made-up ``word`` that names one shape in
    one colour: "a dax on a white background" draws a ``colour`` ``shape`` on a background drawn from
    ``backgrounds``. Teaches a trained model a word it never saw (the metadata has the shape and colour,
    so :func:`read_shape_image` can check a drawing of it)."""
    if colour in backgrounds or shape not in SHAPES or not set(backgrounds) | {colour} <= set(COLOURS):
        raise ValueError(f"word {word!r}: need a shape of {SHAPES} and colours of {list(COLOURS)}, the shape's "
                         f"colour {colour!r} not among the backgrounds {list(backgrounds)}")
    rng = np.random.default_rng([seed, index])
    background = backgrounds[int(rng.integers(len(backgrounds)))]
    img = draw_shape(shape, colour, background, size, size, rng, radius, offset)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=92)
    meta = {"width": size, "height": size, "shape": shape, "colour": colour, "background": background,
            "word": word, "index": index}
    return f"{index:08d}", buf.getvalue(), f"{a_or_an(word)} {word} on {a_or_an(background)} {background} background", meta


def write_word_shards(out_dir: str, word: str, shape: str, colour: str, backgrounds: Sequence[str],
                      n_samples: int, n_shards: int = 1, size: int = 64, seed: int = 0, *,
                      radius: Tuple[float, float] = RADIUS, offset: float = OFFSET) -> str:
    """:func:`word_sample` images in shards named after the word (``out_dir/dax-000000.tar``...), plus
    ``sizes.json``; returns their brace pattern."""
    return _write_shards(out_dir, n_samples, n_shards, word, lambda index: word_sample(
        index, word, shape, colour, backgrounds, size, seed, radius, offset))


def _write_shards(out_dir: str, n_samples: int, n_shards: int, prefix: str, sample) -> str:
    """``sample(index)`` -> (key, bytes, caption, metadata) for every index, split into ``n_shards`` shards
    (or a dict of the sample's tar members, ``__key__`` included, for other member names)."""
    import webdataset as wds

    if n_shards < 1 or n_samples < n_shards:
        raise ValueError(f"need 1 <= n_shards <= n_samples, got {n_shards} shards for {n_samples} samples")
    os.makedirs(out_dir, exist_ok=True)
    counts = {}
    for k in range(n_shards):
        lo, hi = k * n_samples // n_shards, (k + 1) * n_samples // n_shards
        name = f"{prefix}-{k:06d}.tar"
        with wds.TarWriter(os.path.join(out_dir, name)) as sink:
            for index in range(lo, hi):
                out = sample(index)
                if not isinstance(out, dict):
                    key, data, caption, meta = out
                    out = {"__key__": key, "jpg": data, "txt": caption, "json": meta}
                sink.write(out)
        counts[name] = hi - lo
    with open(os.path.join(out_dir, "sizes.json"), "w") as fh:
        json.dump(counts, fh, indent=1)
    return os.path.join(out_dir, f"{prefix}-{{{0:06d}..{n_shards - 1:06d}}}.tar")


def _template(shape: str, box: Tuple[float, float, float, float], width: int, height: int) -> np.ndarray:
    """Boolean mask of ``shape`` drawn as :func:`draw_shape` draws it, filling the box (x0, y0, x1, y1)."""
    img = Image.new("L", (width, height), 0)
    x0, y0, x1, y1 = box
    _outline(ImageDraw.Draw(img), shape, (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2, 255)
    return np.asarray(img) > 127


def nearest_colour(rgb) -> str:
    """The name of the dataset colour nearest to ``rgb`` (Euclidean distance in RGB)."""
    return min(COLOURS, key=lambda n: sum((float(a) - b) ** 2 for a, b in zip(rgb, COLOURS[n])))


def read_shape_image(image) -> Dict[str, object]:
    """Read a shapes image back (a generated sample, or a model's drawing of a shapes caption).

    Returns ``{"background", "colour", "shape", "iou"}``: the background is the median of the 4-pixel
    border ring; the shape is the set of pixels farther from the background than half the distance of the
    farthest 10% of pixels; its colour is that region's median; the shape is the one of :data:`SHAPES`
    whose outline, drawn in the region's bounding box, overlaps it most (``iou``: that overlap; a drawing
    with no distinct region, or one smaller than 2% of the image, reads as shape ``"none"``).
    Colours are named by :func:`nearest_colour`.
    """
    px = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, dtype=np.float64)
    h, w = px.shape[:2]
    ring = np.concatenate([px[:4].reshape(-1, 3), px[-4:].reshape(-1, 3), px[:, :4].reshape(-1, 3),
                           px[:, -4:].reshape(-1, 3)])
    bg = np.median(ring, axis=0)
    dist = np.sqrt(((px - bg) ** 2).sum(-1))
    far = float(np.quantile(dist, 0.9))
    mask = dist > far / 2
    out: Dict[str, object] = {"background": nearest_colour(bg), "colour": None, "shape": "none", "iou": 0.0}
    if far < 40 or mask.mean() < 0.02:  # nothing stands out from the background
        return out
    out["colour"] = nearest_colour(np.median(px[mask], axis=0))
    ys, xs = np.nonzero(mask)
    box = (float(xs.min()), float(ys.min()), float(xs.max()), float(ys.max()))
    ious = {}
    for shape in SHAPES:
        t = _template(shape, box, w, h)
        ious[shape] = float((t & mask).sum() / max(1, (t | mask).sum()))
    out["shape"] = max(ious, key=ious.get)
    out["iou"] = ious[out["shape"]]
    return out


def masked_square_sample(index: int, size, seed: int = 0, alpha: bool = False):
    """(key, PNG bytes, caption, metadata, mask PNG bytes) of a red square on a plain background, placed off
    centre, and its exact mask (255 on the square, 0 elsewhere): what masked-loss tests check alignment on.
    ``size``: an int or (width, height). ``alpha``: the image is RGBA with the mask as its alpha channel."""
    rng = np.random.default_rng([seed, index, 0x3A5C])
    width, height = (size, size) if isinstance(size, int) else size
    names = [n for n in COLOURS if n != "red"]
    background = names[int(rng.integers(len(names)))]
    side = int(min(width, height) * float(rng.uniform(0.25, 0.4)))
    x0 = int(rng.integers(0, width - side + 1))
    y0 = int(rng.integers(0, height - side + 1))
    mask = Image.new("L", (width, height), 0)
    ImageDraw.Draw(mask).rectangle([x0, y0, x0 + side - 1, y0 + side - 1], fill=255)
    img = Image.new("RGB", (width, height), COLOURS[background])
    img.paste(COLOURS["red"], (x0, y0, x0 + side, y0 + side))
    if alpha:
        img.putalpha(mask)
    buf, mbuf = io.BytesIO(), io.BytesIO()
    img.save(buf, format="PNG")
    mask.save(mbuf, format="PNG")
    meta = {"width": width, "height": height, "square": [x0, y0, side], "background": background, "index": index}
    return f"{index:08d}", buf.getvalue(), f"a red square on {a_or_an(background)} {background} background", meta, mbuf.getvalue()


def write_masked_shards(out_dir: str, n_samples: int, n_shards: int, sizes=(64,), seed: int = 0, *,
                        prefix: str = "masked") -> str:
    """:func:`masked_square_sample` images in shards with their masks as ``KEY.mask.png`` members (the
    masked-loss default), cycling through ``sizes`` (ints or (width, height)); returns the brace pattern."""

    def members(index: int) -> dict:
        key, data, caption, meta, mask = masked_square_sample(index, sizes[index % len(sizes)], seed)
        return {"__key__": key, "png": data, "txt": caption, "json": meta, "mask.png": mask}

    return _write_shards(out_dir, n_samples, n_shards, prefix, members)


# --------------------------------------------------------------------------------------------------
# Paired (edit) samples: "make the background blue"
# --------------------------------------------------------------------------------------------------

EDIT_CAPTION = "make the background blue"
EDIT_TARGET_BACKGROUND = "blue"
REFERENCE_MEMBERS = ("ref", "ref2", "ref3", "ref4", "ref5", "ref6", "ref7", "ref8")  # dataset.params.reference_key's


class EditPair(NamedTuple):
    """One paired sample of :func:`edit_sample`: the source(s) and the target share the shape's geometry."""

    key: str
    references: List[Image.Image]  # the first is "the" source; the others the same shape on other backgrounds
    target: Image.Image  # the same shape, colour and place on blue
    caption: str
    shape: str
    colour: str
    backgrounds: List[str]  # each reference's background
    mask: np.ndarray  # bool [H, W]: the shape's pixels (the same in every picture of the pair)


def edit_sample(index: int, size, seed: int = 0, references: int = 1, radius: Tuple[float, float] = RADIUS,
                offset: float = OFFSET) -> EditPair:
    """Sample ``index`` of the edit set: a shape in a colour on a background that is not blue (the reference
    images), and the same shape, colour and place on blue (the target). ``size``: an int or (width, height).
    Held-out pairs for a measure are indices the shards do not hold (or another ``seed``)."""
    if not 1 <= references <= len(REFERENCE_MEMBERS):
        raise ValueError(f"references={references}: 1 to {len(REFERENCE_MEMBERS)} reference images per sample")
    rng = np.random.default_rng([seed, index, 0xED17])
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    colours = [n for n in COLOURS if n != EDIT_TARGET_BACKGROUND]  # a blue shape would vanish on the target
    colour = colours[int(rng.integers(len(colours)))]
    others = [n for n in colours if n != colour]
    backgrounds = [others[int(i)] for i in rng.permutation(len(others))[:references]]  # distinct, never blue
    geometry = int(rng.integers(2**63))  # one draw: every picture of the pair puts the shape in the same place
    width, height = (size, size) if isinstance(size, int) else size

    def draw(background: str) -> Image.Image:
        return draw_shape(shape, colour, background, width, height, np.random.default_rng(geometry), radius, offset)

    target = draw(EDIT_TARGET_BACKGROUND)
    mask = np.any(np.asarray(target) != np.asarray(COLOURS[EDIT_TARGET_BACKGROUND], np.uint8), axis=-1)
    return EditPair(f"{index:08d}", [draw(b) for b in backgrounds], target, EDIT_CAPTION, shape, colour,
                    backgrounds, mask)


def _jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=92)
    return buf.getvalue()


def edit_members(pair: EditPair, index: int) -> dict:
    """The tar members of one :class:`EditPair`: ``KEY.jpg`` (target), ``KEY.ref.jpg``, ``KEY.ref2.jpg``...
    (references), ``KEY.txt`` (the instruction) and ``KEY.json``."""
    width, height = pair.target.size
    meta = {"width": width, "height": height, "shape": pair.shape, "colour": pair.colour,
            "background": pair.backgrounds[0], "reference_backgrounds": pair.backgrounds,
            "target_background": EDIT_TARGET_BACKGROUND, "index": index}
    out = {"__key__": pair.key, "jpg": _jpeg(pair.target), "txt": pair.caption, "json": meta}
    for name, ref in zip(REFERENCE_MEMBERS, pair.references):
        out[f"{name}.jpg"] = _jpeg(ref)
    return out


def write_edit_shards(out_dir: str, n_samples: int, n_shards: int, size=64, references: int = 1, seed: int = 0,
                      *, prefix: str = "edit") -> str:
    """:func:`edit_sample` pairs in ``n_shards`` tar shards (plus ``sizes.json``), members as
    :func:`edit_members`; returns the brace pattern (``out_dir/edit-{000000..000003}.tar``)."""
    return _write_shards(out_dir, n_samples, n_shards, prefix,
                         lambda index: edit_members(edit_sample(index, size, seed, references), index))


def score_edit(image, pair: EditPair) -> Dict[str, object]:
    """How well ``image`` (a model's output for ``pair``'s reference and instruction) did the edit, read from
    its pixels against the pair's shape mask: ``background`` (the colour named from the median outside the
    shape, eroded by a pixel band so edges do not count), ``colour`` (the same inside the shape), and
    ``ok``: the background is blue and the shape kept its colour."""
    px = np.asarray(image.convert("RGB").resize(pair.target.size, Image.BICUBIC), dtype=np.float64)
    inside, outside = _eroded(pair.mask), _eroded(~pair.mask)
    background = nearest_colour(np.median(px[outside], axis=0)) if outside.any() else None
    colour = nearest_colour(np.median(px[inside], axis=0)) if inside.any() else None
    return {"background": background, "colour": colour,
            "ok": background == EDIT_TARGET_BACKGROUND and colour == pair.colour}


def _eroded(mask: np.ndarray, band: int = 2) -> np.ndarray:
    """``mask`` shrunk by ``band`` pixels (an edge pixel mixes both colours after a resize or a JPEG)."""
    out = mask.copy()
    for _ in range(band):
        out[1:] &= mask[:-1]
        out[:-1] &= mask[1:]
        out[:, 1:] &= mask[:, :-1]
        out[:, :-1] &= mask[:, 1:]
        mask = out.copy()
    return out
