"""Resuming with another config: the checkpoint's ``config.yaml`` against the current one, sorted into
keys that may change freely (logging, saving, the layout over ranks), keys applied knowingly (the
learning rate), and keys refused unless ``experiment.allow_config_change``."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from ..config import ConfigError
from ..config.loading import REDACTED

log = logging.getLogger(__name__)

# Keys that do not change what is trained: logging, saving, sampling, evaluation, the loader's
# processes, timeouts, and the run length (a longer run is the usual reason to resume with a change).
MAY_CHANGE = (
    "experiment.num_examples_to_see", "dataset.params.num_examples_to_see", "experiment.log_every",
    "experiment.save_every", "experiment.checkpoint_every", "experiment.save_every_minutes",
    "experiment.checkpoint_async", "experiment.checkpoint_verify",
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


