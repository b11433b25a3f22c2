"""Aspect-ratio buckets (seed 002, as in NovelAI / kohya / SimpleTuner): sizes of about the same pixel
area as ``resolution x resolution``, sides multiples of ``step``, aspect ratio up to ``max_ratio``.
An image goes to the bucket whose aspect ratio is closest (in log space); a batch never mixes buckets."""

from __future__ import annotations

import math
from typing import List, Tuple

Size = Tuple[int, int]  # (width, height) in pixels


def make_buckets(resolution: int, step: int = 64, max_ratio: float = 2.0) -> List[Size]:
    """Bucket sizes sorted by aspect ratio (tallest first); always contains (resolution, resolution)."""
    area = resolution * resolution
    sizes = {(resolution, resolution)}
    w = step
    while w <= resolution * max_ratio + 1e-9:
        h = (area // w) // step * step  # the largest multiple of step keeping w*h <= area
        if h >= step and max(w / h, h / w) <= max_ratio + 1e-9:
            sizes.add((w, h))
            sizes.add((h, w))
        w += step
    return sorted(sizes, key=lambda s: s[0] / s[1])


def target_sizes(resolution: int, aspect_buckets: bool, step: int = 64, max_ratio: float = 2.0) -> List[Size]:
    """The (width, height) a run's targets may have: the square ``resolution``, or every aspect bucket."""
    return make_buckets(resolution, step, max_ratio) if aspect_buckets else [(resolution, resolution)]


def assign_bucket(width: int, height: int, buckets: List[Size]) -> Size:
    """The bucket with the closest aspect ratio to a ``width x height`` image (ties: the larger area)."""
    target = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - target), -b[0] * b[1]))


def bucket_table(buckets: List[Size]) -> str:
    """One line for the start-up log: '512x512 (1.00) 448x576 (0.78) ...'."""
    return " ".join(f"{w}x{h} ({w / h:.2f})" for w, h in buckets)
