"""Exported artifacts: diffusers pipelines (loadable with ``from_pretrained``) and sample grids."""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path

import torch
from PIL import Image

from .run_dir import replace_dir

log = logging.getLogger(__name__)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The bare model under DDP / torch.compile wrappers, so saved keys never carry their prefixes."""
    while True:
        if hasattr(module, "module"):  # DistributedDataParallel
            module = module.module
        elif hasattr(module, "_orig_mod"):  # torch.compile
            module = module._orig_mod
        else:
            return module


def export_pipeline(pipe, out: Path) -> Path:
    """Write a complete pipeline to ``out`` atomically: a crash mid-write leaves the previous one intact."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    pipe.save_pretrained(tmp, safe_serialization=True)
    replace_dir(tmp, out)
    return out


@contextlib.contextmanager
def eval_mode(pipe):
    """The pipeline's modules in eval mode while it samples, their modes restored after."""
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    was = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield pipe
    finally:
        for m, mode in zip(modules, was):
            m.train(mode)


def inference_autocast(device: torch.device, dtype: torch.dtype | None):
    """Sampling in the training precision: the frozen VAE may be stored in bf16/fp16 while the
    pipeline's latents are fp32, and autocast is also the fast path on GPUs. ``None``: fp32."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def image_grid(images: list[Image.Image], cols: int) -> Image.Image:
    w, h = images[0].size
    rows = (len(images) + cols - 1) // cols
    grid = Image.new("RGB", (cols * w, rows * h), "white")
    for i, im in enumerate(images):
        grid.paste(im, ((i % cols) * w, (i // cols) * h))
    return grid


@torch.no_grad()
def sample_grid(
    pipe, prompts: list[str], per_prompt: int, seed: int, steps: int, guidance: float, resolution: int,
    device: torch.device, dtype: torch.dtype | None = None,
) -> Image.Image:
    """One row per prompt, ``per_prompt`` columns with seeds seed, seed+1, ... (fixed across steps).

    The generators are CPU generators so a grid is the same image on any device given the same weights.
    """
    pipe.set_progress_bar_config(disable=True)
    images = []
    with eval_mode(pipe):
        for prompt in prompts:
            gens = [torch.Generator("cpu").manual_seed(seed + i) for i in range(per_prompt)]
            with inference_autocast(device, dtype):
                out = pipe(
                    [prompt] * per_prompt, height=resolution, width=resolution, num_inference_steps=steps,
                    guidance_scale=guidance, generator=gens,
                )
            images.extend(out.images)
    return image_grid(images, per_prompt)


def read_prompts(path: str) -> list[str]:
    """Prompts from a .txt (one per line) or a .csv (the 'caption' column, else the first column)."""
    import csv

    p = Path(path)
    if p.suffix.lower() == ".csv":
        with open(p, newline="") as fh:
            rows = list(csv.DictReader(fh))
        if not rows:
            raise ValueError(f"{p} has no rows")
        col = "caption" if "caption" in rows[0] else next(iter(rows[0]))
        prompts = [r[col].strip() for r in rows if r[col] and r[col].strip()]
    else:
        prompts = [line.strip() for line in p.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{p} holds no prompts")
    return prompts
