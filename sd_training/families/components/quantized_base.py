"""``model.adapter.base_quantization``: the frozen base under an adapter stored quantised (every family).

The Linear layers inside the family's repeated blocks (``Family.compile_units``: the transformer blocks; a
UNet's ResNet and attention blocks, as ``model.fp8`` picks them) are replaced by a backend's layer holding
the weight in fewer bytes; the adapter (peft) wraps those layers and trains in fp32 on top. The embedders,
the final projection, norms and a UNet's convolutions stay in the training precision: they are a small part
of the weights and the layers where rounding hurts the image most (the same layers diffusers' and the
community trainers' fp8 / nf4 paths leave alone).

Backends (``BACKENDS``; what a base weight costs, measured by :func:`stored_bytes`, in ``BYTES_PER_PARAM``):

- ``nf4`` / ``int8``: bitsandbytes ``Linear4bit`` (4-bit NormalFloat, blocks of 64 with a double-quantised
  absmax, computed in the training precision) and ``Linear8bitLt`` (LLM.int8: a per-row absmax scale).
- ``int8_weight`` / ``fp8_weight``: torchao weight-only ``quantize_`` (``Int8WeightOnlyConfig``: per-row
  int8; ``Float8WeightOnlyConfig``: per-row float8 e4m3); the matmul runs in the training precision.
- ``gguf``: a GGUF file the user already has (``model.adapter.base_gguf``), loaded with diffusers'
  ``from_single_file(..., quantization_config=GGUFQuantizationConfig(compute_dtype))``: every Linear layer
  the file stores quantised stays so (the file decides), dequantised per forward.

One code path for the first four: the family builds its net as always (from ``pretrained`` or ``params``),
and :func:`quantize` replaces the layers of the built module layer by layer (diffusers' own
``BitsAndBytesConfig`` / ``TorchAoConfig`` loaders do the same replacement, but bitsandbytes' refuses a
machine without a GPU and neither applies to a net built from ``params``). The quantised layers are kept in
``<run>/quantized_base/`` (``quantized_base_store``) so that a requeued job reloads them instead of
quantising again."""

from __future__ import annotations

import copy
import logging

import torch

from ...config import ConfigError

log = logging.getLogger(__name__)

BACKENDS = ("none", "nf4", "int8", "int8_weight", "fp8_weight", "gguf")
BNB = ("nf4", "int8")
TORCHAO = ("int8_weight", "fp8_weight")
# Bytes each backend stores per weight of a quantised layer, scales included (measured by stored_bytes on
# 3072 x 3072 and 3072 x 12288 layers, Flux's widths): nf4 0.5 + an 8-bit absmax per 64 weights + its fp32
# scales; the 8-bit ones 1 + an fp32 scale per output row (4 / 3072). GGUF: the file's types decide (Q8_0 1.0625,
# Q4_K 0.5625 bytes per weight).
BYTES_PER_PARAM = {"nf4": 0.516, "int8": 1.0013, "int8_weight": 1.0013, "fp8_weight": 1.0013}


def enabled(cfg) -> bool:
    """``cfg``: the whole TrainConfig or its ``model`` section."""
    model = getattr(cfg, "model", cfg)
    adapter = getattr(model, "adapter", None)  # (a bare ModelConfig, as scripts and tests build one, has none)
    return adapter is not None and adapter.enabled and adapter.base_quantization != "none"


def build_device(cfg, device: torch.device) -> torch.device:
    """Where a family builds its trained net: the CPU when the base is quantised (it moves to ``device``
    layer by layer as it is quantised: the full-precision net never has to fit the GPU), else ``device``."""
    return torch.device("cpu") if enabled(cfg) else device


def build_dtype(cfg) -> torch.dtype:
    """The dtype a family reads its trained net in: fp32, or the training precision when the base is
    quantised (the full-precision copy in host memory is then half the size, and quantised from there)."""
    from ...speed.precision import autocast_dtype

    model = getattr(cfg, "model", cfg)
    return (autocast_dtype(model.mixed_precision) or torch.float32) if enabled(cfg) else torch.float32


# ---------------------------------------------------------------------------------------------- layers

def is_quantized(layer: torch.nn.Module) -> bool:
    """A layer whose weight a backend stores (bitsandbytes, torchao or GGUF)."""
    w = getattr(layer, "weight", None)
    return w is not None and (type(w).__module__.split(".")[0] in ("bitsandbytes", "torchao")
                              or type(w).__name__ == "GGUFParameter")


