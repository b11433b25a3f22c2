"""Metric sinks behind one small protocol: ``log(metrics, step)``, ``log_image(key, path, step)``, ``close()``.

``metrics.jsonl`` is always written; wandb follows ``wandb.mode``; tensorboard with
``experiment.tensorboard``. Only rank 0 builds trackers. The config a tracker gets is the dump
(``config.loading.public_dict``: environment values as their interpolations, secrets redacted).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

from ..config.secrets import scrub_argument
from ..run.run_dir import RunDir

log = logging.getLogger(__name__)


class JsonlTracker:
    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)  # line-buffered: a killed run keeps every finished line

    def log(self, metrics: dict, step: int) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}}
        self.f.write(json.dumps(row) + "\n")

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.log({key: str(path)}, step)

    def close(self) -> None:
        self.f.close()


def wandb_mode(requested: str) -> str:
    """'auto' -> online when wandb can authenticate (WANDB_API_KEY or a netrc login), else offline."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        if netrc.exists() and "api.wandb.ai" in netrc.read_text():
            return "online"
    except OSError:
        pass
    return "offline"


class WandbTracker:
    def __init__(self, cfg, run_root: Path, run_id: str | None, config_dict: dict):
        import wandb

        self.wandb = wandb
        if cfg.api_key:
            log.warning("wandb.api_key is set in the config; prefer the WANDB_API_KEY environment variable")
            os.environ.setdefault("WANDB_API_KEY", cfg.api_key)
        self.mode = wandb_mode(cfg.mode)
        # A requeued job passes the id it saved, so the same wandb run continues (resume="allow").
        # ``config_dict`` is the config's dump (secrets kept out); wandb also records the command line,
        # read from sys.argv while it starts: it sees the arguments with their secrets redacted.
        argv = sys.argv
        sys.argv = [argv[0], *(scrub_argument(a) for a in argv[1:])] if argv else argv
        try:
            self.run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=run_root.name,
                id=run_id,
                resume="allow",
                dir=str(run_root),
                mode=self.mode,
                tags=[scrub_argument(t) for t in cfg.tags],
                config=config_dict,
            )
        finally:
            sys.argv = argv
        self.run_id = self.run.id

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self.wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorboardTracker:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        import numpy as np
        from PIL import Image

        self.writer.add_image(key, np.asarray(Image.open(path).convert("RGB")), step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class Trackers:
    """Fan-out to every tracker; the wandb id is kept so a resumed run logs into the same wandb run."""

    def __init__(self, items: list):
        self.items = items

    @property
    def wandb_id(self) -> str | None:
        return next((t.run_id for t in self.items if isinstance(t, WandbTracker)), None)

    def log(self, metrics: dict, step: int) -> None:
        for t in self.items:
            t.log(metrics, step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        for t in self.items:
            t.log_image(key, path, step)

    def close(self) -> None:
        for t in self.items:
            t.close()


def build_trackers(cfg, run_dir: RunDir, wandb_id: str | None, config_dict: dict) -> Trackers:
    """metrics.jsonl always; wandb (its files under the run folder) and tensorboard as configured."""
    items: list = [JsonlTracker(run_dir.metrics)]
    if wandb_mode(cfg.wandb.mode) != "disabled":
        items.append(WandbTracker(cfg.wandb, run_dir.root, wandb_id, config_dict))
    if cfg.experiment.tensorboard:
        items.append(TensorboardTracker(run_dir.tensorboard))
    return Trackers(items)
