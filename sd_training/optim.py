"""Optimizer, parameter groups and learning-rate schedule, all counted in optimizer steps."""

from __future__ import annotations

import importlib.util
import logging
import math

import torch

from .config import ConfigError
from .config.schema import LRSchedulerConfig, OptimizerConfig

log = logging.getLogger(__name__)

# Normalisation layers: their weights (scales) and all biases get no weight decay, as in most
# transformer/diffusion recipes (decaying a norm's scale towards 0 only fights the normalisation).
NORM_TYPES = (torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.BatchNorm2d, torch.nn.InstanceNorm2d)


def param_groups(module: torch.nn.Module, weight_decay: float, exclude_norm_and_bias: bool, lr: float | None = None) -> list[dict]:
    """[decayed, not decayed] groups of the trainable parameters of ``module``."""
    decay, no_decay = [], []
    for mod in module.modules():
        for name, p in mod.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if exclude_norm_and_bias and (isinstance(mod, NORM_TYPES) or name == "bias" or p.ndim <= 1):
                no_decay.append(p)
            else:
                decay.append(p)
    extra = {} if lr is None else {"lr": lr}
    groups = [{"params": decay, "weight_decay": weight_decay, **extra}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, **extra})
    return [g for g in groups if g["params"]]


def lr_scale(cfg: OptimizerConfig, global_batch: int) -> float:
    """``scale_lr``: the peak LR is multiplied by (global batch)^0.55 (EveryDream2's rule)."""
    return global_batch ** 0.55 if cfg.scale_lr else 1.0


def build_optimizer(groups: list[dict], cfg: OptimizerConfig, device: torch.device, peak_lr: float) -> torch.optim.Optimizer:
    p = cfg.params
    name = cfg.name
    if name == "adamw":
        kwargs = dict(lr=peak_lr, betas=(p.beta1, p.beta2), weight_decay=p.weight_decay, eps=p.epsilon)
        # One fused kernel for all parameters on CUDA. On CPU the per-tensor loop: measured faster than
        # foreach there (benchmarks/bench_step.py: foreach made our step ~7% slower than diffusers' loop).
        impl = cfg.implementation
        if impl == "auto":
            impl = "fused" if device.type == "cuda" else "for_loop"
        if impl == "fused":
            kwargs["fused"] = True
        elif impl == "foreach":
            kwargs["foreach"] = True
        else:
            kwargs["foreach"] = False
        return torch.optim.AdamW(groups, **kwargs)
    if name == "adamw8bit":
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError("optimizer.name=adamw8bit needs bitsandbytes: pip install bitsandbytes (CUDA only)")
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=peak_lr, betas=(p.beta1, p.beta2), weight_decay=p.weight_decay, eps=p.epsilon)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # External LR schedule: relative_step and parameter scaling off (the usual diffusion fine-tuning setting).
        return Adafactor(groups, lr=peak_lr, relative_step=False, scale_parameter=False, warmup_init=False,
                         weight_decay=p.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=peak_lr, momentum=p.momentum, weight_decay=p.weight_decay,
                               nesterov=p.momentum > 0 and cfg.nesterov)
    raise ConfigError(f"unknown optimizer.name '{name}'")


def lr_factor(step: int, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """Multiplier of the peak LR for the optimizer step with 0-based index ``step``.

    Warmup is linear and reaches the peak on step ``warmup_length - 1``: the first step trains with
    peak / warmup_length rather than 0 (a first step at LR 0 is wasted compute). Decays reach
    ``min_lr_ratio`` on the last step of ``decay_length`` (default: the end of training).
    """
    p = cfg.params
    if cfg.scheduler == "Constant":
        return 1.0
    warm = p.warmup_length
    if warm > 0 and step < warm:
        return (step + 1) / warm
    if cfg.scheduler == "ConstantWithWarmup":
        return 1.0
    decay = p.decay_length if p.decay_length is not None else max(total_steps - warm, 1)
    progress = min(max(step - warm + 1, 0) / decay, 1.0)
    if cfg.scheduler == "LinearWithWarmup":
        return 1.0 - (1.0 - p.min_lr_ratio) * progress
    return p.min_lr_ratio + (1.0 - p.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer, cfg: LRSchedulerConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (its state is just the step counter) stepped once per optimizer step; every param
    group follows the same factor of its own peak LR (e.g. a text encoder with its own LR)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))
