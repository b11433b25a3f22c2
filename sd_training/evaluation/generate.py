"""Images from prompts with a diffusers pipeline, split across ranks, resumable, with a progress bar.

The convention is that of the training run's eval images, so a folder made here and the eval
images a training run writes are interchangeable: image ``i`` uses prompt ``i % len(prompts)`` and a
CPU generator seeded ``seed + i`` (the same picture on any device and any number of ranks), is written
as ``{i:06d}.png`` with its prompt in ``{i:06d}.txt``, and rank ``r`` makes images r, r+W, r+2W, ...
Images already on disk are skipped, so a preempted job picks up where it stopped.

An edit family's pipeline (Flux Kontext, Qwen-Image-Edit, FLUX.2 with references) takes each prompt's
reference images (``calls``; read from a reference file by :mod:`.references`); the scripts may save them
beside each image as ``{i:06d}.ref.png``, ``{i:06d}.ref2.png`` ... (:func:`reference_path`), which
:func:`fid.image_files` leaves out of a score.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..outputs.export import eval_mode


def load_pipeline(folder: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """A ``StableDiffusionPipeline`` (or the class its model_index.json names) from a local folder. Components
    saved as absent (``[null, null]`` in model_index.json: an SD3 pipeline trained without T5) are passed as
    None, which diffusers requires for components that are not optional."""
    import os

    from diffusers import DiffusionPipeline

    from ..outputs.readers import read_json

    index = read_json(os.path.join(folder, "model_index.json"))  # bounded: an export folder may come from anywhere
    if not isinstance(index, dict):
        raise ValueError(f"{folder}/model_index.json is not a JSON object")
    absent = {k: None for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[:1] == [None]}
    # Loaded as saved, then cast: the dtype keyword of from_pretrained changed name across diffusers versions.
    pipe = DiffusionPipeline.from_pretrained(folder, **{"safety_checker": None, **absent}, requires_safety_checker=False,
                                             local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device, dtype)


def image_path(out: Path, i: int) -> Path:
    return Path(out) / f"{i:06d}.png"


REFERENCE_NAME = re.compile(r"\d{6}\.ref\d*\.png")  # what reference_path writes: not a generated image


def reference_path(out: Path, i: int, k: int) -> Path:
    """Where image ``i``'s ``k``-th reference (from 0) is saved beside it: ``{i:06d}.ref.png``, ``.ref2.png`` ..."""
    return Path(out) / f"{i:06d}.ref{k + 1 if k else ''}.png"


@torch.no_grad()
def generate_images(
    pipe, prompts: list[str], n: int, out: str | Path, seed: int = 0, steps: int = 25, guidance: float = 7.5,
    resolution: int | None = None, rank: int = 0, world_size: int = 1, batch_size: int = 8, progress: bool = True,
    calls: list[dict] | None = None, shown: list[list] | None = None,
) -> list[Path]:
    """Write this rank's share of ``n`` images to ``out``; returns the paths of its share (new or not).
    ``calls``: each prompt's extra keyword arguments of the pipeline (an edit family's reference images, one
    dict per prompt): then each image is generated on its own (one prompt's references per call); ``shown``:
    each prompt's reference images, saved beside each of its images (:func:`reference_path`)."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mine = list(range(rank, n, world_size))
    todo = [i for i in mine if not image_path(out, i).is_file()]
    size = dict(height=resolution, width=resolution) if resolution else {}
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), desc=f"generate (rank {rank})", unit="img",
               disable=not progress, position=0 if rank == 0 else None, leave=rank == 0)
    try:
        # Every module in eval mode (the denoiser, a UNet or a transformer; trained text encoders), restored after.
        with eval_mode(pipe):
            step = 1 if calls else batch_size
            for start in range(0, len(todo), step):
                idx = todo[start : start + step]
                texts = [prompts[i % len(prompts)] for i in idx]
                extra = calls[idx[0] % len(prompts)] if calls else {}
                images = pipe(  # the prompt by name: FLUX.2's pipelines take a conditioning image first
                    prompt=texts, num_inference_steps=steps, guidance_scale=guidance,
                    generator=[torch.Generator("cpu").manual_seed(seed + i) for i in idx], **size, **extra,
                ).images
                for i, text, im in zip(idx, texts, images):
                    path = image_path(out, i)
                    # The sidecar first and the image last, via a temporary name: an image on disk is complete.
                    path.with_suffix(".txt").write_text(text + "\n")
                    for k, ref in enumerate(shown[i % len(prompts)] if shown else []):
                        ref.save(reference_path(out, i, k), format="PNG")
                    tmp = path.with_name(path.name + ".tmp")
                    im.save(tmp, format="PNG")
                    tmp.replace(path)
                bar.update(len(idx))
    finally:
        bar.close()
    return [image_path(out, i) for i in mine]
