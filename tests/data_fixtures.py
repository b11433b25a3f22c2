"""Shared helpers for the data tests: a real CLIP tokenizer built offline, configs, tiny real shards."""

from __future__ import annotations

import functools
import io
import json
import os
import tarfile
import tempfile
from typing import Dict, Iterable, List, Optional

import numpy as np
from PIL import Image

from sd_training.data import DatasetConfig, build_train_loader


@functools.lru_cache(maxsize=1)
def tokenizer():
    from sd_training.families.components.clip import build_clip_tokenizer

    return build_clip_tokenizer(tempfile.mkdtemp(prefix="data_tests_tok_"))


def make_cfg(path: str, **params) -> DatasetConfig:
    """A resolved dataset config for tests (small defaults: 32 px, batch 4, no workers)."""
    cfg = DatasetConfig()
    p = cfg.params
    p.path = path
    p.batch_size = 4
    p.workers = 0
    p.num_examples_to_see = 1000
    p.resolution = 32
    p.shuffle_buffer = 8
    p.resampled = False
    typ = params.pop("type", None)
    if typ:
        cfg.type = typ
    for k, v in params.items():
        if k.startswith("tags."):
            setattr(p.tags, k[5:], v)
        else:
            assert hasattr(p, k), k
            setattr(p, k, v)
    return cfg


def loader(path: str, rank: int = 0, world_size: int = 1, seed: int = 0, **params):
    return build_train_loader(make_cfg(path, **params), tokenizer=tokenizer(), rank=rank, world_size=world_size, seed=seed)


def take(loader_or_iter, n: int) -> List[dict]:
    it = iter(loader_or_iter)
    return [next(it) for _ in range(n)]


def jpeg_bytes(w: int = 40, h: int = 40, colour=(200, 30, 30), quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def png_bytes(w: int = 40, h: int = 40, colour=(30, 200, 30), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), colour if mode == "RGB" else colour + (128,)).save(buf, format="PNG")
    return buf.getvalue()


def webp_bytes(w: int = 40, h: int = 40, colour=(30, 30, 200)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="WEBP", lossless=True)
    return buf.getvalue()


def write_tar(path: str, samples: Iterable[Dict[str, object]]) -> str:
    """A tar shard written with the stdlib (so tests can write broken members on purpose).

    Each sample is {"__key__": key, ext: bytes | str | dict}; dicts become json, str utf-8.
    """
    with tarfile.open(path, "w") as tar:
        for s in samples:
            key = s["__key__"]
            for ext, value in s.items():
                if ext == "__key__":
                    continue
                if isinstance(value, dict):
                    data = json.dumps(value).encode()
                elif isinstance(value, str):
                    data = value.encode("utf-8")
                else:
                    data = bytes(value)
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def simple_samples(n: int, start: int = 0, meta: Optional[callable] = None) -> List[Dict[str, object]]:
    out = []
    for i in range(start, start + n):
        s = {"__key__": f"s{i:05d}", "jpg": jpeg_bytes(48, 40, (i * 7 % 255, 100, 50)), "txt": f"caption {i}"}
        if meta is not None:
            s["json"] = meta(i)
        out.append(s)
    return out


def write_shards(folder: str, sizes: List[int], meta=None, prefix: str = "part", start: int = 0) -> str:
    """Shards with the given sample counts (keys s<start>, s<start+1>, ...); returns the brace pattern."""
    os.makedirs(folder, exist_ok=True)
    for k, n in enumerate(sizes):
        write_tar(os.path.join(folder, f"{prefix}-{k:04d}.tar"), simple_samples(n, start, meta))
        start += n
    return os.path.join(folder, f"{prefix}-{{0000..{len(sizes) - 1:04d}}}.tar")


def all_keys(batches: List[dict]) -> List[str]:
    return [k for b in batches for k in b["keys"]]


def assert_same_batches(a: List[dict], b: List[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["keys"] == y["keys"]
        assert x["captions"] == y["captions"]
        assert np.array_equal(x["pixel_values"].numpy(), y["pixel_values"].numpy())
        assert np.array_equal(x["input_ids"].numpy(), y["input_ids"].numpy())
