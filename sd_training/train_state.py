"""The training run's small state: counters saved in checkpoints, the numbers derived from the config,
the sums of one log interval, and the error a run stops with when its steps stay non-finite."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import numpy as np
import torch

from .config import ConfigError, TrainConfig
from .ema import EMA


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
    def make(cls, cfg: TrainConfig, world_size: int) -> "Plan":
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


class EMAMeta:
    """The EMA's scalars, saved as a plain file when its weights are sharded (FSDP)."""

    def __init__(self, ema: EMA):
        self.ema = ema

    def state_dict(self) -> dict:
        return self.ema.meta_state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.ema.load_meta_state_dict(sd)


class LogWindow:
    """Sums over one log interval (kept on the device: no sync until the interval is logged)."""

    def __init__(self):
        self.loss_sum = 0.0
        self.loss_count = 0
        self.q_sum = torch.zeros(4)
        self.q_count = torch.zeros(4)
        self.grad_norm = 0.0
        self.last_loss = float("nan")
        self.parts: dict = {}
        self.parts_count = 0
        self.data_time = 0.0
        self.step_time = 0.0
        self.steps = 0

    def add_parts(self, parts: dict) -> None:
        """Named loss terms (e.g. the VAE's reconstruction and KL), averaged over the interval."""
        for k, v in parts.items():  # kept on the device until the interval is logged
            self.parts[k] = self.parts.get(k, 0.0) + (v.detach().float() if isinstance(v, torch.Tensor) else float(v))
        self.parts_count += 1

    def add_loss(self, loss: torch.Tensor, per_sample: torch.Tensor, timesteps: torch.Tensor, num_timesteps: int) -> None:
        if not isinstance(self.loss_sum, torch.Tensor):
            self.loss_sum = torch.zeros((), device=loss.device)
            self.q_sum = self.q_sum.to(loss.device)
            self.q_count = self.q_count.to(loss.device)
        self.loss_sum = self.loss_sum + loss.float()
        self.last_loss = loss
        self.loss_count += 1
        if timesteps is None:  # autoencoder stage: no timesteps
            return
        # Loss by timestep quartile (as guided-diffusion logs): where in the noise range the model struggles.
        q = (timesteps * 4 // num_timesteps).clamp(max=3)
        self.q_sum.index_add_(0, q, per_sample.float())
        self.q_count.index_add_(0, q, torch.ones_like(per_sample, dtype=torch.float))
