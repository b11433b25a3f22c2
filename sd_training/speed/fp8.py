"""``model.fp8``: the Linear layers of the family's repeated blocks (``Family.compile_units``: the
transformer blocks; a UNet's ResNet and attention blocks) trained in float8 with torchao's float8 training
(``convert_to_float8_training``: dynamic per-tensor scales, e4m3 forward, e5m2 gradients; the weights and
optimizer state stay in their precision). FP8 matrix units need a GPU of compute capability >= 8.9 (H100,
L40S, RTX 4090); the gain is in the GEMMs, so it pays with ``model.compile`` (torchao fuses the scaling).

Layers whose input or output width is not a multiple of 16 (FP8 GEMMs need it) stay as they are, as do the
embeddings and the final projection (outside the blocks)."""

from __future__ import annotations

import importlib.util
import logging

import torch

from ..config import ConfigError

log = logging.getLogger(__name__)


def check(adapter: bool) -> None:
    """Refuse model.fp8 where it cannot work: no torchao, or a LoRA (peft wraps the same Linear layers)."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("model.fp8 needs torchao (pip install torchao, constraints.txt has its version)")
    if adapter:
        raise ConfigError("model.fp8 trains the net's own Linear layers; with model.adapter (LoRA) they are frozen: "
                          "set model.fp8=false")


def eligible(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(units: list[torch.nn.Module], device: torch.device) -> int:
    """Swap the eligible Linear layers inside ``units`` for torchao's Float8Linear, in place; returns how many."""
    from torchao.float8 import convert_to_float8_training

    before = sum(eligible(m) for u in units for m in u.modules())
    for unit in units:
        convert_to_float8_training(unit, module_filter_fn=lambda m, fqn: eligible(m))
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        log.warning("model.fp8: %s has no FP8 matrix units: the float8 layers are emulated (slower, for tests)",
                    torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU")
    log.info("model.fp8: %d Linear layers of %d blocks train in float8", before, len(units))
    return before
