"""Captions: from a caption member, a class index (``idx_to_prompt``) or a tag list (seed 000), then
tag shuffling with keep-first-N (seed 002) and caption dropout for classifier-free guidance."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..config.dataset import DatasetConfigError

PACKAGE_METADATA = Path(__file__).resolve().parent.parent / "metadata"


def decode_caption(raw: Union[bytes, str]) -> str:
    """UTF-8 caption text, stripped; raises UnicodeError on invalid bytes and TypeError on anything but
    text or bytes (a parquet caption column of numbers or lists), both counted by the caller.

    A str may carry undecodable bytes as surrogates (CSV lines are read with ``surrogateescape``)."""
    if isinstance(raw, str):
        raw.encode("utf-8")  # raises UnicodeEncodeError on surrogates
        return raw.strip()
    if not isinstance(raw, (bytes, bytearray, memoryview)):  # bytes(10**12) would allocate a terabyte
        raise TypeError(f"caption is a {type(raw).__name__}, not text")
    return bytes(raw).decode("utf-8").strip()


def load_idx_to_prompt(value: Any) -> Dict[int, Tuple[str, ...]]:
    """``{class index: prompt or [prompts]}`` from a mapping or a JSON file path.

    A bare file name that does not exist relative to the working directory is looked up among the files
    this package ships (``imagenet_idx_to_prompt.json``). Several prompts for a class are drawn at random
    per sample.
    """
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if not path.exists() and (PACKAGE_METADATA / path.name).exists():
            path = PACKAGE_METADATA / path.name
        if not path.exists():
            raise DatasetConfigError(
                f"dataset.params.idx_to_prompt={str(value)!r}: no such file (shipped: "
                f"{', '.join(sorted(p.name for p in PACKAGE_METADATA.glob('*.json')))})"
            )
        try:
            with open(path, encoding="utf-8") as fh:
                value = json.load(fh)
        except (OSError, ValueError) as exn:
            raise DatasetConfigError(f"dataset.params.idx_to_prompt: cannot read {path}: {exn}") from exn
    if isinstance(value, list):
        value = dict(enumerate(value))
    if not isinstance(value, Mapping) or not value:
        raise DatasetConfigError("dataset.params.idx_to_prompt must be a non-empty mapping {class index: prompt}")
    out: Dict[int, Tuple[str, ...]] = {}
    for k, v in value.items():
        try:
            idx = int(k)
        except (TypeError, ValueError):
            raise DatasetConfigError(f"dataset.params.idx_to_prompt: key {k!r} is not a class index") from None
        prompts = (v,) if isinstance(v, str) else tuple(v) if isinstance(v, (list, tuple)) else None
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise DatasetConfigError(f"dataset.params.idx_to_prompt[{k!r}] must be a prompt or a list of prompts")
        out[idx] = prompts
    return out


def parse_cls(raw: Any) -> int:
    """Class index from a ``.cls`` member (bytes such as b'207\\n'), a string or an int."""
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).decode("ascii").strip()
    if isinstance(raw, str):
        raw = raw.strip()
    return int(raw)


class TagRules:
    """Seed 000's tag controls, applied to a metadata dict. ``check`` runs before decoding."""

    def __init__(self, tp) -> None:
        self.tags_key = str(tp.tags_key)
        self.score_key = str(tp.score_key)
        self.blacklist = set(tp.blacklist_tags or [])
        self.non_caption = set(tp.non_caption_tags or [])
        self.replacements = list(dict(tp.replacements or {}).items())
        self.separator = str(tp.tag_separator)
        self.abs_min_score = tp.abs_min_score
        self.min_score = tp.min_score
        self.bonus = {str(k): float(v) for k, v in dict(tp.tag_bonus_scores or {}).items()}
        self.score_tags = sorted((int(t) for t in (tp.score_tags or [])), reverse=True)
        self.needs_score = self.abs_min_score is not None or self.min_score is not None or bool(self.score_tags)

    def check(self, meta: Optional[Mapping[str, Any]]) -> Tuple[Optional[List[str]], Optional[str]]:
        """(caption tags, None) if the sample is kept, else (None, skip reason)."""
        if not isinstance(meta, Mapping):
            return None, "missing_metadata"
        tags = meta.get(self.tags_key)
        if isinstance(tags, str):
            tags = [t.strip() for t in tags.split(",") if t.strip()]
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            return None, "missing_tags"
        if self.blacklist and any(t in self.blacklist for t in tags):
            return None, "blacklisted_tag"
        score = None
        if self.needs_score:
            score = meta.get(self.score_key)
            if isinstance(score, bool) or not isinstance(score, (int, float)):
                return None, "missing_score"
            if self.abs_min_score is not None and score < self.abs_min_score:
                return None, "score_below_abs_min"
            if self.min_score is not None:
                bonus = sum(self.bonus.get(t, 0.0) for t in tags)
                if score + bonus < self.min_score:
                    return None, "score_below_min"
        out = []
        for t in tags:
            if t in self.non_caption:
                continue
            for old, new in self.replacements:
                t = t.replace(old, new)
            out.append(t)
        if score is not None:
            for threshold in self.score_tags:
                if score > threshold:
                    out.append(f"scr{threshold}")
                    break
        return out, None


def shuffle_tags(tags: Sequence[str], keep: int, rng: np.random.Generator) -> List[str]:
    """Shuffle all but the first ``keep`` tags."""
    head, tail = list(tags[:keep]), list(tags[keep:])
    if len(tail) > 1:
        order = rng.permutation(len(tail))
        tail = [tail[i] for i in order]
    return head + tail


class CaptionAugment:
    """Per-sample caption randomness, driven by the sample's own generator (so it replays exactly)."""

    def __init__(self, shuffle_p: float, keep: int, dropout: float, separator: str = ", ") -> None:
        self.shuffle_p = float(shuffle_p)
        self.keep = int(keep)
        self.dropout = float(dropout)
        self.separator = separator

    def __call__(self, caption: str, tags: Optional[List[str]], rng: np.random.Generator) -> str:
        return self.augment(caption, tags, rng)[0]

    def augment(self, caption: str, tags: Optional[List[str]], rng: np.random.Generator) -> Tuple[str, bool]:
        """(the caption as trained, whether caption dropout replaced it by '')."""
        # Draw both numbers always, so one setting never changes the randomness of another.
        u_drop, u_shuffle = rng.random(), rng.random()
        if tags is not None:
            if u_shuffle < self.shuffle_p:
                tags = shuffle_tags(tags, self.keep, rng)
            caption = self.separator.join(tags)
        elif u_shuffle < self.shuffle_p:
            parts = [p.strip() for p in caption.split(",")]
            caption = ", ".join(shuffle_tags([p for p in parts if p], self.keep, rng))
        if u_drop < self.dropout:
            return "", True
        return caption, False
