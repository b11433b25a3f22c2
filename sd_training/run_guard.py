"""What protects a run folder and the run in it: one run at a time, no silent mixing of two runs,
no silent config change on resume, a metrics file that holds every step once.

* :func:`lock_run_folder` (rank 0): an ``flock`` on ``<run>/.lock``, released by the kernel when the
  process dies (no stale locks after a kill -9), the holder's host and pid written inside.
* :func:`prepare_fresh_start` (rank 0): a folder that already holds checkpoints is refused unless the
  run resumes it (``experiment.resume``) or the user asks for a fresh start
  (``experiment.start_fresh``), which moves the old contents aside; nothing is deleted.
* :func:`config_changes` (every rank): the checkpoint's config against the current one, sorted into
  keys that may change freely, keys applied knowingly (the learning rate), and keys refused.
* :func:`cut_metrics_back` (rank 0): after a resume at step S, rows past S (logged after the
  checkpoint by the run that was killed) are dropped, so every step is logged once.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from omegaconf import OmegaConf

from .config import REDACTED, ConfigError

log = logging.getLogger(__name__)

# Keys that do not change what is trained: logging, saving, sampling, evaluation, the loader's
# processes, timeouts, and the run length (a longer run is the usual reason to resume with a change).
MAY_CHANGE = (
    "experiment.num_examples_to_see", "dataset.params.num_examples_to_see", "experiment.log_every",
    "experiment.save_every", "experiment.checkpoint_every", "experiment.save_every_minutes",
    "experiment.checkpoint_async",
    "experiment.keep_last_checkpoints", "experiment.keep_checkpoint_every", "experiment.save_only_most_recent",
    "experiment.sample_", "experiment.num_eval_images", "experiment.eval_caption_file", "experiment.requeue",
    "experiment.resume", "experiment.start_fresh", "experiment.allow_config_change", "experiment.tensorboard",
    "experiment.peak_tflops", "experiment.max_nonfinite_steps", "experiment.export_weights", "experiment.log_dir",
    "evaluation.", "validation.", "wandb.", "quickstart.", "system.workers", "dataset.params.workers",
    "system.device", "system.tf32", "distributed.timeout_minutes", "distributed.dist_url", "distributed.dist_backend",
    "distributed.flag_sync_every", "experiment.progress_bar", "experiment.record_sample_keys",
    # How the same training is laid out over the ranks (elastic resume: checkpoints reshard between them).
    "distributed.strategy", "distributed.bucket_cap_mb", "distributed.static_graph", "distributed.fsdp_unit",
    "distributed.fsdp_cpu_offload", "distributed.reshard_after_forward",
)
# Keys whose new value takes effect on resume, said in the log.
APPLIED = ("optimizer.params.learning_rate", "lr_scheduler.params.learning_rate")

LOCK_NAME = ".lock"


class RunFolderInUse(ConfigError):
    pass


def lock_run_folder(root: Path):
    """Hold an exclusive lock on the run folder for the life of this process; returns the open file."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    fh = open(path, "a+")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise RunFolderInUse(
            f"run folder {root} is in use by {holder}. Two runs in one folder would delete each other's "
            "checkpoints: wait for it to end (or stop it), or set another experiment.name"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    fh.flush()
    return fh


def prepare_fresh_start(root: Path, checkpoint_steps: list[int], resume: bool, start_fresh: bool) -> Path | None:
    """Refuse to train a new run on top of an old one; with ``start_fresh`` move the old one aside.

    Returns the folder the old contents were moved to, or None."""
    if not checkpoint_steps or (resume and not start_fresh):
        return None
    if not start_fresh:
        raise ConfigError(
            f"run folder {root} holds checkpoints of an earlier run (steps {checkpoint_steps[0]}..{checkpoint_steps[-1]}) "
            "and experiment.resume=false: a new run there would mix its metrics and samples with the old ones "
            "and its checkpoint retention would delete the old run's. Set experiment.resume=true to continue it, "
            "another experiment.name, or experiment.start_fresh=true to move the old contents aside and start over"
        )
    aside = root.with_name(f"{root.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    aside.mkdir()
    for entry in root.iterdir():
        if entry.name != LOCK_NAME:
            os.replace(entry, aside / entry.name)
    log.warning("experiment.start_fresh: the earlier run's files were moved to %s", aside)
    return aside


def _flat(d, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def config_changes(saved_yaml: str, current: dict) -> tuple[list[str], list[str], list[str]]:
    """(may change, applied, refused): ``"key: old -> new"`` lines, the checkpoint's config against now."""
    old = _flat(OmegaConf.to_container(OmegaConf.create(saved_yaml)))
    new = _flat(current)
    free, applied, refused = [], [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a == b or REDACTED in (a, b):
            continue
        line = f"{key}: {a} -> {b}"
        if key.startswith(MAY_CHANGE):
            free.append(line)
        elif key in APPLIED:
            applied.append(line)
        else:
            refused.append(line)
    return free, applied, refused


def check_resume_config(saved_yaml: str, current: dict, allow: bool, checkpoint: Path) -> list[str]:
    """Log the permitted changes; refuse the others unless ``allow``. Returns the applied changes."""
    free, applied, refused = config_changes(saved_yaml, current)
    if free:
        log.info("resuming with changed settings: %s", "; ".join(free))
    if refused:
        if not allow:
            raise ConfigError(
                f"the config differs from the one checkpoint {checkpoint} was trained with, in keys that change "
                f"the training: {'; '.join(refused)}. Resume with the old values, start a new experiment.name, or "
                "set experiment.allow_config_change=true to continue with the new ones knowingly"
            )
        log.warning("experiment.allow_config_change: continuing with changed training settings: %s", "; ".join(refused))
    for line in applied:
        log.warning("resuming with a new value that takes effect now: %s", line)
    return applied


def cut_metrics_back(path: Path, step: int) -> int:
    """Drop metric rows logged after ``step`` (by the run that was killed after its last checkpoint);
    returns how many were dropped. Written to a temporary file, then renamed."""
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:  # a line cut by the kill
            dropped += 1
            continue
        if row_step > step:
            dropped += 1
        else:
            keep.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
        log.info("metrics.jsonl: %d row(s) logged after step %d by the interrupted run removed", dropped, step)
    return dropped
