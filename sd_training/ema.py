"""Exponential moving average of the trained weights."""

from __future__ import annotations

import copy

import torch

from .parallel import local


class EMA:
    """EMA of a module's parameters (buffers are copied). Starts as an exact copy of the module."""

    def __init__(self, module: torch.nn.Module, decay: float):
        self.decay = decay
        self.shadow = copy.deepcopy(module).eval().requires_grad_(False)
        self.num_updates = 0

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        # Under FSDP2 both modules are sharded alike: each rank averages its own shards.
        params = [local(p) for p in module.parameters()]
        shadow = [local(p) for p in self.shadow.parameters()]
        # shadow = decay * shadow + (1 - decay) * param, for all tensors at once
        torch._foreach_lerp_(shadow, [p.detach().to(s.dtype) for p, s in zip(params, shadow)], 1.0 - self.decay)
        for b, sb in zip(module.buffers(), self.shadow.buffers()):
            sb.copy_(b)
        self.num_updates += 1

    def load_weights(self, module: torch.nn.Module) -> None:
        """Start the EMA from another module's weights (e.g. model.ema.path)."""
        self.shadow.load_state_dict(module.state_dict())

    def state_dict(self) -> dict:
        return {"shadow": self.shadow.state_dict(), "decay": self.decay, "num_updates": self.num_updates}

    def load_state_dict(self, sd: dict) -> None:
        self.shadow.load_state_dict(sd["shadow"])
        self.decay = sd["decay"]
        self.num_updates = sd["num_updates"]
