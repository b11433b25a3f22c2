"""Exponential moving average of the trained weights."""

from __future__ import annotations

import copy
import logging

import torch

from .parallel import local

log = logging.getLogger(__name__)


def decay_from_strength(strength: float, total_steps: int, update_every: int) -> float:
    """EveryDream2's ``ema_strength_target``: the decay d with d^(updates in the run) = strength."""
    updates = max(total_steps // update_every, 1)
    return strength ** (1.0 / updates)


class EMA:
    """EMA of a module's parameters (buffers are copied). Starts as an exact copy of the module.

    ``update_every``: optimizer steps between updates. ``start_step``: before it the EMA just copies the
    weights. ``warmup``: the decay ramps as min(decay, (1 + n) / (10 + n)) over the first updates n.
    ``device``: where the copy lives; a CPU copy (seed 000) costs a device-to-host copy per update,
    so pair it with a larger ``update_every`` (and a smaller decay).
    """

    def __init__(self, module: torch.nn.Module, decay: float, update_every: int = 1, start_step: int = 0,
                 warmup: bool = False, device: torch.device | None = None):
        self.decay = decay
        self.update_every = update_every
        self.start_step = start_step
        self.warmup = warmup
        self.shadow = copy.deepcopy(module).eval().requires_grad_(False)
        if device is not None:
            self.shadow.to(device)
        self.num_updates = 0

    def current_decay(self) -> float:
        if self.warmup:
            return min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        return self.decay

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based, after it) updates the EMA."""
        return step % self.update_every == 0

    @torch.no_grad()
    def update(self, module: torch.nn.Module, step: int) -> None:
        if not self.due(step):
            return
        # Under FSDP2 both modules are sharded alike: each rank averages its own shards.
        params = [local(p).detach() for p in module.parameters()]
        shadow = [local(p) for p in self.shadow.parameters()]
        sources = _to_shadow(params, shadow)
        if step <= self.start_step:
            torch._foreach_copy_(shadow, sources)
        else:
            # shadow = d * shadow + (1 - d) * param, for all tensors at once
            torch._foreach_lerp_(shadow, sources, 1.0 - self.current_decay())
            self.num_updates += 1
        for b, sb in zip(module.buffers(), self.shadow.buffers()):
            sb.copy_(b)

    def load_weights(self, module: torch.nn.Module) -> None:
        """Start the EMA from another module's weights (e.g. model.ema.path)."""
        self.shadow.load_state_dict(module.state_dict())

    def meta_state_dict(self) -> dict:
        return {"decay": self.decay, "num_updates": self.num_updates}

    def load_meta_state_dict(self, sd: dict) -> None:
        self.decay, self.num_updates = sd["decay"], sd["num_updates"]

    def state_dict(self) -> dict:
        return {"shadow": self.shadow.state_dict(), **self.meta_state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.shadow.load_state_dict(sd["shadow"])
        self.load_meta_state_dict(sd)


def _to_shadow(params: list[torch.Tensor], shadow: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` moved to their shadow's device and dtype, ready to be read there.

    Same device: the copies (if any) are ordered on the device's stream. A CPU shadow of GPU weights
    (``model.ema.device=cpu``): the device-to-host copies are issued asynchronously, all of them, then
    waited for once. Reading a non-blocking device-to-host copy on the CPU before its stream reaches it
    would average garbage into the EMA."""
    out = [p.to(s.device, s.dtype, non_blocking=True) for p, s in zip(params, shadow)]
    to_host = {p.device for p, s in zip(params, shadow) if s.device.type == "cpu" and p.device.type != "cpu"}
    for device in to_host:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:  # other accelerators (torch >= 2.6)
            torch.accelerator.synchronize(device)
    return out
