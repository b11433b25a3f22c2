"""Will the run fit? The memory plan at config load, before anything is built, and what to change when
it will not fit.

``check_batch`` (called by the config check) counts the trained module's parameters from its weight
files' headers or on the meta device (``memory.load``), adds one micro-batch's activations (the rough
lower estimate its family gives: ``Family.sample_activation_elements``) and compares the total with
the device's memory: above it the config is refused, above 80% of it a warning is logged. Either way,
when the run does not fit, :func:`advise` says which settings would: it tries the memory levers a user of
one GPU reaches for, alone and together, and names the cheapest sets that fit with 10% to spare (the
plan is a lower bound):

- ``model.gradient_checkpointing=true``: keeps a tenth to a quarter of the activations (slower);
- ``optimizer.name=adamw8bit``: 2 bytes of optimizer state per parameter instead of 8;
- ``optimizer.in_backward=true`` (with ``optimizer.params.max_grad_norm=null``): no gradients of the whole net;
- ``model.ema.device=cpu``: the EMA leaves the GPU;
- ``distributed.strategy=fsdp``: the state sharded over the ranks (several ranks);
- ``distributed.fsdp_cpu_offload=true``: the state in CPU memory, on one rank too;
- a smaller ``system.batch_size`` with accumulation to keep the images per step.

``scripts/plan_memory.py config=... --gpu-gb 24`` prints the same for a GPU this machine does not have.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from dataclasses import dataclass, replace

import torch

from ..config import ConfigError
from ..config.dataset import is_latent_type
from ..config.rules import text_encoder_placement
from ..families import registry
from .activations import SampleShape
from ..speed import block_swap
from .load import (adapter_state_bytes, family_units, json_file, meta_module, meta_params, plan_adapter, quantized_base_bytes,
                   safetensors_params)
from .plan import GIB, MemoryRow, per_trained_param

log = logging.getLogger(__name__)
LOAD_WARN_FRACTION = 0.8  # a plan above this share of the device's memory is logged as a warning
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # a frozen component's model.*.dtype
ADVICE_FRACTION = 0.9  # advised settings leave this share of the memory for what the plan does not count


# ----------------------------------------------------------------------------------------------
# What the config says about the trained module, read without building it
# ----------------------------------------------------------------------------------------------

def _family(cfg):
    """The family class whose module the run trains; the default family's while the pipeline cannot be
    read (a hub id not in the cache: its components are read as the default family's)."""
    return registry.trained_family(cfg) or registry.FAMILIES[registry.DEFAULT_FAMILY]


def _planned_class(cfg, conf: dict, family=None) -> str | None:
    """The class of the trained module ``conf`` (its config) when its family's estimate knows it: the class
    the family (``family``, else the run's) names for this run, which a config.json's ``_class_name`` must
    match; else None."""
    name = (family or _family(cfg)).planned_net_class(cfg)
    return name if name and conf.get("_class_name") in (None, "", name) else None


def _component_folder(src: str | None, sub: str, revision: str | None) -> tuple[str | None, dict | None]:
    """(folder, config.json) of component ``sub`` of a pipeline root, a component folder, or a hub id in
    the local cache; (None, None) when it cannot be read without building anything."""
    if not src:
        return None, None
    for folder in (os.path.join(src, sub), src):
        conf = json_file(os.path.join(folder, "config.json")) if os.path.isfile(os.path.join(folder, "config.json")) else None
        if conf is not None:
            return folder, conf
    if os.path.exists(src) or src.startswith((".", "/", "~")):
        return None, None
    try:  # a hub id: its cached config, if any (nothing is downloaded)
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(src, f"{sub}/config.json", revision=revision)
        if isinstance(path, str):
            return os.path.dirname(path), json_file(path)
    except Exception:  # noqa: BLE001 -- no cache, an odd id: no estimate at load (the start-up plan has one)
        pass
    return None, None


def _vae_config(cfg) -> dict:
    m = cfg.model
    return _component_folder(m.vae.pretrained or m.pretrained, "vae", m.revision)[1] or {}


def vae_factor(cfg) -> int:
    """Pixels per latent pixel: 2^(VAE levels - 1) from the VAE's config.json, else Stable Diffusion's 8."""
    levels = len(_vae_config(cfg).get("block_out_channels") or (0,) * 4)
    return 2 ** (levels - 1)


def trained_config(cfg) -> tuple[str | None, dict | None]:
    """(weights folder, config) of the trained module as the config names it: the family's trained
    component (``model.<net_name>``: its params, or its folder's config.json); a from-scratch module's
    params are read as the class its family names."""
    m, fam = cfg.model, _family(cfg)
    comp = getattr(m, fam.net_name, None)
    if comp is None:
        return None, None
    if getattr(comp, "params", None):
        conf = {**fam.net_defaults(), **comp.params}  # what the class builds from the params
        conf.setdefault("_class_name", fam.planned_net_class(cfg) or f"<{fam.net_name}>")
        return None, conf
    return _component_folder(comp.pretrained or m.pretrained, fam.net_name, m.revision)


def sample_activations(cfg, conf: dict, checkpointing: bool, text_tokens: int | None = None, family=None) -> float:
    """Bytes one sample's activations take in the trained module ``conf`` (its config) at the run's
    resolution and precision (with ``dataset.params.references`` reference images of the target's size),
    as its family estimates them; 0 when the family's estimate does not know the module. ``text_tokens``:
    per sample, beside the image (None: the family's ``Family.text_tokens``, else CLIP's 77); ``family``:
    the run's family class when it is built (None: told from ``cfg``)."""
    fam = family or _family(cfg)
    if _planned_class(cfg, conf, fam) is None:
        return 0.0
    compute = 2 if cfg.model.mixed_precision in ("bf16", "fp16") else 4
    vae = _vae_config(cfg)
    text = text_tokens if text_tokens is not None else int(fam.text_tokens(cfg) or 77)
    sample = SampleShape(cfg.dataset.params.resolution, vae_factor(cfg), vae.get("latent_channels"), text,
                         references=int(cfg.dataset.params.references))
    return fam.sample_activation_elements(conf, sample, checkpointing) * compute


def micro_batch_activations(cfg, net: torch.nn.Module | None = None, config: dict | None = None,
                            text_tokens: int | None = None, family=None) -> float:
    """Bytes of one micro-batch's activations for the run ``cfg`` (``system.batch_size`` samples at
    ``dataset.params.resolution``, as ``model.gradient_checkpointing`` says), from the trained module's
    config (``net.config`` or ``config``), as ``family`` (the built family's class; None: the run's, told
    from ``cfg``) estimates them."""
    conf = dict(config if config is not None else getattr(net, "config", None) or {})
    per_sample = sample_activations(cfg, conf, cfg.model.gradient_checkpointing, text_tokens, family)
    return cfg.system.batch_size * per_sample


# ----------------------------------------------------------------------------------------------
# The estimate under a setting, and the settings that would fit
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """What the load-time plan depends on besides the model: one micro-batch and the memory levers."""

    batch: int
    checkpointing: bool
    optimizer: str
    in_backward: bool
    ema_on_device: bool
    strategy: str  # ddp | fsdp | hsdp | fsdp_offload
    world: int
    text_on_device: bool = True  # the frozen text encoders stay on the device (model.text_encoder_placement)
    swap: int = 0  # model.block_swap: the net's last blocks in host memory
    quant: str = "none"  # model.adapter.base_quantization
    shard: int = 0  # hsdp: the ranks of one shard group (what a copy of the state is sharded over)

    @property
    def divisor(self) -> int:
        """The ranks each GPU's share of the trained state is counted over: all under fsdp, the shard
        group under hsdp (the other groups are replicas), one otherwise."""
        return {"fsdp": self.world, "hsdp": self.shard or self.world}.get(self.strategy, 1)


@dataclass
class LoadPlan:
    """The trained module as read at load: bytes per device for any :class:`Setting`."""

    kind: str  # the trained module's component name (its family's net_name), for messages
    params: int  # trained parameters (the adapter's with model.adapter)
    what: str  # how they were counted, for messages
    per_sample: tuple[float, float]  # one sample's activations (without, with gradient checkpointing)
    planned_adapter: object | None  # memory.load.PlannedAdapter
    frozen_text: float = 0.0  # bytes of the frozen text encoders, whole on every device unless kept off it
    frozen_what: str = ""  # which, for messages
    # model.block_swap: each swappable block's parameters that would live in host memory (a full fine-tune's
    # all, at 4 bytes; an adapter's frozen base, at its base bytes), in execution order; () when none
    swap_units: tuple[int, ...] = ()
    quant: str = "none"  # the run's model.adapter.base_quantization (planned_adapter counts it)

    def activations(self, s: Setting) -> float:
        return s.batch * self.per_sample[s.checkpointing]

    def state(self, s: Setting) -> float:
        per = per_trained_param(s.optimizer, s.ema_on_device, s.in_backward)
        if self.planned_adapter is not None:
            planned = self.planned_adapter
            if s.quant not in (self.quant, "none"):  # a lever's backend (the run's own is in planned.base_bytes)
                planned = replace(planned, base_bytes=quantized_base_bytes(s.quant, planned.base, planned.quantizable))
            return adapter_state_bytes(planned, per, s.strategy, s.divisor)
        if s.strategy == "fsdp_offload":
            return 0.0
        return self.params * per / s.divisor

    def swapped_bytes(self, s: Setting) -> float:
        """What ``s.swap`` blocks take off the device: their weights in host memory, less the two largest of
        them in flight at a time (``speed.block_swap``: gradients and optimizer state stay as counted)."""
        if not s.swap:
            return 0.0
        sizes = self.swap_units[len(self.swap_units) - s.swap:]
        per = self.planned_adapter.base_bytes if self.planned_adapter is not None else 4
        return (sum(sizes) - sum(sorted(sizes)[-block_swap.WINDOW:])) * per

    def resident(self, s: Setting) -> float:
        """What stays on the device whatever the batch: the trained state and the frozen text encoders."""
        return self.state(s) - self.swapped_bytes(s) + (self.frozen_text if s.text_on_device else 0.0)

    def need(self, s: Setting) -> float:
        return self.resident(s) + self.activations(s)


def current_setting(cfg) -> Setting:
    m, d = cfg.model, cfg.distributed
    strategy = "fsdp_offload" if d.strategy in ("fsdp", "hsdp") and d.fsdp_cpu_offload else d.strategy
    world = _world_size()
    return Setting(cfg.system.batch_size, bool(m.gradient_checkpointing), cfg.optimizer.name,
                   bool(cfg.optimizer.in_backward), bool(m.use_ema and m.ema.device != "cpu"), strategy,
                   world, text_encoder_placement(cfg) == "device", int(m.block_swap),
                   m.adapter.base_quantization if m.adapter.enabled else "none",
                   _shard_size(d.hsdp_shard_size, world) if strategy == "hsdp" else 0)


def swap_unit_params(fam, conf: dict, class_name: str) -> tuple[int, ...]:
    """Each swappable block's parameters of the net ``conf`` builds on the meta device (all of them for a full
    fine-tune; an adapter's run swaps its frozen base, which is every parameter before the adapter is made)."""
    net = meta_module(conf, class_name)
    if net is None:
        return ()
    return tuple(sum(p.numel() for p in u.parameters()) for u in family_units(fam, net, "swap_units"))


def frozen_text_encoders(cfg, fam) -> tuple[float, str]:
    """(bytes, which) of the run's frozen text encoders as stored (the training precision's 2 bytes under bf16 /
    fp16, else 4; an explicit ``model.text_encoder.dtype`` kept), counted from each component folder's weight
    headers (else its config.json on the meta device), nothing built; encoders that cannot be read are left out,
    and a trained one is not frozen (0)."""
    m = cfg.model
    if m.text_encoder.train or m.adapter.text_encoders.train:
        return 0.0, ""
    half = m.mixed_precision in ("bf16", "fp16")
    per = DTYPE_BYTES.get(m.text_encoder.dtype, 2 if half else 4)
    total, names = 0, []
    for name in fam.loaded_text_components(cfg):
        comp = getattr(m, name, None)
        folder, conf = _component_folder(getattr(comp, "pretrained", None) or m.pretrained, name, m.revision)
        if conf is None:
            continue
        archs = conf.get("architectures") or [None]
        n = (safetensors_params(folder, "model") if folder else None) or meta_params(conf, archs[0])
        if n:
            total, names = total + n * per, [*names, f"{name} {n / 1e9:,.2f}B"]
    return float(total), ", ".join(names)


def load_plan(cfg) -> LoadPlan | None:
    """The trained module of ``cfg`` counted without building it; None when its config cannot be read
    yet (a hub id not in the cache, a pipeline the quickstart builds at start-up), its family's estimate
    does not know it, or an adapter's targets resolve to nothing (the build reports that)."""
    folder, conf = trained_config(cfg)
    class_name = _planned_class(cfg, conf) if conf is not None else None
    if class_name is None:
        return None
    fam = _family(cfg)
    per_sample = (sample_activations(cfg, conf, False), sample_activations(cfg, conf, True))
    n_params = (safetensors_params(folder) if folder else None) or meta_params(conf, class_name)
    text = frozen_text_encoders(cfg, fam)
    units = swap_unit_params(fam, conf, class_name)
    if not cfg.model.adapter.enabled:
        return LoadPlan(fam.net_name, n_params, f"{n_params / 1e6:,.1f}M parameters", per_sample, None, *text, units)
    planned = plan_adapter(cfg, conf, class_name, fam.adapter_presets, fam.net_name, fam)
    if planned is None:
        return None
    what = (f"a LoRA of {planned.trained / 1e6:,.2f}M parameters on {planned.layers:,} layers; the frozen base's "
            f"{planned.base / 1e6:,.1f}M parameters at {planned.base_bytes:.3g} bytes")
    return LoadPlan(fam.net_name, planned.trained, what, per_sample, planned, *text, units,
                    cfg.model.adapter.base_quantization)


def _swap_lever(cfg, s: Setting, blocks: int) -> tuple[str, dict, int] | None:
    """model.block_swap with what it needs (speed.block_swap.check_config): one process, gradient checkpointing,
    and for a full fine-tune the optimizer in the backward and no EMA on the device. ``blocks``: all of the
    net's (advise lowers it to the fewest that fit)."""
    if not blocks or s.swap or s.strategy != "ddp" or s.world > 1:
        return None
    keys, change = [f"model.block_swap={blocks}"], dict(swap=blocks)
    if not s.checkpointing:
        keys.append("model.gradient_checkpointing=true")
        change["checkpointing"] = True
    if not cfg.model.adapter.enabled:
        if not s.in_backward:
            if cfg.system.gradient_accumulation > 1 or cfg.model.mixed_precision == "fp16":
                return None  # in_backward refuses them
            keys.append("optimizer.in_backward=true" + (" optimizer.params.max_grad_norm=null"
                                                        if cfg.optimizer.params.max_grad_norm else ""))
            change["in_backward"] = True
        if s.ema_on_device:
            keys.append("model.ema.device=cpu")
            change["ema_on_device"] = False
    return " ".join(keys), change, 4  # a copy of each swapped block in per forward and per backward


# (keys to set, how it changes the setting, what it costs: lower is tried first)
def _levers(cfg, s: Setting, swap_blocks: int = 0) -> list[tuple[str, dict, int]]:
    out = []
    if not s.checkpointing:
        out.append(("model.gradient_checkpointing=true", dict(checkpointing=True), 3))
    if s.optimizer == "adamw":
        out.append(("optimizer.name=adamw8bit", dict(optimizer="adamw8bit"), 1))
    accumulation = cfg.system.gradient_accumulation
    if cfg.system.global_batch_size:
        accumulation = max(1, cfg.system.global_batch_size // max(1, s.batch * s.world))
    in_backward_ok = (not s.in_backward and accumulation == 1 and cfg.model.mixed_precision != "fp16"
                      and s.optimizer in ("adamw", "adamw8bit", "adafactor", "sgd", "lion", "came"))
    if in_backward_ok and not (s.strategy == "ddp" and s.world > 1):
        keys = "optimizer.in_backward=true" + (" optimizer.params.max_grad_norm=null" if cfg.optimizer.params.max_grad_norm else "")
        out.append((keys, dict(in_backward=True), 1))
    if s.ema_on_device:
        out.append(("model.ema.device=cpu", dict(ema_on_device=False), 1))
    if s.strategy == "ddp" and s.world > 1:
        out.append(("distributed.strategy=fsdp", dict(strategy="fsdp"), 1))
    if s.strategy == "hsdp" and s.divisor < s.world:  # shard over every rank: gathers cross nodes (slower)
        out.append(("distributed.strategy=fsdp", dict(strategy="fsdp"), 2))
    if s.strategy != "fsdp_offload":
        keys = ("distributed.strategy=fsdp " if s.strategy == "ddp" else "") + "distributed.fsdp_cpu_offload=true"
        out.append((keys, dict(strategy="fsdp_offload"), 5))
    # Stored text states: the steps never run the text encoders, so host memory holds them (auto does that
    # unless the config says device); online, each step would move them: no lever.
    if s.text_on_device and cfg.dataset.params.text_embeddings and is_latent_type(cfg.dataset.type):
        out.append(("model.text_encoder_placement=offload", dict(text_on_device=False), 1))
    swap = _swap_lever(cfg, s, swap_blocks)
    a = cfg.model.adapter
    if a.enabled and a.type == "lora" and s.quant == "none" and not cfg.model.fp8 and not a.export_merged:
        # a 4-bit base: a third of bf16's bytes (components.quantized_base), dequantised in each forward
        out.append(("model.adapter.base_quantization=nf4", dict(quant="nf4"), 2))
    return out + ([swap] if swap else [])


@dataclass
class Advice:
    changes: list[str]  # key=value overrides
    need: float  # bytes per device with them
    batch: int  # system.batch_size with them (the run's, or lower)


def advise(plan: LoadPlan, cfg, memory: float, limit: int = 3, fraction: float = ADVICE_FRACTION) -> list[Advice]:
    """Up to ``limit`` sets of changes with which ``plan`` needs at most ``fraction`` of ``memory``: the
    smallest sets first (no set contains a smaller one that fits), cheapest in speed among equals. When no
    set fits the run's micro-batch, the largest micro-batch that fits with all of them, if any."""
    s = current_setting(cfg)
    budget = fraction * memory
    if plan.need(s) <= budget:
        return []
    levers = _levers(cfg, s, len(plan.swap_units))
    found: list[tuple[int, int, Advice, frozenset]] = []
    for k in range(1, len(levers) + 1):
        for combo in itertools.combinations(range(len(levers)), k):
            if any(fits <= set(combo) for *_, fits in found):
                continue  # a smaller set already fits
            setting = s
            for i in combo:
                setting = replace(setting, **levers[i][1])
            if setting.strategy == "fsdp_offload" and any(levers[i][0] == "distributed.strategy=fsdp" for i in combo):
                continue  # offload already shards
            if (setting.swap or setting.quant != s.quant) and setting.strategy != "ddp":
                continue  # block swap is for one process, a quantised base is not sharded (FSDP shards itself)
            if setting.swap and setting.quant != "none":
                continue  # quantised weights do not swap (speed.block_swap: plain tensors only)
            need = plan.need(setting)
            if need <= budget:
                cost = sum(levers[i][2] for i in combo)
                changes = [levers[i][0] for i in combo]
                if setting.swap:  # the fewest blocks that fit
                    fewest = next(n for n in range(1, setting.swap + 1)
                                  if plan.need(replace(setting, swap=n)) <= budget)
                    changes = [c.replace(f"model.block_swap={setting.swap}", f"model.block_swap={fewest}")
                               for c in changes]
                    need = plan.need(replace(setting, swap=fewest))
                found.append((k, cost, Advice(changes, need, s.batch), frozenset(combo)))
    found.sort(key=lambda x: (x[0], x[1]))
    out = [a for *_, a, _f in found[:limit]]
    smaller = _largest_batch(plan, s, budget)
    if smaller and smaller < s.batch:
        out.append(Advice([f"system.batch_size={smaller}"], plan.need(replace(s, batch=smaller)), smaller))
    elif not out:
        every, keys = s, []
        for key, change, _cost in levers:
            if key != "distributed.strategy=fsdp" and not {"swap", "quant"} & set(change):  # offload shards too
                every, keys = replace(every, **change), [*keys, key]
        best = _largest_batch(plan, every, budget)
        if best:
            out.append(Advice([*keys, f"system.batch_size={best}"], plan.need(replace(every, batch=best)), best))
    return out


def _largest_batch(plan: LoadPlan, s: Setting, budget: float) -> int:
    per = plan.activations(replace(s, batch=1))
    room = budget - plan.resident(s)
    return int(room // per) if per > 0 and room >= per else 0


# What each lever costs in speed, said with the advice (key prefix -> note)
SPEED = {
    "model.gradient_checkpointing": "recomputes each block in the backward: about a third slower",
    "optimizer.name=adamw8bit": "about free",
    "optimizer.in_backward": "about free; no gradient clipping",
    "model.ema.device=cpu": "the EMA update on the CPU",
    "model.text_encoder_placement=offload": "a copy of the text encoders onto the GPU per sample grid",
    "model.adapter.base_quantization": "each block's weights dequantised in every forward: slower steps",
    "model.block_swap": "each swapped block copied in per forward and backward, hidden while compute is longer",
    "distributed.strategy=fsdp": "shards over the ranks; gathers each block",
    "distributed.fsdp_cpu_offload": "the optimizer steps on the CPU: much slower",
}


def speed_notes(changes: list[str]) -> str:
    """The speed cost of a set of changes, from :data:`SPEED`."""
    notes = [note for key, note in SPEED.items() if any(key in c for c in changes)]
    return f" [{'; '.join(notes)}]" if notes else ""


def format_advice(advice: list[Advice], cfg, fraction: float = ADVICE_FRACTION) -> str:
    if not advice:
        return ("No setting this plan knows fits: train a LoRA (model.adapter.type=lora), lower "
                "dataset.params.resolution, or use more GPUs with distributed.strategy=fsdp")
    lines = []
    for a in advice:
        keep = ""
        if a.batch < cfg.system.batch_size:
            keep = " (raise system.gradient_accumulation, or set system.global_batch_size, to keep the images per step)"
        lines.append(f"{' '.join(a.changes)} -> about {a.need / GIB:,.1f} GiB{keep}{speed_notes(a.changes)}")
    return f"Settings that would fit in {100 * fraction:.0f}% of it: " + "; or ".join(lines)


# ----------------------------------------------------------------------------------------------
# The device, and the check at config load
# ----------------------------------------------------------------------------------------------

def device_memory(device: str) -> tuple[int, str] | None:
    """(bytes, description) of the memory one rank may use: the CUDA device's (``LOCAL_RANK``'s), or on
    the CPU the machine's RAM (or its cgroup limit) divided among the ranks on the machine. None for
    ``cuda`` where no GPU is visible (a config checked on another machine than the one it runs on)."""
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
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def _shard_size(configured: int, world: int) -> int:
    """hsdp's shard group as the launcher's variables say before the process group is up (the key, else the
    ranks of one node: torchrun's LOCAL_WORLD_SIZE, SLURM's tasks per node), at most the rank count. One that
    does not divide it is refused at start-up (``distributed.hsdp_shard_size``), not here."""
    local = 0
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        m = re.match(r"\d+", os.environ.get(var, ""))
        if m and int(m.group(0)) > 0:
            local = int(m.group(0))
            break
    return max(1, min(configured or local or world, world))


def describe(plan: LoadPlan, cfg) -> str:
    s = current_setting(cfg)
    per_batch, swapped = plan.activations(s), plan.swapped_bytes(s)
    state = plan.state(s) - swapped
    ema = " and EMA" if s.ema_on_device else ""
    over = {"fsdp": f" over {s.world} ranks", "hsdp": f" over a shard group of {s.divisor} of the {s.world} ranks"
            }.get(s.strategy, "")
    over += f"; {swapped / GIB:,.2f} GiB of it in host memory (model.block_swap={s.swap})" if swapped else ""
    text = plan.frozen_text if s.text_on_device else 0.0
    frozen = f", plus {text / GIB:,.2f} GiB of frozen text encoders ({plan.frozen_what})" if text else ""
    return (f"about {(state + per_batch + text) / GIB:,.1f} GiB per device: activations "
            f"{plan.per_sample[s.checkpointing] / 2**20:,.1f} MiB per sample (a rough lower estimate) x "
            f"system.batch_size={s.batch:,} = {per_batch / GIB:,.1f} GiB, plus {state / GIB:,.2f} GiB of the "
            f"{plan.kind}'s weights, gradients, optimizer state{ema} ({plan.what}, {s.strategy}{over}){frozen}")


def need_bytes(plan: LoadPlan, cfg) -> float:
    """Bytes per device the plan needs under the run's own settings."""
    return plan.need(current_setting(cfg))


def check_batch(cfg) -> None:
    """The memory plan of ``cfg`` at load: the trained module's weights, gradients, optimizer state and
    EMA under the run's strategy, plus one micro-batch's activations. A plan above the device's memory is
    a ``ConfigError`` with the numbers and the settings that would fit; above 80% of it, a warning with
    them. Skipped when the trained module cannot be read yet (``load_plan``) or the device is not on this
    machine (``system.device=cuda`` and no GPU visible: the run stops on that itself)."""
    plan = load_plan(cfg)
    device = device_memory(cfg.system.device) if plan is not None else None
    if plan is None or device is None:
        return
    memory, where = device
    need = need_bytes(plan, cfg)
    if need > memory:
        raise ConfigError(f"system.batch_size={cfg.system.batch_size:,} at dataset.params.resolution="
                          f"{cfg.dataset.params.resolution} does not fit: the memory plan needs {describe(plan, cfg)}, "
                          f"and {where}. {format_advice(advise(plan, cfg, memory), cfg)}")
    if need > LOAD_WARN_FRACTION * memory:  # the advice: what would leave room
        log.warning("the memory plan needs %s: over %d%% of what %s; the run may run out of memory. %s",
                    describe(plan, cfg), int(100 * LOAD_WARN_FRACTION), where,
                    format_advice(advise(plan, cfg, memory, fraction=LOAD_WARN_FRACTION), cfg, LOAD_WARN_FRACTION))


def check_plan(rows: list[MemoryRow], chosen: str, device: str, cfg) -> None:
    """The start-up plan (modules as built, ``chosen`` strategy) against the device's memory: the same
    refusal as ``check_batch`` for runs whose modules could not be read at load (a hub id, the
    quickstart's pipeline)."""
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
            "system.gradient_accumulation (or set system.global_batch_size), set model.gradient_checkpointing=true, "
            "optimizer.name=adamw8bit, optimizer.in_backward=true or distributed.fsdp_cpu_offload=true")


def report(cfg, memory: float, where: str) -> str:
    """The load-time plan of ``cfg`` against ``memory`` bytes (``where`` names them), with the settings that
    would fit when it does not (``scripts/plan_memory.py``)."""
    plan = load_plan(cfg)
    if plan is None:
        return ("The trained module cannot be read without building it: point model.pretrained (or the net's "
                "own pretrained) at a local folder or a hub id in the local cache, or give model.<net>.params")
    need = need_bytes(plan, cfg)
    lines = [f"The memory plan needs {describe(plan, cfg)}; {where}."]
    if need > LOAD_WARN_FRACTION * memory:
        verdict = "does not fit" if need > memory else f"is over {100 * LOAD_WARN_FRACTION:.0f}% of it"
        fraction = ADVICE_FRACTION if need > memory else LOAD_WARN_FRACTION
        lines.append(f"It {verdict}. {format_advice(advise(plan, cfg, memory, fraction=fraction), cfg, fraction)}")
    else:
        lines.append(f"It fits ({100 * need / memory:.0f}% of it).")
    return "\n".join(lines)
