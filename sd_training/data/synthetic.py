"""A small, real, captioned dataset of coloured shapes, written as WebDataset shards (deterministic).

Each sample is a JPEG of one shape on a plain background, its caption ("a red circle on a blue
background") and json metadata (width, height, shape, colour, background). The quickstart trains on it;
the tests use it as a realistic stand-in for img2dataset output.
"""

from __future__ import annotations

import io
import json
import os
from typing import Dict, Optional, Tuple

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


def draw_shape(shape: str, colour: str, background: str, width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """One image: ``shape`` in ``colour`` on ``background``, size and position jittered by ``rng``."""
    img = Image.new("RGB", (width, height), COLOURS[background])
    d = ImageDraw.Draw(img)
    side = min(width, height)
    r = side * float(rng.uniform(0.25, 0.4))
    cx = width / 2 + float(rng.uniform(-0.1, 0.1)) * width
    cy = height / 2 + float(rng.uniform(-0.1, 0.1)) * height
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    elif shape == "diamond":
        d.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; one of {SHAPES}")
    return img


def shape_sample(index: int, size, seed: int = 0, fmt: str = "jpg"):
    """(key, image bytes, caption, metadata) of sample ``index``; ``size`` is an int or (width, height)."""
    rng = np.random.default_rng([seed, index])
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    names = list(COLOURS)
    colour = names[int(rng.integers(len(names)))]
    background = names[int(rng.integers(len(names) - 1))]
    if background == colour:  # never the same colour twice: the shape must be visible
        background = names[-1]
    width, height = (size, size) if isinstance(size, int) else size
    img = draw_shape(shape, colour, background, width, height, rng)
    buf = io.BytesIO()
    if fmt == "jpg":
        img.save(buf, format="JPEG", quality=92)
    else:
        img.save(buf, format=fmt.upper())
    article = "an" if colour[0] in "aeiou" else "a"
    caption = f"{article} {colour} {shape} on a {background} background"
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
) -> str:
    """Write ``n_samples`` shape images into ``n_shards`` tar shards (plus ``sizes.json``).

    Returns the brace pattern, e.g. ``out_dir/shapes-{000000..000003}.tar``. ``sizes`` (a list of
    (width, height)) cycles through several image sizes instead of ``size x size``.
    """
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
                sz = sizes[index % len(sizes)] if sizes else size
                key, data, caption, meta = shape_sample(index, sz, seed)
                sink.write({"__key__": key, "jpg": data, "txt": caption, "json": meta})
        counts[name] = hi - lo
    with open(os.path.join(out_dir, "sizes.json"), "w") as fh:
        json.dump(counts, fh, indent=1)
    return os.path.join(out_dir, f"{prefix}-{{{0:06d}..{n_shards - 1:06d}}}.tar")
