"""Exported artifacts: diffusers pipelines (loadable with ``from_pretrained``) and sample grids; and the
reading side's check of a pipeline's weights files before they are loaded (:func:`check_weights`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
from pathlib import Path

import torch
from PIL import Image

from ..config import ConfigError
from ..run.run_dir import replace_dir

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


def image_grid(images: list[Image.Image | None], cols: int) -> Image.Image:
    """The images row by row, ``cols`` per row, each in a cell of the first real image's size (None: a blank cell)."""
    w, h = next(im for im in images if im is not None).size
    rows = (len(images) + cols - 1) // cols
    grid = Image.new("RGB", (cols * w, rows * h), "white")
    for i, im in enumerate(images):
        if im is not None:
            grid.paste(im, ((i % cols) * w, (i // cols) * h))
    return grid


@torch.no_grad()
def sample_grid(
    pipe, prompts: list[str], per_prompt: int, seed: int, steps: int, guidance: float, resolution: int,
    device: torch.device, dtype: torch.dtype | None = None, calls: list[dict] | None = None,
    shown: list[list[Image.Image]] | None = None,
) -> Image.Image:
    """One row per prompt, ``per_prompt`` columns with seeds seed, seed+1, ... (fixed across steps).
    ``calls``: each prompt's extra keyword arguments of the pipeline (an edit family's reference images);
    ``shown``: each prompt's images shown before its outputs (its references), blank cells padding the rows
    so the outputs stay in the same columns.

    The generators are CPU generators so a grid is the same image on any device given the same weights.
    """
    pipe.set_progress_bar_config(disable=True)
    lead = max((len(row) for row in shown), default=0) if shown else 0
    images: list[Image.Image | None] = []
    with eval_mode(pipe):
        for i, prompt in enumerate(prompts):
            gens = [torch.Generator("cpu").manual_seed(seed + j) for j in range(per_prompt)]
            with inference_autocast(device, dtype):
                out = pipe(  # the prompt by name: FLUX.2's pipelines take a conditioning image first
                    prompt=[prompt] * per_prompt, height=resolution, width=resolution, num_inference_steps=steps,
                    guidance_scale=guidance, generator=gens, **(calls[i] if calls else {}),
                )
            if lead:
                images.extend([*shown[i], *[None] * (lead - len(shown[i]))])
            images.extend(out.images)
    return image_grid(images, lead + per_prompt)


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


# Bytes per element of safetensors' dtypes (sub-byte float types are left out: only their bounds are checked).
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a ``.safetensors`` file, read from its header only (no tensor data is read):
    a cut file, a header that does not parse, a tensor whose bytes lie outside the file or do not match
    its shape and dtype; None when it is whole. A flipped byte inside the tensor data is not seen
    (the format holds no checksum)."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        return f"holds {size} bytes: cut short (a safetensors file starts with an 8-byte header length)"
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > min(size - 8, _MAX_HEADER):
            return f"declares a {n:,}-byte header in a file of {size:,} bytes: cut short or garbled"
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return f"has a garbled header (not JSON: {str(e)[:100]})"
    if not isinstance(header, dict):
        return "has a garbled header (not a JSON object)"
    data, end = size - 8 - n, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = info["dtype"], info["shape"], info["data_offsets"]
            numel = math.prod(int(d) for d in shape)
            ok = isinstance(begin, int) and isinstance(stop, int) and 0 <= begin <= stop
        except (TypeError, KeyError, ValueError):
            return f"has a garbled header entry for '{str(name)[:100]}'"
        if not ok or (dtype in _ST_ITEMSIZE and numel * _ST_ITEMSIZE[dtype] != stop - begin):
            return f"has a garbled header: tensor '{str(name)[:100]}' ({dtype} {shape}) at bytes {begin}..{stop}"
        end = max(end, stop)
    if end > data:
        return f"is cut short: its header describes {end:,} bytes of tensors, the file holds {data:,}"
    return None


def check_weights(src: str, subfolder: str, what: str) -> Path | None:
    """Before a pipeline component is loaded from a local folder (``model.init_from``, ``model.ema.path``):
    its weights are there and whole (:func:`safetensors_problem` for each file, an index's shards
    present), else a ConfigError naming the file and the problem. ``src``: a pipeline root (the component
    in ``subfolder``) or the component's folder; a hub id is left to the hub's own checks. Returns the
    component folder checked, None for a hub id."""
    if not os.path.isdir(src):
        return None
    folder = Path(src) / subfolder if (Path(src) / subfolder).is_dir() else Path(src)
    files = sorted(folder.glob("*.safetensors"))
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ConfigError(f"'{what}': {index} cannot be read as a safetensors index ({str(e)[:100]}): copy the "
                              "pipeline again") from None
        for shard in sorted(shards):
            if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard in ("", ".", ".."):
                raise ConfigError(f"'{what}': {index} names {str(shard)[:100]!r}, not a file of its folder")
            if not (folder / shard).is_file():
                raise ConfigError(f"'{what}': {folder / shard} is missing ({index.name} lists it): copy the pipeline "
                                  "again")
    if not files and not list(folder.glob("*.bin")):
        raise ConfigError(f"'{what}': {folder} holds no weights file (diffusion_pytorch_model.safetensors): copy the "
                          "pipeline again or point the key at a complete one")
    for f in files:
        problem = safetensors_problem(f)
        if problem:
            raise ConfigError(f"'{what}': {f} {problem}. Copy the pipeline again or point the key at another one")
    return folder
