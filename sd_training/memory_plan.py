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

``check_batch`` runs the plan at config load, before anything is built (the trained module's
parameters counted from its weight files' headers or built on the meta device): a batch whose plan does
not fit the device (a CUDA device's memory; on the CPU the machine's RAM shared by its ranks) is a
``ConfigError`` with the numbers.

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
# Optimizer state bytes per trained parameter.
OPTIMIZER_BYTES = {"adamw": 8, "adamw8bit": 2, "sgd": 4, "adafactor": 0}
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


def trained_state_bytes(n_params: int, optimizer: str, ema: bool, strategy: str, world_size: int) -> float:
    """Per device: the trained module's fp32 weights and gradients, its optimizer state and the EMA (on
    the device), under ``strategy`` (fsdp: 1/world_size of each; fsdp_offload: none on the device)."""
    per_param = 4 + 4 + OPTIMIZER_BYTES.get(optimizer, 8) + (4 if ema else 0)
    if strategy == "fsdp_offload":
        return 0.0
    return n_params * per_param / (world_size if strategy == "fsdp" else 1)


# ----------------------------------------------------------------------------------------------
# The plan at config load: a batch that cannot fit is refused before anything is built.
# ----------------------------------------------------------------------------------------------

LOAD_WARN_FRACTION = 0.8  # a plan above this share of the device's memory is logged as a warning


def micro_batch_activations(cfg, net: torch.nn.Module | None = None, config: dict | None = None,
                            text_tokens: int | None = None) -> float:
    """Bytes of one micro-batch's activations for the run ``cfg`` (``system.batch_size`` samples at
    ``dataset.params.resolution``), from the trained module's config (``net.config`` or ``config``); 0
    when its architecture is not one the estimate knows (a UNet2DConditionModel, an AutoencoderKL, or a
    diffusion transformer: ``text_tokens`` per sample through its joint attention, None: the family's
    ``Family.text_tokens``)."""
    conf = dict(config if config is not None else getattr(net, "config", None) or {})
    kind = _kind(cfg, conf)
    if kind is None:
        return 0.0
    compute = 2 if cfg.model.mixed_precision in ("bf16", "fp16") else 4
    if kind == "transformer":
        from .memory_transformer import activation_elements, image_tokens

        latent = cfg.dataset.params.resolution / _vae_factor(cfg)
        channels = int(_vae_config(cfg).get("latent_channels") or 16)
        text = text_tokens if text_tokens is not None else _family_of(cfg)[2]
        per_sample = activation_elements(conf, image_tokens(conf, latent, latent, channels), text,
                                         cfg.model.gradient_checkpointing) * compute
        return cfg.system.batch_size * per_sample
    return cfg.system.batch_size * activation_bytes(conf, kind, cfg.dataset.params.resolution, compute,
                                                    cfg.model.gradient_checkpointing, _vae_factor(cfg))


def _family_class(cfg):
    """The run's family class; None when it cannot be told yet."""
    from .families import registry

    try:
        name = registry.detect(cfg.model, must=False)
    except Exception:  # noqa: BLE001 -- a pipeline the config checks already reported
        name = None
    return registry.FAMILIES.get(name or "")


def _family_of(cfg) -> tuple[str, str | None, int]:
    """(the trained module's component name, its class name when the family names one, text tokens per
    sample) of the run's family; ("unet", None, 77) when the family cannot be told yet."""
    fam = _family_class(cfg)
    if fam is None:
        return "unet", None, 77
    return fam.net_name, getattr(fam, "net_class", None), int(fam.text_tokens(cfg) or 77)


def _kind(cfg, conf: dict) -> str | None:
    from .memory_transformer import is_transformer

    name = str(conf.get("_class_name") or "")
    if cfg.model.train_target != "vae" and is_transformer(conf):
        return "transformer"
    if cfg.model.train_target == "vae":
        return "vae" if name in ("", "AutoencoderKL") else None
    target = str(cfg.model.unet.target).rsplit(".", 1)[-1]
    return "unet" if name in ("", "UNet2DConditionModel") and target == "UNet2DConditionModel" else None


def _json(path: str) -> dict | None:
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            out = json.load(fh)
        return out if isinstance(out, dict) else None
    except (OSError, ValueError):
        return None


def _component_folder(src: str | None, sub: str, revision: str | None) -> tuple[str | None, dict | None]:
    """(folder, config.json) of component ``sub`` of a pipeline root, a component folder, or a hub id in
    the local cache; (None, None) when it cannot be read without building anything."""
    import os

    if not src:
        return None, None
    for folder in (os.path.join(src, sub), src):
        conf = _json(os.path.join(folder, "config.json")) if os.path.isfile(os.path.join(folder, "config.json")) else None
        if conf is not None:
            return folder, conf
    if os.path.exists(src) or src.startswith((".", "/", "~")):
        return None, None
    try:  # a hub id: its cached config, if any (nothing is downloaded)
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(src, f"{sub}/config.json", revision=revision)
        if isinstance(path, str):
            return os.path.dirname(path), _json(path)
    except Exception:  # noqa: BLE001 -- no cache, an odd id: no estimate at load (the start-up plan has one)
        pass
    return None, None


def _vae_config(cfg) -> dict:
    m = cfg.model
    return _component_folder(m.vae.pretrained or m.pretrained, "vae", m.revision)[1] or {}


def _vae_factor(cfg) -> int:
    """Pixels per latent pixel: 2^(VAE levels - 1) from the VAE's config.json, else Stable Diffusion's 8."""
    levels = len(_vae_config(cfg).get("block_out_channels") or (0,) * 4)
    return 2 ** (levels - 1)


def device_memory(device: str) -> tuple[int, str] | None:
    """(bytes, description) of the memory one rank may use: the CUDA device's (``LOCAL_RANK``'s), or on
    the CPU the machine's RAM (or its cgroup limit) divided among the ranks on the machine. None for
    ``cuda`` where no GPU is visible (a config checked on another machine than the one it runs on)."""
    import os

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not n:
            return None
        idx = int(os.environ.get("LOCAL_RANK", "0") or 0) % n
        props = torch.cuda.get_device_properties(idx)
        return props.total_memory, f"cuda:{idx} ({props.name}) has {props.total_memory / GIB:.1f} GiB"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as fh:
                text = fh.read().strip()
            if text.isdigit() and 0 < int(text) < ram:
                ram = int(text)
                break
        except OSError:
            continue
    local = 1
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        digits = "".join(c for c in os.environ.get(var, "").split("(")[0].split(",")[0] if c.isdigit())
        if digits and int(digits) > 0:
            local = int(digits)
            break
    shared = f", shared by {local} ranks: {ram / local / GIB:.1f} GiB each" if local > 1 else ""
    return ram // local, f"the CPU's RAM is {ram / GIB:.1f} GiB{shared}"


def _world_size() -> int:
    import os

    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def check_batch(cfg) -> None:
    """The memory plan of ``cfg`` at load: the trained module's weights, gradients, optimizer state and
    EMA under the run's strategy, plus one micro-batch's activations (``system.batch_size`` x the
    per-sample estimate). A plan above the device's memory is a ``ConfigError`` with the numbers; above
    80% of it, a warning. Skipped when the trained module's config cannot be read yet (a hub id not in
    the cache, a pipeline the quickstart builds at start-up) or the device is not on this machine
    (``system.device=cuda`` and no GPU visible: the run stops on that itself)."""
    import logging

    from .config import ConfigError

    m = cfg.model
    folder, conf = _trained_config(cfg)
    if conf is None or _kind(cfg, conf) is None:
        return
    kind = _kind(cfg, conf)
    per_batch = micro_batch_activations(cfg, config=conf)
    from .memory_load import meta_params, safetensors_params

    n_params = (safetensors_params(folder) if folder else None) or meta_params(kind, conf)
    strategy = cfg.distributed.strategy
    if strategy == "fsdp" and cfg.distributed.fsdp_cpu_offload:
        strategy = "fsdp_offload"
    world = _world_size()
    ema = m.use_ema and m.ema.device != "cpu"
    state = trained_state_bytes(n_params, cfg.optimizer.name, ema, strategy, world)
    what = f"{n_params / 1e6:,.1f}M parameters"
    if m.adapter.enabled:  # only the adapter trains; the base is frozen in the training precision
        from .memory_load import adapter_state_bytes, plan_adapter

        fam = _family_class(cfg)
        planned = plan_adapter(cfg, kind, conf, getattr(fam, "adapter_presets", {}), _family_of(cfg)[0])
        if planned is None:  # targets that resolve to nothing: the run says so when it builds the net
            return
        per_trained = 4 + 4 + OPTIMIZER_BYTES.get(cfg.optimizer.name, 8) + (4 if ema else 0)
        state = adapter_state_bytes(planned, per_trained, strategy, world)
        what = (f"a LoRA of {planned.trained / 1e6:,.2f}M parameters on {planned.layers:,} layers; the frozen base's "
                f"{planned.base / 1e6:,.1f}M parameters at {planned.base_bytes} bytes")
    device = device_memory(cfg.system.device)
    if device is None:
        return
    memory, where = device
    need = state + per_batch
    batch = cfg.system.batch_size
    per_sample = per_batch / batch
    numbers = (f"about {need / GIB:,.1f} GiB per device: activations {per_sample / 2**20:,.1f} MiB per sample "
               f"(a rough lower estimate) x system.batch_size={batch:,} = {per_batch / GIB:,.1f} GiB, plus "
               f"{state / GIB:,.2f} GiB of the {kind}'s weights, gradients, optimizer state"
               f"{' and EMA' if ema else ''} ({what}, {strategy}"
               f"{f' over {world} ranks' if strategy == 'fsdp' else ''})")
    if need > memory:
        fits = int((memory - state) // per_sample) if memory > state else 0
        hint = (f"At most about {fits:,} samples fit: lower system.batch_size and raise system.gradient_accumulation "
                "(or set system.global_batch_size) to keep the images per step" if fits >= 1 else
                "Not even one sample fits: use a smaller dataset.params.resolution, distributed.strategy=fsdp or "
                "distributed.fsdp_cpu_offload")
        ckpt = "" if m.gradient_checkpointing else "; model.gradient_checkpointing=true keeps a tenth to a quarter of the activations"
        raise ConfigError(f"system.batch_size={batch:,} at dataset.params.resolution={cfg.dataset.params.resolution} "
                          f"does not fit: the memory plan needs {numbers}, and {where}. {hint}{ckpt}")
    if need > LOAD_WARN_FRACTION * memory:
        logging.getLogger(__name__).warning("the memory plan needs %s: over %d%% of what %s; the run may run out "
                                            "of memory", numbers, int(100 * LOAD_WARN_FRACTION), where)


def _trained_config(cfg) -> tuple[str | None, dict | None]:
    """(weights folder, config) of the trained module as the config names it: the VAE (train_target vae),
    else the family's trained component (``model.<net_name>``: its params, or its folder's config.json)."""
    m = cfg.model
    if m.train_target == "vae":
        return _component_folder(m.vae.pretrained or m.pretrained, "vae", m.revision)
    net_name, net_class, _text = _family_of(cfg)
    comp = getattr(m, net_name, None)
    if comp is None:
        return None, None
    if getattr(comp, "params", None):
        conf = dict(comp.params)
        if net_class or net_name != "unet":  # a family that names no class: not read as a UNet's params
            conf.setdefault("_class_name", net_class or f"<{net_name}>")
        return None, conf
    return _component_folder(comp.pretrained or m.pretrained, net_name, m.revision)


def check_plan(rows: list[MemoryRow], chosen: str, device: str, cfg) -> None:
    """The start-up plan (modules as built, ``chosen`` strategy) against the device's memory: the same
    refusal as ``check_batch`` for runs whose modules could not be read at load (a hub id, the
    quickstart's pipeline)."""
    from .config import ConfigError

    row = next((r for r in rows if r.strategy == chosen), None)
    found = device_memory(device)
    if row is None or found is None or not row.activations:
        return
    memory, where = found
    if row.total * GIB > memory:
        batch = cfg.system.batch_size
        raise ConfigError(
            f"system.batch_size={batch:,} at dataset.params.resolution={cfg.dataset.params.resolution} does not fit: "
            f"the memory plan needs about {row.total:,.1f} GiB per device ({row.activations:,.1f} GiB of activations, a "
            f"rough lower estimate, {row.activations / batch * 1024:,.1f} MiB per sample; the rest weights, gradients, "
            f"optimizer state, EMA and frozen components), and {where}. Lower system.batch_size and raise "
            "system.gradient_accumulation (or set system.global_batch_size), or set model.gradient_checkpointing=true")


if __name__ == "__main__":  # python -m sd_training.memory_plan --table [--world-size 8] [--resolution 1024]
    import argparse

    parser = argparse.ArgumentParser(description="Reference memory plans of known diffusion transformers")
    parser.add_argument("--table", action="store_true", help="print the README's markdown table")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=1024)
    args = parser.parse_args()
    if args.table:
        from .memory_transformer import reference_table

        print(reference_table(args.world_size, args.resolution))
