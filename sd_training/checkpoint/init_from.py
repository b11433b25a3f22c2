"""Stage 2 (``model.init_from``): the trained module's weights from another run (its folder or one of its
checkpoints) or from an exported pipeline; nothing else of that run (optimizer, schedule, data) is read.

What is read is checked first, and there is no fallback (the source is the user's choice): a checkpoint
against its marker (sizes, and the CRC32 of the file read), a pipeline's weights files against their
headers (``export.check_weights``), and the weights' names and shapes against this run's model. Any
problem is a ConfigError naming the file and the problem."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..config import ConfigError
from ..outputs.export import check_weights
from ..loading import load_component
from ..run.run_dir import RunDir
from .integrity import CHECKSUM, CheckpointDamaged, file_record, verify
from .layout import CONFIG, EMA, MARKER, is_sharded, shared_file
from .model_state import check_state_shapes, shapes_of
from .store import Checkpointer, _load_weights_only

log = logging.getLogger(__name__)

WHAT = "model.init_from"


def init_weights_from(src: str, net: torch.nn.Module, net_name: str, want_ema: bool) -> None:
    """Load ``net``'s weights (EMA weights when ``want_ema`` and present) from ``src``: a run folder, a
    checkpoint folder, or a pipeline (root or ``net_name`` component folder)."""
    path = Path(src)
    run, parent = RunDir.at(path), RunDir.at(path.parent)
    ckpt = None
    if run.checkpoints.is_dir():
        ckpt = Checkpointer(run.checkpoints).latest()
        if ckpt is None:
            raise ConfigError(f"'{WHAT}': {run.checkpoints} holds no complete checkpoint")
    elif (path / MARKER).exists():
        ckpt = path
    if ckpt is not None:
        if is_sharded(ckpt):
            raise ConfigError(f"'{WHAT}': {ckpt} is an FSDP checkpoint; use the run's exported pipeline")
        name = EMA if want_ema and shared_file(ckpt, EMA).exists() else net_name
        if name == net_name and _schedule_free(ckpt):
            raise ConfigError(f"'{WHAT}': {ckpt} is a checkpoint of an optimizer.name=adamw_schedulefree run: its "
                              f"{net_name} weights are the training weights (y), not the averaged ones (x) that run "
                              f"validated and exported. Point {WHAT} at the run's exported pipeline "
                              f"({run.pipeline(None) if run.checkpoints.is_dir() else 'its current_pipeline'})")
        try:
            sd = _read_checkpoint_weights(ckpt, name)
            sd = sd["shadow"] if name == EMA and isinstance(sd, dict) and "shadow" in sd else sd
            check_state_shapes(shared_file(ckpt, name), sd, shapes_of(net))
        except CheckpointDamaged as e:
            raise ConfigError(f"'{WHAT}': {e}. Point it at an older checkpoint (a step_<N> folder) or a pipeline") from None
        net.load_state_dict(sd)
        log.info("%s: %s (%s weights) from checkpoint %s", WHAT, net_name, name, ckpt)
        return
    folder = path
    if want_ema and path == parent.pipeline(None) and parent.pipeline(None, ema=True).is_dir():
        folder = parent.pipeline(None, ema=True)
    elif run.pipeline(None).is_dir():  # a run folder without checkpoints
        ema = want_ema and run.pipeline(None, ema=True).is_dir()
        folder = run.pipeline(None, ema=ema)
    net.load_state_dict(load_weights_checked(str(folder), net, net_name, WHAT).state_dict())
    log.info("%s: %s weights from %s", WHAT, net_name, folder)


def _schedule_free(ckpt: Path) -> bool:
    """Whether the run that wrote checkpoint ``ckpt`` trained with schedule-free AdamW (its config.yaml)."""
    try:
        saved = OmegaConf.to_container(OmegaConf.create((ckpt / CONFIG).read_text()))
    except Exception:  # noqa: BLE001 -- no readable config.yaml: the weights are taken as they are
        return False
    return isinstance(saved, dict) and (saved.get("optimizer") or {}).get("name") == "adamw_schedulefree"


def load_weights_checked(src: str, net: torch.nn.Module, net_name: str, what: str) -> torch.nn.Module:
    """A pipeline component of ``net``'s class from ``src`` (a pipeline root, the component's folder or a
    hub id), its weights files checked before they are read and its weights' names and shapes against
    ``net`` after: a ConfigError naming ``what`` (the config key), the file and the problem."""
    component = check_weights(src, net_name, what)
    loaded = load_component(type(net).from_pretrained, src, net_name, what)
    try:
        check_state_shapes(component or Path(src), loaded.state_dict(), shapes_of(net))
    except CheckpointDamaged as e:
        raise ConfigError(f"'{what}': {e} (model.unet.* must describe the same model)") from None
    return loaded


def _read_checkpoint_weights(ckpt: Path, name: str) -> dict:
    """``<name>.pt`` of a complete checkpoint, checked against the marker first: every file's size, and
    this file's CRC32 (the only one read). Raises CheckpointDamaged."""
    marker = verify(ckpt, checksums=False)
    path = shared_file(ckpt, name)
    record = marker["files"].get(path.name) if marker is not None else None
    if marker is not None and record is None:
        raise CheckpointDamaged(path, "is not recorded by the COMPLETE marker")
    if record is not None and CHECKSUM in record:
        got = file_record(path)[CHECKSUM]
        if got != record[CHECKSUM]:
            raise CheckpointDamaged(path, f"fails its checksum (CRC32 {got}, the COMPLETE marker records "
                                          f"{record[CHECKSUM]}): its bytes changed after the save")
    return _load_weights_only(path, "cpu")
