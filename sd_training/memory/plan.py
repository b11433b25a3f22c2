"""The memory plan printed at start-up: per GPU, what the weights, gradients, optimizer state and EMA of
the trained module take, and what the frozen components take, under each strategy, so a user sees
before the first step whether a model fits in 24, 40 or 80 GB.

Counted from the modules as built (exact bytes of the tensors), not estimated from a model name.
Activations (what autograd keeps for the backward of one micro-batch) are an estimate, rough but
monotonic in the batch, the resolution and the width, that the trained module's family gives
(``Family.sample_activation_elements``, from ``memory.activations``): a lower bound of the peak
(``peak_memory_gb`` in the logs is the measured total).

The reference rows (``python -m sd_training.memory.plan --table``, the table in docs/memory.md) plan the published
models the families name (``Family.reference_models``) on the meta device: a full fine-tune and a LoRA of each
(the LoRA counted from the layers' shapes as at config load), with the frozen text encoders on every GPU or the
text states read from the latent shards (only the VAE stays).

At config load, before anything is built, ``memory.fit`` runs the same arithmetic on the trained module
counted from its weight files (refusing a batch that cannot fit, and saying which settings would).

- ``ddp``: every GPU holds the fp32 weights, their fp32 gradients, the optimizer state and the EMA.
- ``fsdp``: each of the ``world_size`` GPUs holds 1/world_size of each, plus the largest shard unit
  gathered in the compute dtype (two in flight: one computing, the next prefetched).
- ``hsdp`` (a row when the shard group is smaller than the job): as fsdp over the ``shard_size`` ranks
  of one shard group (one node): each GPU holds 1/shard_size of each, plus the gathered units; the
  other groups hold the same shards (replicas), so more nodes lower nothing per GPU.
- ``fsdp_offload`` (``distributed.fsdp_cpu_offload``): weights, gradients, optimizer state and EMA
  shards live in pinned CPU memory; the GPU holds only the gathered units (under hsdp too).

With ``model.adapter`` only the adapter's parameters train (weights, gradients, optimizer state and EMA
rows: the adapter's); the net's frozen base is its own column (``base``: stored in the training
precision, no gradients, no optimizer state), and text encoders with an adapter count in ``frozen``
(their adapter's state plus their frozen weights). At config load the adapter is counted from the
layers' shapes (``memory.load``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

from ..families.reference_models import ENCODERS, ReferenceModel
from .activations import SampleShape
from ..adapters import resolve_targets
from .load import lora_params, meta_module

GIB = 2**30
# Optimizer state bytes per trained parameter (fp32 state tensors shaped like the parameter): AdamW's two
# moments; Prodigy's two moments, its s and its copy of the initial weights p0; Lion's one momentum;
# schedule-free AdamW's z and second moment; CAME's momentum (its second moment and residual are factored
# into rows and columns for matrices: counted as 0, as Adafactor's). SGD: its momentum buffer.
OPTIMIZER_BYTES = {"adamw": 8, "adamw8bit": 2, "sgd": 4, "adafactor": 0, "prodigy": 16, "lion": 4,
                   "adamw_schedulefree": 8, "came": 4}
STRATEGIES = ("ddp", "fsdp", "fsdp_offload")  # the rows of every plan; hsdp's comes with a shard group (after fsdp)
GPU_SIZES_GB = (24, 40, 80)
# The reference table's LoRA rows: rank 32 on every family's ``attention_ffn`` preset (attention and feed-forward
# layers of the blocks), one setting for all so the rows compare; the LoRA templates train less (rank 16 on
# ``attention``), so theirs is smaller.
LORA_RANK, LORA_PRESET = 32, "attention_ffn"


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor stores: a tensor subclass that packs its data (torchao's quantised weights, which report
    their logical dtype) by its inner tensors."""
    names = getattr(t, "tensor_data_names", None) or getattr(t.data, "tensor_data_names", None)
    if names:
        inner = t if getattr(t, "tensor_data_names", None) else t.data
        return sum(tensor_bytes(getattr(inner, n)) for n in names)
    return t.numel() * t.element_size()


def _bytes(module: torch.nn.Module) -> int:
    return sum(tensor_bytes(t) for t in [*module.parameters(), *module.buffers()])


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
    return n, n * per_param, sum(tensor_bytes(t) for t in frozen)


