"""The run folder: everything a run writes lives under ``experiment.log_dir/experiment.name/``.

    <log_dir>/<name>/
      config.yaml               resolved config (re-run with config=<this file>)
      metrics.jsonl             one JSON object per log interval (always written)
      train.log                 rank 0's log; logs/rank_<N>.log for the other ranks
      checkpoints/step_<N>/     resume state (see sd_training.checkpoint)
      current_pipeline/         newest exported diffusers pipeline (raw weights)
      current_pipeline_ema/     the same with EMA weights (model.use_ema=True)
      pipelines/step_<N>[_ema]/ every export, when experiment.save_only_most_recent=False
      samples/step_<N>.png      sample grid of each export
      wandb/                    wandb's files (offline runs sync from here)
      sources.json              where the UNet, VAE and text encoder came from
      sample_keys/rank_<N>.jsonl  the samples of every step (experiment.record_sample_keys)
      .lock                     held by the running job (see sd_training.run_guard)
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path


class RunDir:
    def __init__(self, log_dir: str, name: str):
        self.root = Path(log_dir) / name

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    def sample_keys(self, rank: int) -> Path:
        return self.root / "sample_keys" / f"rank_{rank}.jsonl"

    def pipeline(self, step: int | None, ema: bool = False) -> Path:
        suffix = "_ema" if ema else ""
        if step is None:
            return self.root / f"current_pipeline{suffix}"
        return self.root / "pipelines" / f"step_{step:08d}{suffix}"

    def create(self) -> None:
        for d in (self.root, self.checkpoints, self.samples, self.root / "logs"):
            d.mkdir(parents=True, exist_ok=True)

    def setup_logging(self, rank: int) -> None:
        """Console (rank 0 only, at INFO) plus one log file per rank."""
        path = self.root / "train.log" if rank == 0 else self.root / "logs" / f"rank_{rank}.log"
        fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        root = logging.getLogger()
        for h in list(root.handlers):
            if getattr(h, "_sd_training", False):
                root.removeHandler(h)
                h.close()
        handlers = [logging.FileHandler(path)]
        if rank == 0:
            handlers.append(logging.StreamHandler(sys.stdout))
        for h in handlers:
            h.setFormatter(fmt)
            h._sd_training = True
            root.addHandler(h)
        root.setLevel(logging.INFO)


def repair_swaps(*folders: Path) -> list[Path]:
    """Finish what a kill between the two renames of :func:`replace_dir` left: ``X.old`` without ``X``
    goes back to ``X`` (the previous complete export); ``X.old`` beside a complete ``X`` is removed."""
    restored = []
    for folder in folders:
        if not Path(folder).is_dir():
            continue
        for old in Path(folder).glob("*.old"):
            final = old.with_name(old.name[: -len(".old")])
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, final)
                restored.append(final)
    return restored


def copy_dir_atomically(src: Path, final: Path) -> None:
    """A copy of ``src`` at ``final`` that a kill leaves either complete or absent (never half-written)."""
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, tmp)
    replace_dir(tmp, final)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a fully written folder into place; the old one is removed only after the new one exists.
    A kill between the two renames leaves ``final.old``, which :func:`repair_swaps` puts back."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
