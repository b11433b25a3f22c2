"""Resuming with another config: the checkpoint's ``config.yaml`` against the current one, sorted into
keys that may change freely (logging, saving, the layout over ranks), keys applied knowingly (the
learning rate), and keys refused unless ``experiment.allow_config_change``.

Both sides are dumps (``config.loading.public_dict``): a redacted secret or a value read from the
environment (``${oc.env:...}``) is compared as a wildcard (``config.secrets.same_value``), so a rotated
token is not a change. The per-device batch, the accumulation and ``system.global_batch_size`` are how the
global batch is laid out: a change of them that keeps the global batch (images per optimizer step) is
a layout change like a new rank count, and passes; one that changes it is refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import OmegaConf

from ..config import ConfigError
from ..config.secrets import same_value
from .layout import TRAIN_STATE, rank_files

log = logging.getLogger(__name__)

# Keys that do not change what is trained: logging, saving, sampling, evaluation, the loader's
# processes, timeouts, and the run length (a longer run is the usual reason to resume with a change).
MAY_CHANGE = (
    "experiment.num_examples_to_see", "dataset.params.num_examples_to_see", "experiment.log_every",
    "experiment.save_every", "experiment.checkpoint_every", "experiment.save_every_minutes",
    "experiment.checkpoint_async", "experiment.checkpoint_verify",
    "experiment.keep_last_checkpoints", "experiment.keep_checkpoint_every", "experiment.save_only_most_recent",
    "experiment.sample_", "experiment.num_eval_images", "experiment.eval_caption_file", "experiment.eval_reference_file",
    "experiment.requeue",
    "experiment.resume", "experiment.start_fresh", "experiment.allow_config_change", "experiment.tensorboard",
    "experiment.peak_tflops", "experiment.max_nonfinite_steps", "experiment.max_zero_weight_steps", "experiment.export_weights", "experiment.log_dir",
    "evaluation.", "validation.", "wandb.", "quickstart.", "system.workers", "dataset.params.workers",
    "system.device", "system.tf32", "system.stop_timeout_s", "distributed.timeout_minutes", "distributed.dist_url", "distributed.dist_backend",
    "distributed.flag_sync_every", "experiment.progress_bar", "experiment.record_sample_keys", "experiment.model_card_",
    # How the same training is laid out over the ranks (elastic resume: checkpoints reshard between them).
    "distributed.strategy", "distributed.bucket_cap_mb", "distributed.static_graph", "distributed.fsdp_unit",
    "distributed.fsdp_cpu_offload", "distributed.reshard_after_forward", "distributed.hsdp_shard_size",
    # How the same computation is laid out and compiled (the memory format, the compiled regions, their cache).
    "model.channels_last", "model.compile_scope", "model.compile_mode", "model.compile_cache",
    # Where the frozen text encoders live (they compute the same states wherever they run).
    "model.text_encoder_placement",
)
# Keys whose new value takes effect on resume, said in the log.
APPLIED = ("optimizer.params.learning_rate", "lr_scheduler.params.learning_rate")
# How the global batch is laid out: free while the global batch stays the same, refused otherwise.
BATCH_LAYOUT = ("system.batch_size", "system.gradient_accumulation", "system.global_batch_size",
                "dataset.params.batch_size")

def _flat(d, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


ABSENT = "<absent>"


def _defaults() -> dict:
    """Every key's schema default, flat (interpolated defaults as their text)."""
    from ..config.schema import train_config_class

    return _flat(OmegaConf.to_container(OmegaConf.structured(train_config_class()), resolve=False))


def config_changes(saved_yaml: str, current: dict, saved_global_batch: int | None = None,
                   global_batch: int | None = None) -> tuple[list[str], list[str], list[str]]:
    """(may change, applied, refused): ``"key: old -> new"`` lines, the checkpoint's config against now.
    ``saved_global_batch`` / ``global_batch``: images per optimizer step then and now (None: unknown);
    equal, the batch layout keys (``BATCH_LAYOUT``) may change."""
    old = _flat(OmegaConf.to_container(OmegaConf.create(saved_yaml)))
    new = _flat(current)
    defaults = _defaults()
    same_batch = bool(saved_global_batch) and saved_global_batch == global_batch
    free, applied, refused = [], [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, ABSENT), new.get(key, ABSENT)
        if same_value(a, b):
            continue
        line = f"{key}: {a} -> {b}"
        if a == ABSENT and key in defaults and defaults[key] == b:
            free.append(f"{line} (a key newer than the checkpoint, at its default)")
        elif key.startswith(MAY_CHANGE):
            free.append(line)
        elif key in BATCH_LAYOUT and same_batch:
            free.append(f"{line} (global batch {global_batch} kept)")
        elif key in APPLIED:
            applied.append(line)
        else:
            refused.append(line)
    return free, applied, refused


def saved_global_batch(saved_yaml: str, checkpoint: Path) -> int | None:
    """Images per optimizer step of the run that wrote ``checkpoint``: its train state's record, else its
    config's ``global_batch_size``, else batch x accumulation x its rank files; None when unknown."""
    try:
        recorded = json.loads((Path(checkpoint) / TRAIN_STATE).read_text()).get("global_batch")
        if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0:
            return recorded
    except (OSError, ValueError, AttributeError):
        pass
    try:
        system = OmegaConf.to_container(OmegaConf.create(saved_yaml)).get("system", {})
        if int(system.get("global_batch_size") or 0) > 0:
            return int(system["global_batch_size"])
        ranks = len(rank_files(checkpoint))
        return int(system["batch_size"]) * int(system["gradient_accumulation"]) * ranks or None
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


def current_global_batch(current: dict) -> int | None:
    """Images per optimizer step of this run (as ``train_state.Plan`` derives it), from its config dump and
    the process group's size."""
    try:
        system = current["system"]
        if int(system.get("global_batch_size") or 0) > 0:
            return int(system["global_batch_size"])
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return int(system["batch_size"]) * int(system["gradient_accumulation"]) * world
    except (TypeError, ValueError, KeyError):
        return None


def check_resume_config(saved_yaml: str, current: dict, allow: bool, checkpoint: Path,
                        global_batch: int | None = None) -> list[str]:
    """Log the permitted changes; refuse the others unless ``allow``. Returns the applied changes.
    ``global_batch``: this run's images per optimizer step (None: derived from ``current``)."""
    free, applied, refused = config_changes(
        saved_yaml, current, saved_global_batch(saved_yaml, checkpoint),
        global_batch if global_batch is not None else current_global_batch(current))
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


def saved_optimizer_name(saved_yaml: str | None) -> str | None:
    """``optimizer.name`` of a checkpoint's ``config.yaml`` text; None when it has none (or none is readable)."""
    if not saved_yaml:
        return None
    try:
        saved = OmegaConf.to_container(OmegaConf.create(saved_yaml))
        name = (saved.get("optimizer") or {}).get("name")
    except Exception:  # noqa: BLE001 -- unreadable: the config check above says so
        return None
    return name if isinstance(name, str) else None