def memory_plan(trained: torch.nn.Module, frozen: Iterable[torch.nn.Module], optimizer: str, world_size: int,
                ema: bool, ema_on_cpu: bool, compute_bytes: int,
                shard_units: Callable[[torch.nn.Module, str], list[torch.nn.Module]] | None,
                unit_level: str, replicated: Iterable[torch.nn.Module] = (), activations: float = 0.0,
                ema_bytes: int | None = None, in_backward: bool = False, shard_size: int = 0) -> list[MemoryRow]:
    """One row per strategy (GiB per GPU). The trained module's parameters that train (all of them, or an
    adapter's with ``model.adapter``) hold fp32 weights, gradients and optimizer state; its frozen ones (the
    adapter's base, in the training precision) only their stored bytes (``base``), sharded under FSDP like
    the rest. ``compute_bytes``: bytes per element of the gathered weights (2 under bf16/fp16 mixed
    precision, 4 in fp32); ``shard_units`` as the strategy shards them; ``replicated``: modules trained
    alongside (a text encoder, whole or through its adapter), whole on every GPU under every strategy;
    ``activations``: bytes of one micro-batch's activations (``activations.activation_bytes`` x the batch);
    ``ema_bytes``: what the EMA's copy holds when known (None: a copy of the trained module);
    ``in_backward`` (``optimizer.in_backward``): each gradient is freed once its parameter is updated, so the
    gradients column is the largest trained tensor's. ``shard_size``: hsdp's shard group (a row of its own when
    it is smaller than ``world_size``; 0: no hsdp row)."""
    opt = OPTIMIZER_BYTES.get(optimizer, 8)
    n, weights, base = _trained_bytes(trained, 4)  # trained weights are kept in fp32
    grads = n * 4
    if in_backward:
        grads = max((p.numel() for p in trained.parameters() if p.requires_grad), default=0) * 4
    ema_b = 0 if not ema or ema_on_cpu else (weights + base if ema_bytes is None else ema_bytes)
    n_rep, rep = 0, 0
    for module in _unique(replicated):
        k, trained_b, frozen_b = _trained_bytes(module, 4 + 4 + opt)
        n_rep, rep = n_rep + k, rep + trained_b + frozen_b
    frozen_b = sum(_bytes(m) for m in _unique(frozen))
    largest = largest_unit(trained, shard_units(trained, unit_level) if shard_units is not None else [])
    state = TrainedState(n, weights, grads, n * opt, ema_b, base)
    counts = dict(trained_params=n, base_params=sum(p.numel() for p in trained.parameters()) - n,
                  encoder_trained_params=n_rep)
    return strategy_rows(state, 2 * largest * compute_bytes, frozen_b + rep, world_size, activations, counts,
                         shard_size)


def largest_unit(net: torch.nn.Module, units: list[torch.nn.Module], extra: dict[int, int] | None = None) -> int:
    """Parameters of the largest shard unit of ``net``: units come innermost first and the root last, and each
    gathers the parameters no inner unit holds; ``extra`` (a layer's id -> parameters: a LoRA planned from the
    layers' shapes) counts in the unit that holds the layer."""
    seen_params: set[int] = set()
    seen_layers: set[int] = set()
    largest = 0
    for unit in [*units, net]:
        own = [p for p in unit.parameters() if id(p) not in seen_params]
        layers = [m for m in unit.modules() if id(m) not in seen_layers]
        seen_params.update(id(p) for p in own)
        seen_layers.update(id(m) for m in layers)
        size = sum(p.numel() for p in own) + sum((extra or {}).get(id(m), 0) for m in layers)
        largest = max(largest, size)
    return largest


@dataclass
class TrainedState:
    """Bytes the trained module holds on one device before sharding (``memory_plan`` counts them from the
    module; the reference LoRA rows from the layers' shapes)."""

    params: int  # parameters that train
    weights: int  # their fp32 weights
    grads: int  # the gradients that exist at once
    optimizer: int
    ema: int  # on the device (0: none, or on the CPU)
    base: int  # the frozen base, as stored


def strategy_rows(state: TrainedState, gathered: int, frozen: int, world_size: int, activations: float,
                  counts: dict, shard_size: int = 0) -> list[MemoryRow]:
    """One row per strategy (GiB per GPU): ``ddp`` holds ``state`` whole, ``fsdp`` 1/world_size of it plus
    ``gathered`` bytes of units, ``hsdp`` (when ``0 < shard_size < world_size``) 1/shard_size of it plus the
    gathered units, ``fsdp_offload`` the gathered units only; ``frozen`` bytes (whole on every GPU) and
    ``activations`` under all of them."""
    s = state
    rows = []
    names = list(STRATEGIES)
    if 0 < shard_size < world_size:
        names.insert(names.index("fsdp") + 1, "hsdp")
    for strategy in names:
        if strategy == "ddp":
            parts = (s.weights, s.grads, s.optimizer, s.ema, 0, s.base)
        elif strategy in ("fsdp", "hsdp"):
            w = world_size if strategy == "fsdp" else shard_size
            parts = (s.weights / w, s.grads / w, s.optimizer / w, s.ema / w, gathered, s.base / w)
        else:
            parts = (0, 0, 0, 0, gathered, 0)
        g = [x / GIB for x in parts]
        rows.append(MemoryRow(strategy, *g[:5], frozen=frozen / GIB, total=(sum(parts) + frozen + activations) / GIB,
                              activations=activations / GIB, base=g[5], **counts))
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


