"""LR schedules, counted in optimizer steps."""

import math

import pytest
import torch

from sd_training.config.schema import LRSchedulerConfig, LRSchedulerParams
from sd_training.optim import build_lr_scheduler, lr_factor


def sched(name, warmup, **kw):
    return LRSchedulerConfig(scheduler=name, params=LRSchedulerParams(learning_rate=1.0, warmup_length=warmup, **kw))


def test_constant_with_warmup():
    cfg = sched("ConstantWithWarmup", 4)
    assert [lr_factor(s, cfg, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_reaches_min_on_last_step():
    cfg = sched("CosineWithWarmup", 2, min_lr_ratio=0.1)
    total = 12
    values = [lr_factor(s, cfg, total) for s in range(total)]
    assert values[:2] == [0.5, 1.0]
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[1:], values[2:]))  # monotone after warmup
    mid = lr_factor(2 + 5 - 1, cfg, total)  # halfway through the 10 decay steps
    assert mid == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_scheduler_applies_factor_per_optimizer_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    s = build_lr_scheduler(opt, sched("ConstantWithWarmup", 2), 10)
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    assert seen == [1.0, 2.0, 2.0]
