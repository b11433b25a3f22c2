"""One evaluation: a folder of generated images (or a pipeline that makes them) -> FID and CLIP score.

Every rank calls the same functions with the same arguments; each extracts features for its share
and the results are gathered (see ``fid.gather_rows``). Metric names carry the ``eval/`` prefix.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..outputs.export import read_prompts
from .clip_score import ClipScorer, prompts_for
from .fid import InceptionFeatures, compute_fid, image_files, reference_stats

log = logging.getLogger(__name__)


@dataclass
class EvalSettings:
    """What to compute and from which local files. FID needs ref_stats or ref_images; CLIP needs clip_*."""

    prompts: str | None = None  # prompt file (.txt / .csv): for generation, and CLIP when images lack .txt sidecars
    ref_stats: str | None = None  # .npz of reference FID statistics: read if it exists, else written from ref_images
    ref_images: str | None = None  # reference set: folder of images, or WebDataset shards (brace pattern / folder)
    ref_max_images: int | None = None  # images of the reference set used (None: all)
    clip_model: str | None = None  # open_clip model name (ViT-L-14, ...) or local-dir:PATH
    clip_pretrained: str | None = None  # local weights file of clip_model
    clip_config: str | None = None  # extra open_clip model config (.json) defining clip_model
    device: str = "cpu"  # device of Inception and CLIP
    batch_size: int = 32  # images per feature batch

    @property
    def wants_fid(self) -> bool:
        return bool(self.ref_stats or self.ref_images)

    @property
    def wants_clip(self) -> bool:
        return bool(self.clip_model)


def evaluate_images(files: list[Path], settings: EvalSettings, progress: bool = False) -> dict:
    """FID and CLIP score of the image files (all ranks pass the same list; the work is split)."""
    metrics: dict = {"eval/num_images": len(files)}
    device = torch.device(settings.device)
    if settings.wants_fid:
        extractor = InceptionFeatures(device, batch_size=settings.batch_size)
        ref = reference_stats(
            settings.ref_images, settings.ref_stats, extractor, settings.ref_max_images, device, progress
        )
        metrics["eval/fid"] = compute_fid(files, ref, extractor, progress)
        metrics["eval/fid_reference_images"] = ref.n
    if settings.wants_clip:
        if not settings.clip_pretrained:
            raise ValueError("CLIP score: clip_pretrained (a local weights file) is required")
        prompts = read_prompts(settings.prompts) if settings.prompts else None
        scorer = ClipScorer(
            settings.clip_model, settings.clip_pretrained, device, settings.clip_config, settings.batch_size
        )
        metrics["eval/clip_score"] = scorer.score(files, prompts_for(files, prompts))
    return metrics


def evaluate_folder(folder: str | os.PathLike, settings: EvalSettings, progress: bool = False) -> dict:
    return evaluate_images(image_files(folder), settings, progress)


def write_result(path: str | os.PathLike, result: dict) -> None:
    """Atomic JSON write (rank 0): a reader polling for the file never sees half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)
