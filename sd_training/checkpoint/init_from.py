"""Stage 2 (``model.init_from``): the trained module's weights from another run (its folder or one of its
checkpoints) or from an exported pipeline; nothing else of that run (optimizer, schedule, data) is read."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import ConfigError
from ..loading import load_component
from ..run_dir import RunDir
from .layout import EMA, MARKER, is_sharded, shared_file
from .store import Checkpointer

log = logging.getLogger(__name__)

def init_weights_from(src: str, net: torch.nn.Module, net_name: str, want_ema: bool) -> None:
    """Load ``net``'s weights (EMA weights when ``want_ema`` and present) from ``src``: a run folder, a
    checkpoint folder, or a pipeline (root or ``net_name`` component folder)."""
    path = Path(src)
    run, parent = RunDir.at(path), RunDir.at(path.parent)
    ckpt = None
    if run.checkpoints.is_dir():
        ckpt = Checkpointer(run.checkpoints).latest()
        if ckpt is None:
            raise ConfigError(f"'model.init_from': {run.checkpoints} holds no complete checkpoint")
    elif (path / MARKER).exists():
        ckpt = path
    if ckpt is not None:
        if is_sharded(ckpt):
            raise ConfigError(f"'model.init_from': {ckpt} is an FSDP checkpoint; use the run's exported pipeline")
        name = EMA if want_ema and shared_file(ckpt, EMA).exists() else net_name
        sd = torch.load(shared_file(ckpt, name), map_location="cpu", weights_only=True)
        net.load_state_dict(sd["shadow"] if name == EMA else sd)
        log.info("model.init_from: %s (%s weights) from checkpoint %s", net_name, name, ckpt)
        return
    folder = path
    if want_ema and path == parent.pipeline(None) and parent.pipeline(None, ema=True).is_dir():
        folder = parent.pipeline(None, ema=True)
    elif run.pipeline(None).is_dir():  # a run folder without checkpoints
        ema = want_ema and run.pipeline(None, ema=True).is_dir()
        folder = run.pipeline(None, ema=ema)
    src_net = load_component(type(net).from_pretrained, str(folder), net_name, "model.init_from")
    net.load_state_dict(src_net.state_dict())
    log.info("model.init_from: %s weights from %s", net_name, folder)
