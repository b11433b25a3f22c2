"""Whether a checkpoint's optimizer state is this run's optimizer's, before it is loaded.

``optimizer.load_state_dict`` takes the saved parameter groups' hyperparameters as they are: AdamW's
state loaded into Lion or Prodigy leaves groups without ``weight_decouple`` or ``beta3``, and the first
step fails with a KeyError. Only the groups' sizes were compared before. Here the saved optimizer (its
``optimizer.name`` in the checkpoint's config, its groups' hyperparameter keys, its per-parameter state
keys) is compared with this run's: a key this run's optimizer reads that the saved groups lack (after the
optimizer's own ``__setstate__`` fills the keys a newer torch added) means another optimizer wrote it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .dcp_metadata import read_metadata
from .layout import DCP_METADATA, DCP_OPTIMIZER, OPTIMIZER, SHARDED, is_sharded

# Keys of a parameter group that say nothing of the optimizer: its parameters, the LR schedule's peak.
_NOT_HYPER = frozenset({"params", "initial_lr"})


def saved_keys(folder: Path, shared: dict) -> tuple[set, set] | None:
    """(hyperparameter keys of the saved groups, state keys of the saved parameters) of checkpoint
    ``folder`` (``shared``: its plain files as read); None when it holds no optimizer state to compare
    (the shape checks report a malformed one)."""
    if is_sharded(folder):
        md = read_metadata(Path(folder) / SHARDED / DCP_METADATA)
        groups, state = set(), set()
        for key in md.state_dict_metadata:
            if key.startswith(f"{DCP_OPTIMIZER}.param_groups."):
                groups.add(key.rsplit(".", 1)[1])
            elif key.startswith(f"{DCP_OPTIMIZER}.state."):
                state.add(key.rsplit(".", 1)[1])
        return (groups - _NOT_HYPER, state) if groups else None
    osd = shared.get(OPTIMIZER)
    if not isinstance(osd, dict) or not isinstance(osd.get("param_groups"), list) \
            or not isinstance(osd.get("state"), dict):
        return None
    groups = {k for g in osd["param_groups"] if isinstance(g, dict) for k in g if isinstance(k, str)}
    state = {k for s in osd["state"].values() if isinstance(s, dict) for k in s if isinstance(k, str)}
    return groups - _NOT_HYPER, state


def filled_keys(optimizer: torch.optim.Optimizer, keys: set) -> set:
    """``keys`` plus those ``optimizer``'s class adds to a loaded group by itself (``__setstate__``'s
    defaults: torch's optimizers fill the flags a newer torch added). Run on a bare instance holding no
    parameter, so nothing of the real optimizer changes."""
    group = {k: None for k in keys} | {"params": []}
    probe = object.__new__(type(optimizer))
    try:
        type(optimizer).__setstate__(probe, {"defaults": dict(optimizer.defaults), "state": {},
                                             "param_groups": [group]})
    except Exception:  # noqa: BLE001 -- an optimizer whose __setstate__ needs more: no keys are added
        return set(keys)
    return set(group) - {"params"}


def optimizer_change(folder: Path, shared: dict, optimizer: torch.optim.Optimizer, saved_name: str | None,
                     name: str) -> str | None:
    """A phrase naming how checkpoint ``folder``'s optimizer state differs from what ``optimizer`` (this
    run's, ``optimizer.name`` ``name``) reads; None when it fits. ``saved_name``: the checkpoint config's
    ``optimizer.name`` (None when unknown)."""
    keys = saved_keys(folder, shared)
    if keys is None:
        return None
    groups, state = keys
    mine = {k for g in optimizer.param_groups for k in g} - _NOT_HYPER
    missing = sorted(mine - filled_keys(optimizer, groups))
    if (saved_name is None or saved_name == name) and not missing:
        return None
    was = f"optimizer.name={saved_name}" if saved_name else "another optimizer"
    lack = (f"; its parameter groups lack {', '.join(missing[:8])}, which {type(optimizer).__name__} reads"
            if missing else "")
    return (f"its optimizer state was written by {was} (state per parameter: {', '.join(sorted(state)) or 'none'}), "
            f"this run trains with optimizer.name={name}{lack}")
