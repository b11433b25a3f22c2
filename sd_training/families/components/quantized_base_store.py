"""``<run>/quantized_base/``: the quantised layers of ``model.adapter.base_quantization`` kept in the run
folder, so that a requeued or resumed job reloads them instead of quantising the base again.

``weights.safetensors`` holds each quantised layer's stored tensors (bitsandbytes' packed weight and its
quantisation state; torchao's flattened tensor subclasses, their attributes in the file's metadata) and its
bias; ``quantized_base.json`` says what they were made from (backend, compute dtype, each layer's name and
shape, a CRC32 of a strided sample of each source weight: a changed base is quantised again) and the weight
file's size and CRC32 (``checkpoint.integrity.file_record``: a damaged copy is quantised again, not
loaded). Written by rank 0 under a temporary name and renamed into place.

:func:`prepare` is what ``build.build_model`` calls before peft wraps the net: quantise (or reload) the
family's net in place, or take the net the family read from a GGUF file, and mark it so that checkpoints
hold only its trained parameters (``checkpoint.model_state.TRAINED_ONLY``)."""

from __future__ import annotations

import json
import logging
import shutil
import zlib
from pathlib import Path

import torch

from ...checkpoint.integrity import file_record
from ...checkpoint.model_state import TRAINED_ONLY
from ...config import ConfigError
from .quantized_base import BNB, TORCHAO, set_layer

log = logging.getLogger(__name__)

FORMAT = 1
INFO = "quantized_base.json"
WEIGHTS = "weights.safetensors"
_SAMPLE_STRIDE = 4099  # one weight in 4099 goes into the fingerprint: cheap, and a fine-tune changes them all


def fingerprint(net: torch.nn.Module, names: list[str], backend: str, compute_dtype: torch.dtype) -> dict:
    """What the stored layers must have been made from to be reused."""
    layers = {}
    for name in names:
        w = net.get_submodule(name).weight.detach()
        sample = w.reshape(-1)[::_SAMPLE_STRIDE].float().cpu().contiguous()
        layers[name] = {"shape": list(w.shape), "sample_crc32": f"{zlib.crc32(sample.numpy().tobytes()):08x}"}
    return {"format": FORMAT, "backend": backend, "compute_dtype": str(compute_dtype).replace("torch.", ""),
            "layers": layers}


def _layer_tensors(name: str, layer: torch.nn.Module, backend: str) -> tuple[dict, dict]:
    """(tensors to save, torchao metadata) of one quantised layer."""
    w, out, meta = layer.weight, {}, {}
    if backend == "nf4":
        from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

        data, state = w.data, w.quant_state
        if getattr(state, "packing_format_for_cpu", False):  # bitsandbytes' CPU repacking: saved as on a GPU
            data, state = _convert_weight_packed_for_cpu_inverse(data, state)
        out[f"{name}.weight"] = data
        out.update({f"{name}.weight.{k}": v for k, v in state.as_dict(packed=True).items()})
    elif backend == "int8":
        out[f"{name}.weight"], out[f"{name}.SCB"] = w.data, w.SCB
    else:
        from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

        tensors, meta = flatten_tensor_state_dict({f"{name}.weight": w.data if not hasattr(w, "tensor_data_names")
                                                   else w})
        out.update(tensors)
    if layer.bias is not None:
        out[f"{name}.bias"] = layer.bias.detach()
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}, meta


