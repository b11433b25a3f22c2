"""The training run's small state: counters saved in checkpoints, the numbers derived from the config,
and the error a run stops with when its steps stay non-finite."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .config import ConfigError
from .config.schema import TrainConfig


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    images_seen: int = 0  # all ranks together
    wandb_id: str | None = None
    last_export_step: int = -1
    nonfinite_steps: int = 0  # optimizer steps skipped for a non-finite gradient, whole run
    global_batch: int = 0  # images per optimizer step when the checkpoint was written (0: not recorded)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            setattr(self, k, v)


@dataclass
class Plan:
    """Numbers derived once from the config and the world size."""

    global_batch: int
    total_steps: int
    checkpoint_every: int
    accumulation: int  # micro-batches per optimizer step on each rank

    @classmethod
    def make(cls, cfg: TrainConfig, world_size: int) -> Plan:
        s = cfg.system
        accum = s.gradient_accumulation
        if s.global_batch_size:
            per_pass = s.batch_size * world_size
            if s.gradient_accumulation != 1:
                raise ConfigError(f"'system.global_batch_size'={s.global_batch_size} derives the accumulation; leave "
                                  f"'system.gradient_accumulation' at 1 (it is {s.gradient_accumulation})")
            if s.global_batch_size % per_pass:
                raise ConfigError(
                    f"'system.global_batch_size'={s.global_batch_size} cannot be reached on {world_size} rank(s) with "
                    f"'system.batch_size'={s.batch_size}: it must be a multiple of {s.batch_size} x {world_size} = "
                    f"{per_pass} (closest: {max(per_pass, s.global_batch_size // per_pass * per_pass)} or "
                    f"{(s.global_batch_size // per_pass + 1) * per_pass}); change the batch size or the rank count"
                )
            accum = s.global_batch_size // per_pass
        gb = s.batch_size * accum * world_size
        return cls(
            global_batch=gb,
            total_steps=math.ceil(cfg.experiment.num_examples_to_see / gb),
            checkpoint_every=cfg.experiment.checkpoint_every or cfg.experiment.save_every,
            accumulation=accum,
        )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def hms(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class NonFiniteLossError(RuntimeError):
    """Too many consecutive non-finite steps: the run saved and stopped."""
