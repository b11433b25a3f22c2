"""The memory plan printed at start-up: per GPU, what the weights, gradients, optimizer state and EMA of
the trained module take, and what the frozen components take, under each strategy, so a user sees
before the first step whether a model fits in 24, 40 or 80 GB.

Counted from the modules as built (exact bytes of the tensors), not estimated from a model name.
Activations (what autograd keeps for the backward of one micro-batch) are an estimate, rough but
monotonic in the batch, the resolution and the width (``activation_bytes``): fitted to the tensors that
diffusers' UNet2DConditionModel and AutoencoderKL save (tiny, SD 1.x and 2.x widths; within 5% in fp32;
78-96% of them under bf16 autocast on an H200), memory-efficient attention assumed, the forward's
temporaries and the backward's gradients not counted, so it is a lower bound of the peak
(``peak_memory_gb`` in the logs is the measured total).

At config load, before anything is built, ``memory_fit`` runs the same arithmetic on the trained module
counted from its weight files (refusing a batch that cannot fit, and saying which settings would).

- ``ddp``: every GPU holds the fp32 weights, their fp32 gradients, the optimizer state and the EMA.
- ``fsdp``: each of the ``world_size`` GPUs holds 1/world_size of each, plus the largest shard unit
  gathered in the compute dtype (two in flight: one computing, the next prefetched).
- ``fsdp_offload`` (``distributed.fsdp_cpu_offload``): weights, gradients, optimizer state and EMA
  shards live in pinned CPU memory; the GPU holds only the gathered units.

With ``model.adapter`` only the adapter's parameters train (weights, gradients, optimizer state and EMA
rows: the adapter's); the net's frozen base is its own column (``base``: stored in the training
precision, no gradients, no optimizer state), and text encoders with an adapter count in ``frozen``
(their adapter's state plus their frozen weights). At config load the adapter is counted from the
layers' shapes (``memory_load``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

GIB = 2**30
# Optimizer state bytes per trained parameter (fp32 state tensors shaped like the parameter): AdamW's two
# moments; Prodigy's two moments, its s and its copy of the initial weights p0; Lion's one momentum;
# schedule-free AdamW's z and second moment; CAME's momentum (its second moment and residual are factored
# into rows and columns for matrices: counted as 0, as Adafactor's). SGD: its momentum buffer.
OPTIMIZER_BYTES = {"adamw": 8, "adamw8bit": 2, "sgd": 4, "adafactor": 0, "prodigy": 16, "lion": 4,
                   "adamw_schedulefree": 8, "came": 4}
STRATEGIES = ("ddp", "fsdp", "fsdp_offload")
GPU_SIZES_GB = (24, 40, 80)


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@dataclass
class MemoryRow:
    strategy: str
    weights: float  # GiB per GPU: the trained parameters, kept in fp32
    gradients: float
    optimizer: float
    ema: float
    gathered: float  # FSDP: the gathered shard units
    frozen: float  # frozen components (VAE, text encoders) and replicated trained ones, whole on every GPU
    total: float
    activations: float = 0.0  # the estimate for one micro-batch (in the total)
    base: float = 0.0  # the trained module's frozen weights (an adapter's base), as stored (in the total)
    trained_params: int = 0  # parameters of the trained module that train (an adapter's alone with model.adapter)
    base_params: int = 0  # its frozen ones
    encoder_trained_params: int = 0  # of the text encoders trained with it (whole, or their adapters)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers as stored (an EMA copy, a frozen component)."""
    return _bytes(module)