def save(folder: Path, net: torch.nn.Module, names: list[str], info: dict) -> None:
    """Write the quantised layers ``names`` of ``net`` and ``info`` (its :func:`fingerprint`) to ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors, torchao_meta = {}, {}
    for name in names:
        t, meta = _layer_tensors(name, net.get_submodule(name), info["backend"])
        tensors.update(t)
        torchao_meta.update({k: v for k, v in meta.items() if k != "tensor_names"})
    save_file(tensors, str(tmp / WEIGHTS), metadata={"torchao": json.dumps(torchao_meta)} if torchao_meta else None)
    record = dict(info, files={WEIGHTS: file_record(tmp / WEIGHTS)})
    (tmp / INFO).write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def usable(folder: Path, info: dict) -> str | None:
    """None when ``folder`` holds the layers ``info`` describes, intact; else why it cannot be used."""
    folder = Path(folder)
    if not (folder / INFO).is_file():
        return "none stored"
    try:
        stored = json.loads((folder / INFO).read_text())
    except (OSError, ValueError) as e:
        return f"{folder / INFO} cannot be read ({e})"
    if {k: stored.get(k) for k in info} != info:
        return "it was made from another base or with other settings"
    expected = (stored.get("files") or {}).get(WEIGHTS)
    if not (folder / WEIGHTS).is_file() or expected != file_record(folder / WEIGHTS):
        return f"{folder / WEIGHTS} is missing or fails its size / CRC32 check"
    return None


def load(folder: Path, net: torch.nn.Module, names: list[str], backend: str, compute_dtype: torch.dtype,
         device: torch.device) -> None:
    """Replace the Linear layers ``names`` of ``net`` by the stored quantised layers (checked by :func:`usable`)."""
    from safetensors import safe_open

    path = str(Path(folder) / WEIGHTS)
    with safe_open(path, framework="pt", device="cpu") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        meta = json.loads((fh.metadata() or {}).get("torchao", "{}"))
    for name in names:
        old = net.get_submodule(name)
        new = _rebuild(name, old, tensors, meta, backend, compute_dtype, device)
        bias = tensors.get(f"{name}.bias")
        if bias is not None:
            new.bias = torch.nn.Parameter(bias.to(device), requires_grad=False)
        new.requires_grad_(False)
        set_layer(net, name, new)


def _rebuild(name: str, old: torch.nn.Linear, tensors: dict, meta: dict, backend: str, compute_dtype: torch.dtype,
             device: torch.device) -> torch.nn.Module:
    has_bias = old.bias is not None
    if backend == "nf4":
        import bitsandbytes as bnb

        new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=has_bias, compute_dtype=compute_dtype,
                                quant_type="nf4", device="meta")
        prefix = f"{name}.weight."
        stats = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        new.weight = bnb.nn.Params4bit.from_prequantized(tensors[f"{name}.weight"], stats, device=device, module=new)
        return new
    if backend == "int8":
        import bitsandbytes as bnb

        new = bnb.nn.Linear8bitLt(old.in_features, old.out_features, bias=has_bias, has_fp16_weights=False,
                                  device="meta")
        cb, scb = tensors[f"{name}.weight"].to(device), tensors[f"{name}.SCB"].to(device)
        new.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
        return new
    assert backend in TORCHAO and backend not in BNB
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    key = f"{name}.weight"
    own = {k: v for k, v in tensors.items() if k.startswith(f"{name}._weight_")}
    weight = unflatten_tensor_state_dict(own, {key: meta[key], "tensor_names": json.dumps([key])})[0][key]
    new = torch.nn.Linear(old.in_features, old.out_features, bias=has_bias, device="meta")
    new.weight = torch.nn.Parameter(weight.to(device), requires_grad=False)
    return new


# ---------------------------------------------------------------------------------------------- the run's base

def prepare(cfg, family, compute_dtype: torch.dtype | None, folder: Path | None, is_main: bool) -> str:
    """Quantise the family's net in place (``model.adapter.base_quantization``), or reload its layers from
    ``folder`` (``<run>/quantized_base``) when they were made from the same base; rank 0 keeps them there.
    The net ends on ``family.device``, frozen. Returns the line the log prints."""
    from . import quantized_base as qb

    backend = cfg.model.adapter.base_quantization
    dtype = compute_dtype or torch.float32
    net, device = family.net, family.device
    if backend == "gguf":
        return _from_gguf(cfg, family, dtype)
    names = qb.targets(family.compile_units(net) or [net], net)
    if not names:
        raise ConfigError(f"'model.adapter.base_quantization={backend}': the {family.net_name}'s blocks have no "
                          "Linear layer to quantise")
    info = fingerprint(net, names, backend, dtype)
    why = usable(folder, info) if folder is not None else "no run folder"
    if why is None:
        load(folder, net, names, backend, dtype, device)
        qb.move_rest(net, dtype, device)
        how = f"reloaded from {folder} (not quantised again)"
    else:
        qb.quantize(net, names, backend, dtype, device)
        how = f"quantised now ({folder}: {why})"
        if folder is not None and is_main:
            save(folder, net, names, info)
            how += f"; kept in {folder} for a requeued job"
    setattr(net, TRAINED_ONLY, True)  # checkpoints hold the adapter: the base is here, or in its source
    stored, count = qb.stored_bytes(net)
    return (f"model.adapter.base_quantization={backend}: {len(names)} Linear layers of the {family.net_name}'s "
            f"blocks ({count:,} weights, {stored / max(count, 1):.3f} bytes each) {how}; the rest in {dtype}")


def _from_gguf(cfg, family, dtype: torch.dtype) -> str:
    """The net the family read from ``model.adapter.base_gguf`` (``quantized_base.gguf_net``), moved to the
    device: the file is the stored base, nothing is quantised or kept."""
    from . import quantized_base as qb

    net = family.net
    quantized = [n for n, m in net.named_modules() if qb.is_quantized(m)]
    if not quantized:  # a family that builds its net without build_transformer / build_unet
        raise ConfigError(f"'model.adapter.base_gguf': the {family.name} family's {family.net_name} was not read "
                          "from the GGUF file; use model.adapter.base_quantization=nf4, int8, int8_weight or "
                          "fp8_weight")
    qb.move_rest(net, dtype, family.device)
    for name in quantized:
        net.get_submodule(name).to(family.device)
    setattr(net, TRAINED_ONLY, True)  # checkpoints hold the adapter: the base is the GGUF file
    stored, count = qb.stored_bytes(net)
    return (f"model.adapter.base_quantization=gguf: {len(quantized)} layers of the {family.net_name} read "
            f"quantised from {cfg.model.adapter.base_gguf} ({count:,} weights, {stored / max(count, 1):.3f} bytes "
            f"each; the file is the stored base: nothing is quantised or kept); the rest in {dtype}")
