"""The memory plan printed at start-up: per GPU, what the weights, gradients, optimizer state and EMA of
the trained module take, and what the frozen components take, under each strategy, so a user sees
before the first step whether a model fits in 24, 40 or 80 GB.

Counted from the modules as built (exact bytes of the tensors), not estimated from a model name.
Activations are not in the plan: they depend on the batch, the resolution and gradient checkpointing
(``peak_memory_gb`` in the logs is the measured total).

- ``ddp``: every GPU holds the fp32 weights, their fp32 gradients, the optimizer state and the EMA.
- ``fsdp``: each of the ``world_size`` GPUs holds 1/world_size of each, plus the largest shard unit
  gathered in the compute dtype (two in flight: one computing, the next prefetched).
- ``fsdp_offload`` (``distributed.fsdp_cpu_offload``): weights, gradients, optimizer state and EMA
  shards live in pinned CPU memory; the GPU holds only the gathered units.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

GIB = 2**30
# Optimizer state bytes per trained parameter.
OPTIMIZER_BYTES = {"adamw": 8, "adamw8bit": 2, "sgd": 4, "adafactor": 0}
STRATEGIES = ("ddp", "fsdp", "fsdp_offload")
GPU_SIZES_GB = (24, 40, 80)


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@dataclass
class MemoryRow:
    strategy: str
    weights: float  # GiB per GPU
    gradients: float
    optimizer: float
    ema: float
    gathered: float  # FSDP: the gathered shard units
    frozen: float  # frozen components (VAE, text encoders) and replicated trained ones, whole on every GPU
    total: float


def memory_plan(trained: torch.nn.Module, frozen: Iterable[torch.nn.Module], optimizer: str, world_size: int,
                ema: bool, ema_on_cpu: bool, compute_bytes: int,
                shard_units: Callable[[torch.nn.Module, str], list[torch.nn.Module]] | None,
                unit_level: str, replicated: Iterable[torch.nn.Module] = ()) -> list[MemoryRow]:
    """One row per strategy (GiB per GPU). ``compute_bytes``: bytes per element of the gathered weights
    (2 under bf16/fp16 mixed precision, 4 in fp32); ``shard_units`` as the strategy shards them;
    ``replicated``: modules trained alongside (a text encoder), whole on every GPU under every strategy."""
    n = sum(p.numel() for p in trained.parameters() if p.requires_grad)
    weights = sum(p.numel() * 4 for p in trained.parameters())  # trained weights are kept in fp32
    grads = n * 4
    optim = n * OPTIMIZER_BYTES.get(optimizer, 8)
    ema_b = weights if ema and not ema_on_cpu else 0
    n_rep = sum(p.numel() for m in replicated for p in m.parameters())
    rep = n_rep * (4 + 4 + OPTIMIZER_BYTES.get(optimizer, 8))
    frozen_b = sum(_bytes(m) for m in frozen)
    # Each unit gathers the parameters no inner unit holds (units come innermost first; the root last).
    seen: set[int] = set()
    sizes = []
    for unit in [*(shard_units(trained, unit_level) if shard_units is not None else []), trained]:
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        sizes.append(sum(p.numel() for p in own))
    largest = max(sizes)
    gathered = 2 * largest * compute_bytes
    rows = []
    for strategy in STRATEGIES:
        if strategy == "ddp":
            parts = (weights, grads, optim, ema_b, 0)
        elif strategy == "fsdp":
            w = world_size
            parts = (weights / w, grads / w, optim / w, ema_b / w, gathered)
        else:
            parts = (0, 0, 0, 0, gathered)
        rows.append(MemoryRow(strategy, *(p / GIB for p in parts), (frozen_b + rep) / GIB,
                              (sum(parts) + frozen_b + rep) / GIB))
    return rows


def format_plan(rows: list[MemoryRow], chosen: str, world_size: int) -> str:
    lines = [f"memory plan per GPU (GiB, {world_size} GPU(s); activations not included):",
             f"  {'strategy':<13}{'weights':>8}{'grads':>8}{'optim':>8}{'ema':>8}{'gathered':>9}{'frozen':>8}{'total':>8}  fits"]
    for r in rows:
        fits = " ".join(f"{g}GB:{'yes' if r.total < 0.9 * g * 1e9 / GIB else 'no'}" for g in GPU_SIZES_GB)
        mark = " <- this run" if r.strategy == chosen else ""
        lines.append(f"  {r.strategy:<13}{r.weights:8.2f}{r.gradients:8.2f}{r.optimizer:8.2f}{r.ema:8.2f}"
                     f"{r.gathered:9.2f}{r.frozen:8.2f}{r.total:8.2f}  {fits}{mark}")
    return "\n".join(lines)


def as_dicts(rows: list[MemoryRow]) -> list[dict]:
    return [asdict(r) for r in rows]