def _unique(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    out: dict[int, torch.nn.Module] = {}
    for m in modules:
        out.setdefault(id(m), m)
    return list(out.values())


def _trained_bytes(module: torch.nn.Module, per_param: int) -> tuple[int, int, int]:
    """(trained parameters, their bytes at ``per_param`` each, the frozen parameters' bytes as stored) of a
    module trained whole or through an adapter."""
    trained = [p for p in module.parameters() if p.requires_grad]
    frozen = [p for p in module.parameters() if not p.requires_grad]
    n = sum(p.numel() for p in trained)
    return n, n * per_param, sum(t.numel() * t.element_size() for t in frozen)


def memory_plan(trained: torch.nn.Module, frozen: Iterable[torch.nn.Module], optimizer: str, world_size: int,
                ema: bool, ema_on_cpu: bool, compute_bytes: int,
                shard_units: Callable[[torch.nn.Module, str], list[torch.nn.Module]] | None,
                unit_level: str, replicated: Iterable[torch.nn.Module] = (), activations: float = 0.0,
                ema_bytes: int | None = None, in_backward: bool = False) -> list[MemoryRow]:
    """One row per strategy (GiB per GPU). The trained module's parameters that train (all of them, or an
    adapter's with ``model.adapter``) hold fp32 weights, gradients and optimizer state; its frozen ones (the
    adapter's base, in the training precision) only their stored bytes (``base``), sharded under FSDP like
    the rest. ``compute_bytes``: bytes per element of the gathered weights (2 under bf16/fp16 mixed
    precision, 4 in fp32); ``shard_units`` as the strategy shards them; ``replicated``: modules trained
    alongside (a text encoder, whole or through its adapter), whole on every GPU under every strategy;
    ``activations``: bytes of one micro-batch's activations (``activation_bytes`` x the batch);
    ``ema_bytes``: what the EMA's copy holds when known (None: a copy of the trained module);
    ``in_backward`` (``optimizer.in_backward``): each gradient is freed once its parameter is updated, so the
    gradients column is the largest trained tensor's."""
    opt = OPTIMIZER_BYTES.get(optimizer, 8)
    n, weights, base = _trained_bytes(trained, 4)  # trained weights are kept in fp32
    grads = n * 4
    if in_backward:
        grads = max((p.numel() for p in trained.parameters() if p.requires_grad), default=0) * 4
    optim = n * opt
    ema_b = 0 if not ema or ema_on_cpu else (weights + base if ema_bytes is None else ema_bytes)
    n_rep, rep = 0, 0
    for module in _unique(replicated):
        k, trained_b, frozen_b = _trained_bytes(module, 4 + 4 + opt)
        n_rep, rep = n_rep + k, rep + trained_b + frozen_b
    frozen_b = sum(_bytes(m) for m in _unique(frozen))
    # Each unit gathers the parameters no inner unit holds (units come innermost first; the root last).
    seen: set[int] = set()
    sizes = []
    for unit in [*(shard_units(trained, unit_level) if shard_units is not None else []), trained]:
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        sizes.append(sum(p.numel() for p in own))
    largest = max(sizes)
    gathered = 2 * largest * compute_bytes
    counts = dict(trained_params=n, base_params=sum(p.numel() for p in trained.parameters()) - n,
                  encoder_trained_params=n_rep)
    rows = []
    for strategy in STRATEGIES:
        if strategy == "ddp":
            parts = (weights, grads, optim, ema_b, 0, base)
        elif strategy == "fsdp":
            w = world_size
            parts = (weights / w, grads / w, optim / w, ema_b / w, gathered, base / w)
        else:
            parts = (0, 0, 0, 0, gathered, 0)
        g = [x / GIB for x in parts]
        rows.append(MemoryRow(strategy, *g[:5], frozen=(frozen_b + rep) / GIB,
                              total=(sum(parts) + frozen_b + rep + activations) / GIB, activations=activations / GIB,
                              base=g[5], **counts))
    return rows


def format_plan(rows: list[MemoryRow], chosen: str, world_size: int) -> str:
    acts = any(r.activations for r in rows)
    base = any(r.base_params for r in rows)
    what = "activations: a rough lower estimate" if acts else "activations not included"
    lines = [f"memory plan per GPU (GiB, {world_size} GPU(s); {what}):"]
    if base:  # an adapter: its parameters train; the net's base is frozen
        r = rows[0]
        lines.append(f"  trained: {r.trained_params:,} parameters (the adapter) + {r.encoder_trained_params:,} of the "
                     f"text encoders; frozen base: {r.base_params:,} parameters, stored as built (no grads, no "
                     "optimizer state)")
    lines.append(f"  {'strategy':<13}{'weights':>8}{'grads':>8}{'optim':>8}{'ema':>8}{'gathered':>9}"
                 + (f"{'base':>8}" if base else "") + f"{'frozen':>8}" + (f"{'acts':>8}" if acts else "")
                 + f"{'total':>8}  fits")
    for r in rows:
        fits = " ".join(f"{g}GB:{'yes' if r.total < 0.9 * g * 1e9 / GIB else 'no'}" for g in GPU_SIZES_GB)
        mark = " <- this run" if r.strategy == chosen else ""
        lines.append(f"  {r.strategy:<13}{r.weights:8.2f}{r.gradients:8.2f}{r.optimizer:8.2f}{r.ema:8.2f}"
                     f"{r.gathered:9.2f}" + (f"{r.base:8.2f}" if base else "") + f"{r.frozen:8.2f}"
                     + (f"{r.activations:8.2f}" if acts else "") + f"{r.total:8.2f}  {fits}{mark}")
    return "\n".join(lines)


def as_dicts(rows: list[MemoryRow]) -> list[dict]:
    return [asdict(r) for r in rows]


# ----------------------------------------------------------------------------------------------
# Activations: a rough estimate, stated as such.
# ----------------------------------------------------------------------------------------------

# Elements autograd saves per channel x pixel of a level, per block: fitted (least squares) to the saved
# tensors of diffusers' UNet2DConditionModel (tiny, SD 1.x and 2.x configs, 8-32 latent pixels, fp32,
# SDPA attention) and AutoencoderKL (tiny and SD's, 64-128 px): predictions within 5% of the measurement.
# On an H200 under bf16 autocast (flash attention), the estimate at 2 bytes per element was 78% (SD 1.5,
# 512 px, batch 1-4: 0.91 of 1.16-1.20 GiB per sample) and 96% (SDXL, 1024 px: 7.26 of 7.54 GiB) of what
# the forward kept beyond autocast's weight copies (some saved tensors stay fp32): a lower bound.
UNET_RESNET = 9.0  # per resnet block
UNET_TRANSFORMER = 33.0  # per transformer layer (self- and cross-attention, feed-forward)
VAE_BLOCK = 7.3  # AutoencoderKL: per resnet block of the encoder and decoder
# What gradient checkpointing keeps: diffusers checkpoints whole blocks, measured 0.16-0.19 of the above on
# the CPU (tiny, SD 1.x) and 0.09 (SDXL, 1024 px) to 0.25 (SD 1.5, 512 px) on an H200 in bf16: the lowest.
CHECKPOINTED = 0.08
UNET_DEFAULTS = dict(  # UNet2DConditionModel's defaults (SD 1.x's layout)
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    layers_per_block=2, transformer_layers_per_block=1, mid_block_type="UNetMidBlock2DCrossAttn",
)
VAE_DEFAULTS = dict(block_out_channels=(64,), layers_per_block=1)


def _per_block(value, n: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def _layers(value) -> int:
    """transformer_layers_per_block entries may be lists (one per layer of a block: SDXL refiner-style)."""
    return max(value) if isinstance(value, (list, tuple)) else int(value)


def unet_activation_elements(config: dict, latent: float) -> float:
    """Elements one sample saves for the backward in a UNet2DConditionModel (``config``: its config.json or
    model.unet.params; missing keys take diffusers' defaults) at ``latent`` x ``latent`` latent pixels."""
    c = {**UNET_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    widths = list(c["block_out_channels"])
    levels = len(widths)
    down, up = list(c["down_block_types"]), list(c["up_block_types"])
    lpb = _per_block(c["layers_per_block"], levels)
    tl = [_layers(v) for v in _per_block(c["transformer_layers_per_block"], levels)]
    total = 0.0
    for level, width in enumerate(widths):
        area = width * (latent / 2**level) ** 2
        n_down, n_up = lpb[level], list(reversed(lpb))[levels - 1 - level] + 1
        attn_down = "Attn" in str(down[level]) if level < len(down) else False
        attn_up = "Attn" in str(up[levels - 1 - level]) if levels - 1 - level < len(up) else False
        total += area * (UNET_RESNET * (n_down + n_up)
                         + UNET_TRANSFORMER * tl[level] * (n_down * attn_down + n_up * attn_up))
    area = widths[-1] * (latent / 2 ** (levels - 1)) ** 2
    if c.get("mid_block_type"):
        total += area * (2 * UNET_RESNET + UNET_TRANSFORMER * tl[-1] * ("Attn" in str(c["mid_block_type"])))
    return total


def vae_activation_elements(config: dict, resolution: float) -> float:
    """Elements one sample saves for the backward in an AutoencoderKL (encoder and decoder trained) at
    ``resolution`` x ``resolution`` pixels."""
    c = {**VAE_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    widths, lpb = list(c["block_out_channels"]), int(c["layers_per_block"])
    total = sum(w * (resolution / 2**level) ** 2 * (2 * lpb + 1) for level, w in enumerate(widths))
    area = widths[-1] * (resolution / 2 ** (len(widths) - 1)) ** 2
    return VAE_BLOCK * (total + 4 * area)


def activation_bytes(config: dict, kind: str, resolution: int, compute_bytes: int, checkpointing: bool,
                     vae_factor: int = 8) -> float:
    """Bytes one sample's activations take (a rough estimate, lower than the peak: see the module doc).
    ``kind``: ``unet`` (at ``resolution / vae_factor`` latent pixels) or ``vae`` (at ``resolution``);
    ``compute_bytes``: 2 under bf16/fp16 autocast, 4 in fp32."""
    if kind == "vae":
        elements = vae_activation_elements(config, resolution)
    else:
        elements = unet_activation_elements(config, resolution / vae_factor)
    return elements * compute_bytes * (CHECKPOINTED if checkpointing else 1.0)


def per_trained_param(optimizer: str, ema: bool, in_backward: bool = False) -> int:
    """Bytes per trained parameter: fp32 weight, fp32 gradient (none with ``optimizer.in_backward``: each is
    freed once its parameter is updated, so only the largest tensor's exists at a time), optimizer state,
    and the fp32 EMA when it is on the device."""
    return 4 + (0 if in_backward else 4) + OPTIMIZER_BYTES.get(optimizer, 8) + (4 if ema else 0)


def trained_state_bytes(n_params: int, optimizer: str, ema: bool, strategy: str, world_size: int,
                        in_backward: bool = False) -> float:
    """Per device: the trained module's fp32 weights and gradients, its optimizer state and the EMA (on
    the device), under ``strategy`` (fsdp: 1/world_size of each; fsdp_offload: none on the device)."""
    per_param = per_trained_param(optimizer, ema, in_backward)
    if strategy == "fsdp_offload":
        return 0.0
    return n_params * per_param / (world_size if strategy == "fsdp" else 1)


if __name__ == "__main__":  # python -m sd_training.memory.plan --table [--world-size 8] [--resolution 1024]
    import argparse

    parser = argparse.ArgumentParser(description="Reference memory plans of known diffusion transformers")
    parser.add_argument("--table", action="store_true", help="print the README's markdown table")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=1024)
    args = parser.parse_args()
    if args.table:
        from .transformer import reference_table

        print(reference_table(args.world_size, args.resolution))
