"""The ComfyUI-format copy of a LoRA export (``model.adapter.export_kohya`` for the families that declare
``Family.comfy_lora_names``): the diffusers LoRA rewritten with the ORIGINAL checkpoint's layer names.

ComfyUI loads a LoRA by the names of its own model's weights: ``diffusion_model.<name>`` for every weight
of the model it built from the original checkpoint (``comfy/lora.py``, ``model_lora_keys_unet``), which for
FLUX.2 and Z-Image are not diffusers' names (FLUX.2: ``double_blocks.N.img_attn.qkv``, ``single_blocks.N.linear1``;
Z-Image: ``layers.N.attention.qkv``) and for Qwen-Image are. The other trainers (ai-toolkit, musubi-tuner)
write that layout too, and diffusers reads it back with its converters
(``diffusers.loaders.lora_conversion_utils._convert_non_diffusers_<model>_lora_to_diffusers``).

A family declares its names as :class:`ComfyLoraNames`: rules from a diffusers layer name (a full-match
regular expression) to the original layer's name, the layer's rows in it where the original fuses several
layers (q, k and v in one ``qkv``), the key style its converter reads and whether it reads ``.alpha``.

A fused layer is written as the inverse of how the converters split it: they give each part the whole
down matrix and the part's rows of the up matrix (``up.chunk(n)``). So the parts' down matrices are
stacked (rank = the sum of the parts' ranks) and the up matrix is block-diagonal, part i's up in its rows
and in the columns of its own down rows; a part without a LoRA gets zero rows. The update of every part
is then exactly its own, in ComfyUI (``up @ down`` on the fused weight) and in diffusers alike. The scale
``alpha / rank`` is kept: ``.alpha`` written so that alpha / (written rank) is the layer's scale, or, for
a converter that reads no alpha, folded into the up matrix.

Names no family: the rules come from the family class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

PREFIX = "diffusion_model."  # ComfyUI's prefix of the diffusion model's weights
# key suffixes of the down / up matrices per style (both read by ComfyUI's LoRA loader)
STYLES = {"lora_A": (".lora_A.weight", ".lora_B.weight"), "dot": (".lora.down.weight", ".lora.up.weight")}


class Rule(NamedTuple):
    pattern: str  # full match over a diffusers layer name; its groups fill ``name``
    name: str  # the original layer's name (``re`` replacement template: \1 ...)
    part: int = 0  # this layer's rows in the original layer: part ``part`` of ``parts`` equal chunks
    parts: int = 1


def fused(pattern: str, name: str, parts: tuple[str, ...]) -> tuple[Rule, ...]:
    """Rules for diffusers layers ``pattern.format(p)`` (p in ``parts``, in the original's row order) that the
    original fuses in one layer ``name``."""
    return tuple(Rule(pattern.format(re.escape(p)), name, i, len(parts)) for i, p in enumerate(parts))


@dataclass(frozen=True)
class ComfyLoraNames:
    """How one family's LoRA is written for ComfyUI (see the module)."""

    rules: tuple[Rule, ...]
    style: str  # key style its diffusers converter reads: lora_A (lora_A / lora_B) or dot (lora.down / lora.up)
    alpha: bool  # the converter reads ``.alpha``; False: the scale is folded into the up matrix
    reader: str  # the diffusers converter that reads the file back (for messages and docs)
    # LoKr / LoHa files (outputs.lycoris_file): True: diffusers' own layer names under diffusion_model., which
    # ComfyUI maps for this model (its per-model diffusers map); False: the original's, unfused layers only
    lycoris_diffusers_names: bool = False

    def original(self, layer: str) -> tuple[str, int, int] | None:
        """(original name, part, parts) of a diffusers layer; None: the original has no such layer ComfyUI and
        the converter both read."""
        for rule in self.rules:
            m = re.fullmatch(rule.pattern, layer)
            if m:
                return m.expand(rule.name), rule.part, rule.parts
        return None


def check_layers(names: ComfyLoraNames, module: torch.nn.Module, targets: list[str], key: str, what: str,
                 kind: str = "lora") -> None:
    """The adapted ``targets`` of ``module`` all have an original name, and the parts of every fused layer they
    touch have the same outputs (the converters split the up matrix in equal chunks); else a ``ConfigError``
    naming ``key`` and the layer. For a LoKr / LoHa (``kind``) see :func:`check_lycoris_layers`."""
    from ..config import ConfigError

    if kind != "lora":
        return check_lycoris_layers(names, targets, key, what, kind)
    layers = dict(module.named_modules())
    groups: dict[str, dict[int, int]] = {}
    for name, layer in layers.items():
        found = names.original(name) if isinstance(layer, torch.nn.Linear) else None
        if found and found[2] > 1:
            groups.setdefault(found[0], {})[found[1]] = layer.out_features
    for target in targets:
        found = names.original(target)
        if found is None:
            raise ConfigError(
                f"'{key}': the {what}'s layer {target} has no name in the original checkpoint that ComfyUI and "
                f"diffusers' {names.reader} both read, so the ComfyUI file cannot hold its LoRA: leave it out of "
                f"the targets (model.adapter.target_regex / target_modules), or set {key}=false")
        outs = groups.get(found[0], {})
        if found[2] > 1 and (len(outs) != found[2] or len(set(outs.values())) != 1):
            raise ConfigError(f"'{key}': the {what}'s {found[0]} fuses {found[2]} layers of unequal or missing sizes "
                              f"({outs}); ComfyUI's fused layer needs equal parts: set {key}=false")


def check_lycoris_layers(names: ComfyLoraNames, targets: list[str], key: str, what: str, kind: str) -> None:
    """A LoKr / LoHa file by the original's names holds a target only where the original has that layer alone:
    the Kronecker (LoKr) or Hadamard (LoHa) updates of q, k and v are not one such update of the fused qkv, so a
    target the original fuses is refused, naming ``key`` (none where the file has diffusers' names)."""
    from ..config import ConfigError

    if names.lycoris_diffusers_names:
        return
    for target in targets:
        found = names.original(target)
        if found is None or found[2] > 1:
            where = ("has no name in the original checkpoint" if found is None else
                     f"is one of the {found[2]} layers the original fuses in {found[0]}")
            raise ConfigError(
                f"'{key}': the {what}'s layer {target} {where}; ComfyUI and diffusers read a {kind} by the original's "
                f"layers and its update of separate layers is not one {kind} of the fused layer, so the file cannot "
                f"hold it: leave such layers out of the targets (model.adapter.target_regex / target_modules, e.g. "
                f"the projections after attention and the MLPs), or set {key}=false")


def comfy_state(names: ComfyLoraNames, lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> dict:
    """The ComfyUI file's tensors from ``lora``: diffusers layer -> (down [r, in], up [out, r], scale)."""
    down_key, up_key = STYLES[names.style]
    groups: dict[str, dict[int, tuple]] = {}
    parts_of: dict[str, int] = {}
    for layer, weights in lora.items():
        found = names.original(layer)
        if found is None:  # check_layers refuses such a target before any training
            raise ValueError(f"the LoRA's layer {layer} has no original name (rules read by {names.reader})")
        name, part, parts = found
        groups.setdefault(name, {})[part] = weights
        parts_of[name] = parts
    out = {}
    for name, members in groups.items():
        down, up, scale = _fuse(members, parts_of[name])
        rank = down.shape[0]
        if not names.alpha:
            up, scale = up * scale, 1.0
        out[PREFIX + name + down_key] = down.contiguous()
        out[PREFIX + name + up_key] = up.contiguous()
        if names.alpha:
            out[PREFIX + name + ".alpha"] = torch.tensor(scale * rank, dtype=torch.float32)
    return out


def _fuse(members: dict[int, tuple], parts: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(down, up, scale) of one original layer from its parts' LoRAs: stacked downs, block-diagonal ups (the
    module doc); each part's scale relative to the first folded into its up rows."""
    if parts == 1:
        return members[0]
    present = sorted(members)
    scale = members[present[0]][2]
    down = torch.cat([members[i][0] for i in present])
    width = members[present[0]][1].shape[0]  # every part's outputs (checked equal at start-up)
    up = down.new_zeros(parts * width, down.shape[0])
    col = 0
    for i in present:
        part_down, part_up, part_scale = members[i]
        r = part_down.shape[0]
        up[i * width:(i + 1) * width, col:col + r] = part_up * (part_scale / scale)
        col += r
    return down, up, scale
