"""Exponential moving average of the trained weights: of the whole module, or (``trainable_only``: an adapter
run, whose base is frozen) of only the parameters that train, the rest taken from the module when exported."""

from __future__ import annotations

import copy
import logging

import torch

from .distributed.strategy import local

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
    so pair it with a larger ``update_every`` (and a smaller decay). ``trainable_only``: the shadow holds
    only the parameters of ``module`` that require grad (:func:`trained_subset`: same names, no buffers;
    ``names`` lists them), and :meth:`applied_to` puts them into a copy of the module for exports.
    """

    def __init__(self, module: torch.nn.Module, decay: float, update_every: int = 1, start_step: int = 0,
                 warmup: bool = False, device: torch.device | None = None, trainable_only: bool = False):
        self.decay = decay
        self.update_every = update_every
        self.start_step = start_step
        self.warmup = warmup
        self.shadow = (trained_subset(module) if trainable_only else copy.deepcopy(module)).eval().requires_grad_(False)
        # The module's parameters the shadow averages, by name, in order (None: all of them, and its buffers).
        self.names = [n for n, _ in self.shadow.named_parameters()] if trainable_only else None
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
        params = [local(p).detach() for p in self._averaged(module)]
        shadow = [local(p) for p in self.shadow.parameters()]
        sources = _to_shadow(params, shadow)
        if step <= self.start_step:
            torch._foreach_copy_(shadow, sources)
        else:
            # shadow = d * shadow + (1 - d) * param, for all tensors at once
            torch._foreach_lerp_(shadow, sources, 1.0 - self.current_decay())
            self.num_updates += 1
        if self.names is None:
            for b, sb in zip(module.buffers(), self.shadow.buffers()):
                sb.copy_(b)

    def _averaged(self, module: torch.nn.Module) -> list[torch.Tensor]:
        """The parameters of ``module`` the shadow's parameters average, in the shadow's order."""
        if self.names is None:
            return list(module.parameters())
        params = dict(module.named_parameters())
        return [params[n] for n in self.names]

    def load_weights(self, module: torch.nn.Module) -> None:
        """Start the EMA from another module's weights (e.g. model.ema.path)."""
        sd = module.state_dict()
        self.shadow.load_state_dict(sd if self.names is None else {n: sd[n] for n in self.names})

    def applied_to(self, module: torch.nn.Module, shadow_state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """``trainable_only``: a copy of ``module`` (the net, unsharded) with the EMA's weights
        ``shadow_state`` (the shadow's full state dict) in place of its trained parameters; every other
        tensor is shared with ``module``, not copied (a LoRA's frozen base costs no memory here)."""
        averaged = set(shadow_state)
        keep = {id(t): t for n, t in [*module.named_parameters(), *module.named_buffers()] if n not in averaged}
        out = copy.deepcopy(module, keep)
        params = dict(out.named_parameters())
        with torch.no_grad():
            for name, value in shadow_state.items():
                params[name].copy_(value)
        return out.eval().requires_grad_(False)

    def meta_state_dict(self) -> dict:
        return {"decay": self.decay, "num_updates": self.num_updates}

    def load_meta_state_dict(self, sd: dict) -> None:
        self.decay, self.num_updates = sd["decay"], sd["num_updates"]

    def state_dict(self) -> dict:
        return {"shadow": self.shadow.state_dict(), **self.meta_state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.shadow.load_state_dict(sd["shadow"])
        self.load_meta_state_dict(sd)


def trained_subset(module: torch.nn.Module) -> torch.nn.Module:
    """A module holding a copy of each parameter of ``module`` that requires grad, under the same name (a
    tree of plain modules along the names: its state dict has the module's keys, only those), nothing else."""
    root = torch.nn.Module()
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if part not in node._modules:
                node.add_module(part, torch.nn.Module())
            node = node._modules[part]
        node.register_parameter(leaf, torch.nn.Parameter(p.detach().clone(), requires_grad=False))
    return root


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
