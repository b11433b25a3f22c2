"""Offline evaluation of generated images: FID (InceptionV3) and CLIP score (open_clip), from local weights.

    fid.py          Inception features, reference statistics (.npz cache), Frechet distance
    clip_score.py   CLIP score with an open_clip model from a local weights file
    generate.py     prompts -> images with a pipeline, split across ranks, resumable
    evaluate.py     a folder of images -> {"eval/fid": ..., "eval/clip_score": ...}
    async_eval.py   AsyncEvaluator: the same in a background process while training goes on
    __main__.py     python -m sd_training.evaluation (alone or under torchrun)

Every rank calls the same functions; work is split by rank and gathered when torch.distributed is
initialized.
"""

from .async_eval import AsyncEvaluator
from .clip_score import ClipScorer
from .evaluate import EvalSettings, evaluate_folder, evaluate_images
from .fid import FeatureStats, InceptionFeatures, compute_fid, frechet_distance, reference_stats

__all__ = [
    "AsyncEvaluator",
    "ClipScorer",
    "EvalSettings",
    "FeatureStats",
    "InceptionFeatures",
    "compute_fid",
    "evaluate_folder",
    "evaluate_images",
    "frechet_distance",
    "reference_stats",
]
