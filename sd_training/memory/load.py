"""The memory plan at config load (``memory.fit.check_batch`` uses it), before anything is built: the
trained module's parameters counted from its weight files' headers or built on the meta device (no
memory: as the class its family names, ``Family.planned_net_class``), and with ``model.adapter`` the
adapter's parameters: its layers resolved as ``sd_training.adapters`` resolves them (the family's preset,
``target_modules`` or ``target_regex``), and the adapter's parameters counted from the layers' shapes: a
LoRA of rank r on a layer with ``in`` inputs (a convolution's in_channels x kernel area) and ``out``
outputs holds ``r x (in + out)`` parameters (``lora_A``, ``lora_B``), plus ``out`` with DoRA (its
magnitude vector). Once the modules are built, the start-up plan counts the adapter's real parameters
instead (``memory.plan.memory_plan``).

The frozen base is stored in the training precision (2 bytes under bf16 / fp16, fp32 under FSDP, which
shards it), with no gradients and no optimizer state; the adapter's parameters train in fp32 with
gradients, optimizer state and (model.use_ema) an EMA.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from ..adapters import _layer_size, layer_params, resolve_targets
from ..config import ConfigError
from ..config.patterns import PatternTimeout


def json_file(path: str) -> dict | None:
    """A JSON object file's contents; None when it cannot be read or is not an object."""
    try:
        with open(path, encoding="utf-8") as fh:
            out = json.load(fh)
        return out if isinstance(out, dict) else None
    except (OSError, ValueError):
        return None


