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


def make_pipeline(models, unet: torch.nn.Module, vae: torch.nn.Module | None = None, for_export: bool = False):
    """A StableDiffusionPipeline of the run's components with ``unet`` (and ``vae``, when the VAE is trained).

    ``for_export``: the frozen VAE and text encoder in fp32 as loaded from their sources (a bf16 run
    keeps them in bf16 for speed; an export must not round them)."""
    from diffusers import StableDiffusionPipeline

    from .text_encoders import text_encoder_for_pipeline

    if vae is None:
        vae = models.full_precision("vae") if for_export else models.vae
    text_encoder = unwrap(models.text_encoder)
    if for_export and not any(p.requires_grad for p in text_encoder.parameters()):
        text_encoder = models.full_precision("text_encoder")
    return StableDiffusionPipeline(
        vae=unwrap(vae),
        text_encoder=text_encoder_for_pipeline(text_encoder),
        tokenizer=models.tokenizer,
        unet=unwrap(unet),
        scheduler=models.inference_scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


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
    """The pipeline's UNet and text encoders in eval mode while it samples, their modes restored after."""
    modules = [m for m in (getattr(pipe, n, None) for n in ("unet", "text_encoder", "text_encoder_2")) if m is not None]
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


def _grid(images: list[Image.Image], cols: int) -> Image.Image:
    w, h = images[0].size
    rows = (len(images) + cols - 1) // cols
    grid = Image.new("RGB", (cols * w, rows * h), "white")
    for i, im in enumerate(images):
        grid.paste(im, ((i % cols) * w, (i // cols) * h))
    return grid


@torch.no_grad()
def reconstruction_grid(vae, pixels: torch.Tensor) -> Image.Image:
    """Top row: the images; bottom row: the VAE's reconstructions (posterior mean, decoded)."""
    was_training = vae.training
    vae.eval()
    try:
        x = pixels.to(vae.dtype)
        rec = vae.decode(vae.encode(x).latent_dist.mode()).sample
    finally:
        vae.train(was_training)
    to_img = lambda t: Image.fromarray(((t.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy())  # noqa: E731
    images = [to_img(t) for t in pixels] + [to_img(t) for t in rec]
    return _grid(images, len(pixels))


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
    return _grid(images, per_prompt)


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