def per_trained_param(optimizer: str, ema: bool, in_backward: bool = False) -> int:
    """Bytes per trained parameter: fp32 weight, fp32 gradient (none with ``optimizer.in_backward``: each is
    freed once its parameter is updated, so only the largest tensor's exists at a time), optimizer state,
    and the fp32 EMA when it is on the device."""
    return 4 + (0 if in_backward else 4) + OPTIMIZER_BYTES.get(optimizer, 8) + (4 if ema else 0)


def trained_state_bytes(n_params: int, optimizer: str, ema: bool, strategy: str, world_size: int,
                        in_backward: bool = False) -> float:
    """Per device: the trained module's fp32 weights and gradients, its optimizer state and the EMA (on
    the device), under ``strategy`` (fsdp: 1/world_size of each, hsdp: ``world_size`` is its shard group's;
    fsdp_offload: none on the device)."""
    per_param = per_trained_param(optimizer, ema, in_backward)
    if strategy == "fsdp_offload":
        return 0.0
    return n_params * per_param / (world_size if strategy in ("fsdp", "hsdp") else 1)


# ----------------------------------------------------------------------------------------------
# Reference rows: the published models the families name, counted from their configs on the meta device.
# ----------------------------------------------------------------------------------------------

def reference_models() -> dict[str, tuple[type, ReferenceModel]]:
    """name -> (the family class, the model) of every registered family's ``reference_models()``."""
    from ..families import registry

    return {name: (fam, model) for fam in registry.FAMILIES.values() for name, model in fam.reference_models().items()}


def reference_activations(name: str, resolution: int = 1024, batch: int = 1, checkpointing: bool = True) -> float:
    """Bytes of ``batch`` samples' activations of reference model ``name`` in bf16 (a rough lower estimate),
    as its family estimates them (16-channel latents of an 8x VAE, the pipeline's default text tokens)."""
    fam, model = reference_models()[name]
    sample = SampleShape(resolution, 8, int(model.vae.get("latent_channels") or 16), model.text_tokens)
    return batch * 2 * fam.sample_activation_elements(model.config, sample, checkpointing)


@dataclass
class ReferenceParts:
    """A reference model built on the meta device: the trained net (fp32), its frozen text encoders (bf16) and
    VAE (fp32)."""

    family: type
    net: torch.nn.Module
    encoders: list[torch.nn.Module]
    vae: torch.nn.Module

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.net.parameters())

    def frozen_bytes(self, text_stored: bool = False) -> int:
        """What stays on every GPU: the VAE and the text encoders, or nothing when the latents and the text
        states come from latent shards (``text_stored``: ``model.vae.placement`` and
        ``model.text_encoder_placement`` keep them in host memory between sample grids)."""
        return 0 if text_stored else _bytes(self.vae) + sum(_bytes(m) for m in self.encoders)


def reference_parts(name: str) -> ReferenceParts:
    fam, model = reference_models()[name]
    encoders = [meta_module(ENCODERS[e][1], ENCODERS[e][0]).to(torch.bfloat16) for e in model.encoders]
    return ReferenceParts(fam, meta_module(model.config, model.net_class), encoders, meta_module(model.vae))


def reference_rows(name: str, world_size: int = 8, resolution: int = 1024, batch: int = 1, optimizer: str = "adamw",
                   ema: bool = True, checkpointing: bool = True,
                   parts: ReferenceParts | None = None) -> tuple[int, list[MemoryRow]]:
    """(trained parameters, one row per strategy) of a full fine-tune of reference model ``name`` per GPU: bf16
    mixed precision (fp32 master weights, bf16 gathered units: the family's shard units at ``block`` level),
    the frozen encoders in bf16 and the VAE in fp32 on every GPU, ``batch`` samples of ``resolution`` px
    (text tokens: the pipeline's defaults)."""
    parts = parts or reference_parts(name)
    acts = reference_activations(name, resolution, batch, checkpointing)
    rows = memory_plan(parts.net, [*parts.encoders, parts.vae], optimizer, world_size, ema, False, 2,
                       parts.family.shard_units, "block", activations=acts)
    return parts.params, rows