def safetensors_params(folder: str, stem: str = "diffusion_pytorch_model") -> int | None:
    """Parameters in a component folder's safetensors weights, from the files' headers (nothing loaded);
    None when there are none. ``stem``: diffusers' file name, or transformers' ``model``."""
    index = json_file(os.path.join(folder, f"{stem}.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values())) if index and isinstance(index.get("weight_map"), dict) else [
        f"{stem}.safetensors"]
    total = 0
    for name in files:
        try:
            with open(os.path.join(folder, name), "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                if size > 100 * 2**20:
                    return None
                header = json.loads(fh.read(size))
        except (OSError, ValueError, struct.error):
            return None
        for key, entry in header.items():
            if key != "__metadata__" and isinstance(entry, dict):
                n = 1
                for dim in entry.get("shape", ()):
                    n *= int(dim)
                total += n
    return total


def meta_module(conf: dict, class_name: str | None = None) -> torch.nn.Module | None:
    """The module ``conf`` builds (``class_name``, else its ``_class_name``: a diffusers or transformers
    class, named by the family that trains it) on the meta device (no memory); None when it does not build."""
    import diffusers
    import transformers

    name = class_name or conf.get("_class_name")
    cls = getattr(diffusers, str(name), None) or getattr(transformers, str(name), None)
    if cls is None:
        return None
    args = {k: v for k, v in conf.items() if not k.startswith("_")}
    try:
        with torch.device("meta"):
            if hasattr(cls, "config_class") and not hasattr(cls, "from_config"):  # transformers: Config object
                return cls(cls.config_class(**args))
            return cls.from_config(args)
    except Exception:  # noqa: BLE001 -- a config the class refuses is reported when the run builds it
        return None


def meta_params(conf: dict, class_name: str | None = None) -> int:
    """Parameters of the module ``conf`` builds, counted on the meta device; 0 if it does not build."""
    module = meta_module(conf, class_name)
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


@dataclass
class PlannedAdapter:
    trained: int  # the adapter's parameters (the net's; text-encoder adapters are planned at start-up)
    base: int  # the net's frozen parameters
    base_bytes: float  # bytes per base parameter as stored (the training precision; fp32 under FSDP; quantised)
    layers: int  # adapted layers
    quantizable: int = 0  # the base's weights model.adapter.base_quantization would quantise (its blocks' Linears)


def lora_params(module: torch.nn.Module, targets: list[str], rank: int, dora: bool = False, kind: str = "lora",
                factor: int = -1, decompose_both: bool = False) -> int:
    """Parameters of an adapter of ``rank`` on the layers ``targets`` of ``module`` (see the module doc):
    a LoRA (``kind``), DoRA's magnitude with ``dora``, or a LoKr / LoHa as peft makes them
    (``adapters.layer_params``, with LoKr's ``factor`` and ``decompose_both``)."""
    layers = dict(module.named_modules())
    total = 0
    for name in targets:
        layer = layers[name]
        _, n_out = _layer_size(layer)
        if isinstance(layer, torch.nn.Conv2d):
            kh, kw = layer.kernel_size
            n_in, kernel = layer.in_channels // layer.groups, kh * kw
        else:
            n_in, kernel = layer.in_features, 1
        total += layer_params(n_in, n_out, rank, kind, factor, decompose_both, kernel) + (n_out if dora else 0)
    return total


def family_units(family: type, net: torch.nn.Module, kind: str = "compile_units") -> list[torch.nn.Module]:
    """A family's ``compile_units`` / ``swap_units`` of ``net`` before anything is built (the plans read nets on
    the meta device): called on an instance made without its ``__init__``, as the units depend on the net alone."""
    return getattr(object.__new__(family), kind)(net) or []


def quantized_base_bytes(backend: str, total: int, quantizable: int, gguf: str | None = None) -> float | None:
    """Bytes per base parameter with ``backend`` (``model.adapter.base_quantization``): its ``quantizable``
    weights at the backend's measured size, the rest of the ``total`` in bf16; a GGUF file's size over the net's
    parameters; None for ``none``."""
    from ..families.components.quantized_base import BYTES_PER_PARAM

    if backend == "gguf" and gguf and os.path.isfile(gguf):
        return os.path.getsize(gguf) / max(total, 1)
    if backend not in BYTES_PER_PARAM:
        return None
    return (quantizable * BYTES_PER_PARAM[backend] + (total - quantizable) * 2) / max(total, 1)


def plan_adapter(cfg, conf: dict, class_name: str, presets: dict[str, str], net_name: str,
                 family=None) -> PlannedAdapter | None:
    """The adapter ``cfg.model.adapter`` would put on the net ``conf`` builds (a ``class_name``); None when
    the net does not build on the meta device or the targets resolve to nothing (the run reports that when
    it builds). ``family`` (its class): the base's quantisable weights are counted in its blocks."""
    a = cfg.model.adapter
    net = meta_module(conf, class_name)
    if net is None:
        return None
    try:
        targets = resolve_targets(net, presets, a.targets, list(a.target_modules), a.target_regex, "model.adapter",
                                  net_name)
    except PatternTimeout:
        raise  # the user's target_regex: refused at load, never retried at start-up
    except ConfigError:
        return None
    total = sum(p.numel() for p in net.parameters())
    half = cfg.model.mixed_precision in ("bf16", "fp16") and cfg.distributed.strategy not in ("fsdp", "hsdp")
    trained = lora_params(net, targets, a.rank, a.use_dora, a.type, a.lokr_factor, a.decompose_both)
    from ..families.components.quantized_base import quantizable_weights

    quantizable = quantizable_weights(family_units(family, net)) if family is not None else 0
    base = quantized_base_bytes(a.base_quantization, total, quantizable, a.base_gguf) or (2 if half else 4)
    return PlannedAdapter(trained, total, base, len(targets), quantizable)


def adapter_state_bytes(planned: PlannedAdapter, per_trained: int, strategy: str, world_size: int) -> float:
    """Per device: the adapter's weights, gradients, optimizer state and EMA (``per_trained`` bytes each) and
    the frozen base as stored, under ``strategy`` (fsdp: 1/world_size; fsdp_offload: none on the device)."""
    if strategy == "fsdp_offload":
        return 0.0
    both = planned.trained * per_trained + planned.base * planned.base_bytes
    return both / (world_size if strategy in ("fsdp", "hsdp") else 1)  # hsdp: world_size is the shard group's
