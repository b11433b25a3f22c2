"""Optimizer and learning-rate schedule, both counted in optimizer steps."""

from __future__ import annotations

import math

import torch

from .config import LRSchedulerConfig, OptimizerConfig


def build_optimizer(params, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    p = cfg.params
    kwargs = dict(lr=p.learning_rate, betas=(p.beta1, p.beta2), weight_decay=p.weight_decay, eps=p.epsilon)
    if device.type == "cuda":
        kwargs["fused"] = True  # one kernel for all parameters instead of one per tensor
    return torch.optim.AdamW(params, **kwargs)


def lr_factor(step: int, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """Multiplier of the peak LR for the optimizer step with 0-based index ``step``.

    Warmup is linear and reaches the peak on step ``warmup_length - 1``: the first step trains with
    peak / warmup_length rather than 0 (a first step at LR 0 is wasted compute).
    """
    p = cfg.params
    warm = p.warmup_length
    if warm > 0 and step < warm:
        return (step + 1) / warm
    if cfg.scheduler == "ConstantWithWarmup":
        return 1.0
    decay = p.decay_length if p.decay_length is not None else max(total_steps - warm, 1)
    progress = min(max(step - warm + 1, 0) / decay, 1.0)  # reaches 1.0 on the last step
    return p.min_lr_ratio + (1.0 - p.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer, cfg: LRSchedulerConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (its state is just the step counter) stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))
