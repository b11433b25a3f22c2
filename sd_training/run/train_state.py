"""The training run's small state: counters saved in checkpoints, the numbers derived from the config,
and the error a run stops with when its steps stay non-finite."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..config import ConfigError
from ..config.schema import TrainConfig


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


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(v) -> str:
    return repr(v)[:50]


def check_train_state(sd, step: int | None = None) -> dict:
    """A checkpoint's ``train_state.json``, every value checked before it is trusted: a dict whose ``step``
    is a whole number >= 0 (``step``, when given: the one of the folder's name), counters whole numbers in
    their ranges, the tracker id a string. Keys of other versions pass through. Returns ``sd``; raises
    ValueError with a phrase that follows the file's name ("holds step 'abc', not a whole number")."""
    if not isinstance(sd, dict):
        raise ValueError(f"holds a JSON {type(sd).__name__}, not an object of counters")
    if "step" not in sd:
        raise ValueError("holds no step")
    s = sd["step"]
    if not _whole(s) or s < 0:
        raise ValueError(f"holds step {_shown(s)}, not a whole number >= 0")
    if step is not None and s != step:
        raise ValueError(f"holds step {s}, but its folder is step {step}")
    ranges = {"images_seen": 0, "nonfinite_steps": 0, "global_batch": 0, "last_export_step": -1}
    for key, low in ranges.items():
        if key in sd and (not _whole(sd[key]) or sd[key] < low):
            raise ValueError(f"holds {key} {_shown(sd[key])}, not a whole number >= {low}")
    if sd.get("last_export_step", -1) > s:
        raise ValueError(f"holds last_export_step {sd['last_export_step']}, after its step {s}")
    if sd.get("wandb_id") is not None and not isinstance(sd["wandb_id"], str):
        raise ValueError(f"holds wandb_id {_shown(sd['wandb_id'])}, not a string")
    return sd


# cfg.__dict__ entry set by configure.apply_step_cap when SD_TRAINING_MAX_STEPS shortened the run: its log line.
STEP_CAP = "_step_cap"


@dataclass
class Plan:
    """Numbers derived once from the config and the world size."""

    global_batch: int
    total_steps: int
    checkpoint_every: int
    accumulation: int  # micro-batches per optimizer step on each rank
    note: str = ""  # said after the run's size in the start-up log: the SD_TRAINING_MAX_STEPS cap, if it applied

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
            note=f" ({cfg.__dict__[STEP_CAP]})" if STEP_CAP in cfg.__dict__ else "",
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