def targets(units: list[torch.nn.Module], net: torch.nn.Module) -> list[str]:
    """The full names (in ``net``) of the Linear layers inside ``units``, each once."""
    inside = {id(m) for u in units for m in u.modules() if type(m) is torch.nn.Linear}
    return [n for n, m in net.named_modules() if id(m) in inside]


def quantizable_weights(units: list[torch.nn.Module]) -> int:
    """The weights :func:`targets` would quantise in ``units`` (the Linear layers inside them): the plans' count."""
    return sum(m.weight.numel() for u in units for m in u.modules() if type(m) is torch.nn.Linear)


def quantize_layer(layer: torch.nn.Linear, backend: str, compute_dtype: torch.dtype,
                   device: torch.device) -> torch.nn.Module:
    """The backend's layer for ``layer`` on ``device``, its weight quantised there, frozen."""
    weight = layer.weight.detach().to(compute_dtype)
    bias = layer.bias.detach().to(device, compute_dtype) if layer.bias is not None else None
    if backend in BNB:
        import bitsandbytes as bnb

        if backend == "nf4":
            new = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=bias is not None,
                                    compute_dtype=compute_dtype, quant_type="nf4", device="meta")
            new.weight = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type="nf4", module=new)
        else:
            new = bnb.nn.Linear8bitLt(layer.in_features, layer.out_features, bias=bias is not None,
                                      has_fp16_weights=False, device="meta")
            new.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False)
        new.weight = type(new.weight).to(new.weight, device)  # bitsandbytes quantises on the move
        if backend == "nf4":
            new.weight.module = new
    elif backend in TORCHAO:
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        new = torch.nn.Linear(layer.in_features, layer.out_features, bias=bias is not None, device="meta")
        new.weight = torch.nn.Parameter(weight.to(device), requires_grad=False)
        quantize_(new, Int8WeightOnlyConfig() if backend == "int8_weight" else Float8WeightOnlyConfig())
    else:
        raise ValueError(f"no such quantisation backend: {backend}")
    if bias is not None:
        new.bias = torch.nn.Parameter(bias, requires_grad=False)
    new.requires_grad_(False)
    return new


def dequantized_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight a quantised layer computes with, as a plain fp32 tensor (the reference of the tests and of
    a merged copy)."""
    w = layer.weight
    name = type(w).__name__
    if name == "Params4bit":
        import bitsandbytes.functional as F

        return F.dequantize_4bit(w.data, w.quant_state).float()
    if name == "Int8Params":  # the row scales move to the layer's state at its first forward
        scb = w.SCB if w.SCB is not None else layer.state.SCB
        return w.data.float() * scb.float()[:, None] / 127.0
    if name == "GGUFParameter":
        from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

        return dequantize_gguf_tensor(w).float()
    if hasattr(w, "dequantize"):
        return w.dequantize().float()
    return w.detach().float()


def set_layer(net: torch.nn.Module, name: str, layer: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(net.get_submodule(parent) if parent else net, child, layer)


def quantize(net: torch.nn.Module, names: list[str], backend: str, compute_dtype: torch.dtype,
             device: torch.device) -> int:
    """Replace the Linear layers ``names`` of ``net`` by ``backend``'s, one at a time (only one layer's
    full-precision weight is on ``device`` at once); the rest of ``net`` moved to ``device`` in
    ``compute_dtype``. Returns how many base weights are now stored quantised."""
    count = 0
    for name in names:
        layer = net.get_submodule(name)
        set_layer(net, name, quantize_layer(layer, backend, compute_dtype, device))
        count += layer.weight.numel()
        del layer
    move_rest(net, compute_dtype, device)
    return count


def move_rest(net: torch.nn.Module, compute_dtype: torch.dtype, device: torch.device) -> None:
    """Every plain parameter and buffer of ``net`` (not the quantised weights) to ``device`` / ``compute_dtype``."""
    for module in net.modules():
        for key, p in list(module._parameters.items()):
            if p is None or is_quantized(module) and key == "weight":
                continue
            dtype = compute_dtype if p.is_floating_point() else p.dtype
            module._parameters[key] = torch.nn.Parameter(p.detach().to(device, dtype), requires_grad=False)
        for key, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[key] = b.to(device)
    net.requires_grad_(False)


def dequantized_copy(net: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``net`` (adapters and all) whose quantised layers are plain fp32 Linear layers holding the
    weights the quantised ones compute with: the reference the tests compare against."""
    plain = {}
    for m in net.modules():
        if is_quantized(m) and not hasattr(m, "base_layer"):
            layer = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
            layer.weight = torch.nn.Parameter(dequantized_weight(m), requires_grad=False)
            if m.bias is not None:
                layer.bias = torch.nn.Parameter(m.bias.detach().float().clone(), requires_grad=False)
            plain[id(m)] = layer
    # deepcopy's memo puts the plain layers in place of the quantised ones (never copied themselves)
    return copy.deepcopy(net, memo=dict(plain))


