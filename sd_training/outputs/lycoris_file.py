"""The ComfyUI / kohya copy of a LoKr or LoHa export (``model.adapter.export_kohya`` with ``model.adapter.type``
lokr or loha): the adapter's tensors in LyCORIS' layout, under the layer names ComfyUI maps for the family.

peft's LoKr and LoHa are ports of LyCORIS': their parameters carry LyCORIS' names and shapes (``lokr_w1`` or
``lokr_w1_a`` / ``lokr_w1_b``, ``lokr_w2`` or ``lokr_w2_a`` / ``lokr_w2_b``; ``hada_w1_a``, ``hada_w1_b``,
``hada_w2_a``, ``hada_w2_b``), so a layer's keys are ``<name>.<parameter>``. Only the scale differs. peft scales
every update by alpha / r. ComfyUI (``comfy/weight_adapter/lokr.py``, ``loha.py``) and diffusers' LoKr converter
(``_bake_lokr_alpha_``) scale by ``.alpha`` / (the rows of the decomposed matrix, which is r), and a LoKr whose
two factors are both whole matrices not at all. So ``.alpha`` is peft's alpha where a factor is decomposed, and
for a LoKr of two whole factors the scale is folded into ``lokr_w1`` (no ``.alpha``).

The names, per family (from its class attributes; ComfyUI's ``comfy/lora.py`` maps each):
- ``kohya``: UNet families: ``lora_unet_<diffusers layer, dots as _>`` (kohya's LyCORIS files; ComfyUI's
  ``unet_to_diffusers`` map), the family's ``kohya_lora_prefixes``;
- ``lycoris``: SD3, Flux.1 (no ComfyUI names of their own): ``lycoris_<diffusers layer, dots as _>``
  (SimpleTuner's LyCORIS files; ComfyUI maps them for SD3 and Flux);
- ``diffusers``: ``diffusion_model.<diffusers layer>`` where ComfyUI maps diffusers' names of the model (Z-Image;
  ai-toolkit's layout, which diffusers' ``_convert_non_diffusers_lokr_to_diffusers`` reads);
- ``original``: ``diffusion_model.<the original checkpoint's layer>`` (``Family.comfy_lora_names``: FLUX.2, read
  by ``_convert_non_diffusers_flux2_lokr_to_diffusers``; Qwen-Image, whose names are diffusers'); a layer the
  original fuses with others is refused before training (``comfy_lora.check_lycoris_layers``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .comfy_lora import PREFIX, ComfyLoraNames

LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


def style(net_name: str, kohya_prefixes: dict[str, str], comfy: ComfyLoraNames | None) -> str:
    """The family's naming (the module doc): kohya, lycoris, diffusers or original."""
    if net_name in kohya_prefixes:
        return "kohya"
    if comfy is None:
        return "lycoris"
    return "diffusers" if comfy.lycoris_diffusers_names else "original"


def key_base(layer: str, how: str, kohya_prefix: str = "", comfy: ComfyLoraNames | None = None) -> str:
    """The file's name of the net's ``layer`` (a diffusers module name) in naming ``how``."""
    if how == "kohya":
        return kohya_prefix + layer.replace(".", "_")
    if how == "lycoris":
        return "lycoris_" + layer.replace(".", "_")
    if how == "diffusers":
        return PREFIX + layer
    found = comfy.original(layer)
    if found is None or found[2] > 1:  # check_lycoris_layers refuses such a target before any training
        raise ValueError(f"the adapter's layer {layer} has no unfused original name ({comfy.reader})")
    return PREFIX + found[0]


def layer_tensors(net: torch.nn.Module) -> dict[str, tuple[dict[str, torch.Tensor], float]]:
    """Each LoKr / LoHa layer of ``net``: its tensors by LyCORIS' names (fp32) and its peft scale alpha / r."""
    from peft.tuners.lycoris_utils import LycorisLayer

    out = {}
    for name, module in net.named_modules():
        if isinstance(module, LycorisLayer) and "default" in module.scaling:
            tensors = {k: getattr(module, k)["default"].detach().float() for k in (*LOKR, *LOHA, "lokr_t2", "hada_t1")
                       if k in module.adapter_layer_names and "default" in getattr(module, k)}
            if "lokr_t2" in tensors or "hada_t1" in tensors:  # model.adapter has no Tucker option: never made
                raise ValueError(f"{name}: a Tucker-decomposed LyCORIS layer is not written")
            out[name] = (tensors, float(module.scaling["default"]))
    return out


def lycoris_tensors(tensors: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """One layer's file tensors (suffix -> tensor) whose update in ComfyUI's arithmetic is peft's (module doc)."""
    out = dict(tensors)
    if "hada_w1_b" in tensors:  # LoHa: ComfyUI's alpha / w1_b rows, rows = r
        rank = tensors["hada_w1_b"].shape[0]
    elif "lokr_w2_b" in tensors or "lokr_w1_b" in tensors:  # LoKr with a decomposed factor: alpha / its rows
        rank = tensors["lokr_w2_b" if "lokr_w2_b" in tensors else "lokr_w1_b"].shape[0]
    else:  # LoKr of two whole factors: ComfyUI and diffusers apply no alpha, so the scale goes into w1
        out["lokr_w1"] = tensors["lokr_w1"] * scale
        return out
    out["alpha"] = torch.tensor(scale * rank, dtype=torch.float32)
    return out


def lycoris_state(net: torch.nn.Module, how: str, kohya_prefix: str = "", comfy: ComfyLoraNames | None = None) -> dict:
    """The file's tensors for the adapter on ``net`` (named as ``how``)."""
    state = {}
    for layer, (tensors, scale) in layer_tensors(net).items():
        base = key_base(layer, how, kohya_prefix, comfy)
        for suffix, value in lycoris_tensors(tensors, scale).items():
            state[f"{base}.{suffix}"] = value.contiguous()
    return state


def save(net: torch.nn.Module, out: Path, how: str, kohya_prefix: str = "", comfy: ComfyLoraNames | None = None) -> Path:
    from safetensors.torch import save_file

    save_file(lycoris_state(net, how, kohya_prefix, comfy), str(out))
    return out
