"""Elastic resume of the model state: the trained net, its optimizer state and the EMA of a checkpoint
written by either strategy on any number of ranks, loaded bit for bit into a run of either strategy on
any number of ranks (one process without a process group included).

A checkpoint holds them in one of two layouts:

- full tensors (``ddp`` or one process), rank 0's files: ``<net>.pt`` (the net's state dict),
  ``optimizer.pt`` (a plain ``optimizer.state_dict()``: state keyed by parameter index, counted through
  the optimizer's groups in order, ``optim.param_groups`` then the family's extra groups) and ``ema.pt``
  (the shadow's state dict and the EMA's scalars);
- DCP shards (``fsdp``): ``sharded/`` with ``unet`` (the net), ``optimizer`` (keyed by parameter name,
  as ``get_optimizer_state_dict`` writes it) and ``ema`` (the shadow), plus ``ema_meta.pt`` (the scalars).

Shards load into any run through DCP, which reshards as it reads: into this rank's DTensor shards under
fsdp, into full tensors under ddp or in one process (``Strategy.load_sharded``). Full tensors load as
they are under ddp; under fsdp every rank keeps its slice of them (``Strategy.load_full``), the optimizer
state renamed from parameter indices to parameter names first (:func:`indexed_to_named`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Layout:
    """How a checkpoint holds the model state: DCP shards or full tensors, and how many ranks wrote it."""

    sharded: bool
    world_size: int

    @classmethod
    def of(cls, folder: Path) -> "Layout":
        return cls((Path(folder) / "sharded").is_dir(), len(list(Path(folder).glob("rank_*.pt"))))

    @property
    def kind(self) -> str:
        return "fsdp" if self.sharded else ("ddp" if self.world_size > 1 else "one-process")


def param_names(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The name in ``net`` of every parameter of ``optimizer``, group by group: the order a plain
    ``optimizer.state_dict()`` numbers them in. Every parameter must belong to ``net``."""
    names = {id(p): n for n, p in net.named_parameters()}
    foreign = sum(id(p) not in names for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise RuntimeError(
            f"the optimizer trains {foreign} parameter(s) outside the {type(net).__name__} (a trained text "
            "encoder): an fsdp checkpoint holds no state for them, and fsdp does not train them; resume with the "
            "settings the checkpoint was written with")
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def indexed_to_named(osd: dict, names: list[list[str]], params: dict[str, torch.Tensor]) -> dict:
    """A plain optimizer state dict (state keyed by parameter index) keyed by parameter name instead, as
    ``get_optimizer_state_dict`` writes it. ``names``: :func:`param_names` of the run that loads it (built
    by the same ``param_groups`` as the run that saved it); ``params``: the parameters by name, whose
    (full) shapes every state tensor is checked against."""
    groups = osd["param_groups"]
    if [len(g["params"]) for g in groups] != [len(n) for n in names]:
        raise RuntimeError(
            f"the checkpoint's optimizer has parameter groups of {[len(g['params']) for g in groups]} parameters, "
            f"this run's {[len(n) for n in names]}: it was written for other trained modules or other "
            "optimizer.no_decay_norm_and_bias; resume with the settings it was written with")
    by_index = {i: n for g, group_names in zip(groups, names) for i, n in zip(g["params"], group_names)}
    state = {}
    for index, s in osd["state"].items():
        name = by_index[index]
        for key, t in s.items():
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape != params[name].shape:
                raise RuntimeError(f"the checkpoint's optimizer state '{key}' of parameter {index} has shape "
                                   f"{tuple(t.shape)}, this run's parameter {name} {tuple(params[name].shape)}")
        state[name] = s
    return {"state": state, "param_groups": [{**g, "params": n} for g, n in zip(groups, names)]}


def load_model_state(folder: Path, shared: dict, strategy, net: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     ema, net_name: str, world_size: int) -> str | None:
    """Load the net, the optimizer state and the EMA of checkpoint ``folder`` (``shared``: its plain files,
    as ``Checkpointer.load`` read them on every rank) into this run, whichever layout and rank count wrote
    it. Collective under fsdp. Returns a line saying what was converted; None when the layout is this
    run's own."""
    folder = Path(folder)
    saved = Layout.of(folder)
    needed = [] if saved.sharded else [net_name, "optimizer"]
    if ema is not None:
        needed.append("ema_meta" if saved.sharded else "ema")
    for name in needed:
        if name not in shared:
            raise RuntimeError(f"checkpoint {folder} has no '{name}' state: it was written with other settings "
                               "(model.use_ema); resume with those, or start a new run name")
    shadow = ema.shadow if ema is not None else None
    if saved.sharded:
        param_names(net, optimizer)  # a trained text encoder has no state there: say so before DCP does
        strategy.load_sharded(folder / "sharded", net, optimizer, shadow)
        if ema is not None:
            ema.load_meta_state_dict(shared["ema_meta"])
    elif strategy.sharded:
        params = dict(net.named_parameters())
        optim_sd = indexed_to_named(shared["optimizer"], param_names(net, optimizer), params)
        strategy.load_full(net, optimizer, shadow, shared[net_name], optim_sd,
                           shared["ema"]["shadow"] if ema is not None else None)
        if ema is not None:
            ema.load_meta_state_dict(shared["ema"])
    else:
        net.load_state_dict(shared[net_name])
        optimizer.load_state_dict(shared["optimizer"])
        if ema is not None:
            ema.load_state_dict(shared["ema"])
    return describe(saved, strategy.sharded, world_size, ema is not None)


def describe(saved: Layout, sharded: bool, world_size: int, ema: bool) -> str | None:
    """The log line of a resume across layouts or rank counts; None when nothing changed."""
    if saved.sharded == sharded and saved.world_size == world_size:
        return None
    what = "model, optimizer and EMA" if ema else "model and optimizer"
    if saved.sharded:
        how = "resharded by DCP" if sharded else "gathered from DCP shards"
    else:
        how = "sharded from full tensors" if sharded else "loaded as full tensors (nothing to convert)"
    now = Layout(sharded, world_size)
    where = "in one process" if world_size == 1 else f"under {now.kind} on {world_size} ranks"
    article = "an" if saved.sharded else "a"  # "an fsdp", "a ddp", "a one-process"
    ranks = f"{saved.world_size} rank{'s' if saved.world_size != 1 else ''}"
    return f"resumed {article} {saved.kind} checkpoint of {ranks} {where}: {what} {how}"