def reference_lora_rows(name: str, world_size: int = 8, resolution: int = 1024, batch: int = 1,
                        optimizer: str = "adamw", ema: bool = True, checkpointing: bool = True,
                        rank: int = LORA_RANK, preset: str = LORA_PRESET,
                        parts: ReferenceParts | None = None) -> tuple[int, int, list[MemoryRow]]:
    """(LoRA parameters, adapted layers, the ddp and fsdp rows) of a LoRA of ``rank`` on the family's
    ``preset`` layers of reference model ``name``, as the start-up plan counts a run with ``model.adapter``:
    the adapter trains in fp32 (weights, gradients, optimizer state, its EMA); the frozen base is stored in
    bf16 on every GPU under ddp and in fp32 under fsdp, which shards it (``memory.load.plan_adapter``); the
    LoRA's parameters are counted from the layers' shapes (``memory.load.lora_params``)."""
    parts = parts or reference_parts(name)
    fam, net = parts.family, parts.net
    targets = resolve_targets(net, fam.adapter_presets, preset, [], None, "model.adapter", fam.net_name)
    layers = dict(net.named_modules())
    per_layer = {id(layers[t]): lora_params(net, [t], rank) for t in targets}
    n = sum(per_layer.values())
    gathered = 2 * largest_unit(net, fam.shard_units(net, "block"), per_layer) * 2  # two units in bf16
    acts = reference_activations(name, resolution, batch, checkpointing)
    counts = dict(trained_params=n, base_params=parts.params, encoder_trained_params=0)

    def rows(base_bytes: int) -> list[MemoryRow]:
        state = TrainedState(n, n * 4, n * 4, n * OPTIMIZER_BYTES.get(optimizer, 8), n * 4 if ema else 0,
                             parts.params * base_bytes)
        return strategy_rows(state, gathered, parts.frozen_bytes(), world_size, acts, counts)

    return n, len(targets), [rows(2)[0], rows(4)[1]]


def _fits(total: float, gb: int = 80) -> str:
    return "yes" if total < 0.9 * gb * 1e9 / GIB else "no"


def _table_line(label: str, training: str, row: MemoryRow, stored_frozen: float, full_acts: float) -> str:
    """One row: the frozen part and the total with the text encoders on the GPU / the text states stored."""
    stored_total = row.total - row.frozen + stored_frozen
    return (f"| {label} | {training} | {row.strategy} | {row.weights:.1f} | {row.gradients:.1f} | "
            f"{row.optimizer:.1f} | {row.ema:.1f} | {row.gathered:.2f} | {row.base:.1f} | "
            f"{row.frozen:.1f} / {stored_frozen:.1f} | "
            f"{row.activations:.1f} / {full_acts:.1f} | {row.total:.1f} / {stored_total:.1f} | "
            f"{_fits(row.total)} / {_fits(stored_total)} |")


def reference_table(world_size: int = 8, resolution: int = 1024) -> str:
    """A markdown table of the reference rows (GiB per GPU) for docs/memory.md: each model's full fine-tune
    (ddp, fsdp, fsdp_offload), then its LoRA (ddp, fsdp)."""
    head = ("| model (trained params) | training | strategy | weights | grads | AdamW | EMA | gathered | frozen base "
            "| frozen encoders + VAE: online / stored text | activations (ckpt / none) "
            "| total (ckpt): online / stored text | fits 80 GB: online / stored text |")
    lines = [f"Per GPU, {world_size} GPUs, {resolution} px, batch 1, bf16, AdamW, EMA on the GPU; frozen text encoders "
             "in bf16, VAE in fp32 (online: the text encoders on every GPU; stored text: the text states read from the "
             f"latent shards, only the VAE); LoRA: rank {LORA_RANK} on the family's `{LORA_PRESET}` layers; "
             "activations a rough lower estimate with / without gradient checkpointing.",
             "", head, "|" + "---|" * (head.count("|") - 1)]
    for name in reference_models():
        parts = reference_parts(name)
        stored = parts.frozen_bytes(text_stored=True) / GIB
        full_acts = reference_activations(name, resolution, checkpointing=False) / GIB
        n, rows = reference_rows(name, world_size, resolution, parts=parts)
        lines += [_table_line(f"{name} ({n / 1e9:.2f}B)", "full", row, stored, full_acts) for row in rows]
        n_lora, _layers, rows = reference_lora_rows(name, world_size, resolution, parts=parts)
        lines += [_table_line(f"{name} ({n_lora / 1e6:.0f}M LoRA)", f"LoRA r{LORA_RANK}", row, stored, full_acts)
                  for row in rows]
    return "\n".join(lines)


def encoder_params() -> dict[str, int]:
    """Parameters of the reference frozen encoders (counted on meta)."""
    return {e: sum(p.numel() for p in meta_module(conf, cls).parameters()) for e, (cls, conf) in ENCODERS.items()}


if __name__ == "__main__":  # python -m sd_training.memory.plan --table [--world-size 8] [--resolution 1024]
    import argparse

    parser = argparse.ArgumentParser(description="Reference memory plans of known diffusion transformers")
    parser.add_argument("--table", action="store_true", help="print the markdown table of docs/memory.md")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=1024)
    args = parser.parse_args()
    if args.table:
        print(reference_table(args.world_size, args.resolution))