def stored_bytes(net: torch.nn.Module) -> tuple[int, int]:
    """(bytes the quantised layers' weights hold, scales and statistics included; their weight count)."""
    total = count = 0
    for m in net.modules():
        if not is_quantized(m) or hasattr(m, "base_layer"):
            continue
        w = m.weight
        count += m.in_features * m.out_features
        if type(w).__name__ == "Params4bit":
            total += w.data.numel() * w.data.element_size()
            total += sum(t.numel() * t.element_size() for k, t in w.quant_state.as_dict(packed=True).items()
                         if isinstance(t, torch.Tensor) and not k.startswith("quant_state."))  # not its JSON
        elif type(w).__name__ == "Int8Params":
            total += w.data.numel() + w.SCB.numel() * w.SCB.element_size()
        elif hasattr(w, "tensor_data_names"):
            total += sum(getattr(w, n).numel() * getattr(w, n).element_size() for n in w.tensor_data_names)
        else:
            total += w.data.numel() * w.data.element_size()
    return total, count


# ---------------------------------------------------------------------------------------------- GGUF

def gguf_net(cfg, cls, config_source: str | None, subfolder: str, from_params: bool):
    """The family's net read from ``model.adapter.base_gguf`` (``cfg``: the ``model`` section) on the CPU, its
    layers quantised as the file stores them and the rest in the training precision; None when the base is
    not a GGUF file. The file is the whole base: the net's full-precision weights are never read."""
    if not (enabled(cfg) and cfg.adapter.base_quantization == "gguf"):
        return None
    if from_params:
        raise ConfigError(f"'model.adapter.base_gguf' with model.{subfolder}.params: the GGUF file is the net's "
                          "weights; leave the params out (its config.json comes from the pipeline)")
    if config_source is None:
        raise ConfigError(f"'model.adapter.base_gguf': the {subfolder}'s config.json (its architecture) comes from "
                          f"model.pretrained or model.{subfolder}.pretrained: set one")
    return load_gguf(cls, cfg.adapter.base_gguf, config_source, subfolder, build_dtype(cfg), torch.device("cpu"))


def load_gguf(cls, path: str, config_source: str, subfolder: str, compute_dtype: torch.dtype,
              device: torch.device):
    """``cls.from_single_file(path, quantization_config=GGUFQuantizationConfig(compute_dtype))``: the net of
    a GGUF file, its architecture from ``config_source`` (a pipeline root with ``subfolder/config.json``, or
    the component's folder)."""
    import os

    from diffusers import GGUFQuantizationConfig

    if not hasattr(cls, "from_single_file"):
        raise ConfigError(f"'model.adapter.base_gguf': diffusers' {cls.__name__} has no single-file loader "
                          "(from_single_file), so a GGUF file cannot be read for this family; use "
                          "model.adapter.base_quantization=nf4, int8, int8_weight or fp8_weight")
    kw = {"quantization_config": GGUFQuantizationConfig(compute_dtype=compute_dtype), "torch_dtype": compute_dtype,
          "config": config_source}
    if os.path.isfile(os.path.join(config_source, subfolder, "config.json")):
        kw["subfolder"] = subfolder
    try:
        net = cls.from_single_file(path, **kw)
    except (ValueError, KeyError, RuntimeError, OSError, TypeError) as e:
        raise ConfigError(f"'model.adapter.base_gguf': {path} does not load as a {cls.__name__}: "
                          f"{str(e).splitlines()[0][:300]}") from None
    if not any(is_quantized(m) for m in net.modules()):
        raise ConfigError(f"'model.adapter.base_gguf': {path} holds no quantised layer of the {cls.__name__} "
                          "(its weights are all float): use it as model.pretrained, or a quantised file")
    for m in net.modules():
        if is_quantized(m):
            m.to(device)  # GGUFParameter keeps its quant_type through .to (diffusers moves GGUF models so)
    move_rest(net, compute_dtype, device)
    return net


__all__ = ["BACKENDS", "BYTES_PER_PARAM", "enabled", "build_device", "build_dtype", "is_quantized", "targets",
           "quantize", "quantize_layer", "dequantized_weight", "dequantized_copy", "stored_bytes", "gguf_net",
           "load_gguf"]
