"""The model state of a checkpoint: the trained net, its optimizer state and the EMA, saved in the run's
layout and loaded bit for bit from either layout, written on any number of ranks, into a run of either
strategy on any number of ranks (one process without a process group included). Save and load are
side by side here; the names come from ``layout``.

The two layouts:

- full tensors (``ddp`` or one process), rank 0's files: ``<net>.pt`` (the net's state dict),
  ``optimizer.pt`` (a plain ``optimizer.state_dict()``: state keyed by parameter index, counted through
  the optimizer's groups in order, ``optim.param_groups`` then the family's extra groups) and ``ema.pt``
  (the shadow's state dict and the EMA's scalars);
- DCP shards (``fsdp``): ``sharded/`` with the net, the optimizer (keyed by parameter name, as
  ``get_optimizer_state_dict`` writes it) and the EMA shadow, plus ``ema_meta.pt`` (the scalars).

DCP (``torch.distributed.checkpoint``, about a second of import time) is imported where a sharded
checkpoint is written or read, so one-process and DDP runs never load it.

Shards load into any run through DCP, which reshards as it reads: into this rank's DTensor shards under
fsdp, into full tensors under ddp or in one process. Full tensors load as they are under ddp; under fsdp
every rank keeps its slice of them, the optimizer state renamed from parameter indices to parameter
names first (:func:`indexed_to_named`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .layout import DCP_EMA, DCP_NET, DCP_OPTIMIZER, EMA, EMA_META, OPTIMIZER, SHARDED, is_sharded, rank_files


@dataclass(frozen=True)
class Layout:
    """How a checkpoint holds the model state: DCP shards or full tensors, and how many ranks wrote it."""

    sharded: bool
    world_size: int

    @classmethod
    def of(cls, folder: Path) -> Layout:
        return cls(is_sharded(folder), len(rank_files(folder)))

    @property
    def kind(self) -> str:
        return "fsdp" if self.sharded else ("ddp" if self.world_size > 1 else "one-process")


class _EMAScalars:
    """The EMA's scalars as a state of their own (``ema_meta``), when its weights are sharded."""

    def __init__(self, ema):
        self.ema = ema

    def state_dict(self) -> dict:
        return self.ema.meta_state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.ema.load_meta_state_dict(sd)


class ModelState:
    """The net, its optimizer and the EMA of one run, in the layout of its strategy (``strategy.sharded``)."""

    def __init__(self, strategy, net: torch.nn.Module, net_name: str, optimizer: torch.optim.Optimizer, ema=None):
        self.strategy, self.net, self.net_name, self.optimizer, self.ema = strategy, net, net_name, optimizer, ema
        self._save_group = None  # gloo group of asynchronous sharded saves (created at the first one)

    @property
    def shadow(self):
        return self.ema.shadow if self.ema is not None else None

    # -- save -------------------------------------------------------------------------------------
    def plain_objects(self) -> dict:
        """The objects whose ``state_dict()`` rank 0 writes as ``<name>.pt`` files."""
        if self.strategy.sharded:
            return {EMA_META: _EMAScalars(self.ema)} if self.ema is not None else {}
        objs = {self.net_name: self.net, OPTIMIZER: self.optimizer}
        if self.ema is not None:
            objs[EMA] = self.ema
        return objs

    def sharded_writer(self, asynchronous: bool):
        """fsdp: ``write(folder)`` for every rank (collective; asynchronous: returns DCP's future, staged
        before it returns); None when the state is all in the plain files."""
        if not self.strategy.sharded:
            return None
        import torch.distributed.checkpoint as dcp  # sharded runs only: see the module's docstring

        state = self._sharded_state()
        if not asynchronous:
            return lambda folder: dcp.save(state, checkpoint_id=str(folder))
        if self._save_group is None:
            # DCP's collectives on a gloo group of their own: they never interleave with training's (NCCL).
            self._save_group = dist.new_group(backend="gloo")  # collective: every rank, first async save
        group = self._save_group
        return lambda folder: dcp.async_save(state, checkpoint_id=str(folder), process_group=group)

    def _sharded_state(self) -> dict:
        """The sharded state DCP writes and reads (collective under fsdp)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model_sd, optim_sd = get_state_dict(self.net, self.optimizer)
        state = {DCP_NET: model_sd, DCP_OPTIMIZER: optim_sd}
        if self.ema is not None:
            state[DCP_EMA] = get_model_state_dict(self.shadow)
        return state

    # -- load -------------------------------------------------------------------------------------
    def load(self, folder: Path, shared: dict, world_size: int) -> str | None:
        """Load the checkpoint ``folder`` (``shared``: its plain files, as ``Checkpointer.load`` read them
        on every rank) whichever layout and rank count wrote it. Collective under fsdp. Returns a line
        saying what was converted; None when the layout is this run's own."""
        folder = Path(folder)
        saved = Layout.of(folder)
        needed = [] if saved.sharded else [self.net_name, OPTIMIZER]
        if self.ema is not None:
            needed.append(EMA_META if saved.sharded else EMA)
        for name in needed:
            if name not in shared:
                raise RuntimeError(f"checkpoint {folder} has no '{name}' state: it was written with other settings "
                                   "(model.use_ema); resume with those, or start a new run name")
        if saved.sharded:
            param_names(self.net, self.optimizer)  # a trained text encoder has no state there: say so before DCP
            self._load_sharded(folder / SHARDED)
            if self.ema is not None:
                self.ema.load_meta_state_dict(shared[EMA_META])
        elif self.strategy.sharded:
            params = dict(self.net.named_parameters())
            optim_sd = indexed_to_named(shared[OPTIMIZER], param_names(self.net, self.optimizer), params)
            self._load_full(shared[self.net_name], optim_sd, shared[EMA]["shadow"] if self.ema is not None else None)
            if self.ema is not None:
                self.ema.load_meta_state_dict(shared[EMA])
        else:
            self.net.load_state_dict(shared[self.net_name])
            self.optimizer.load_state_dict(shared[OPTIMIZER])
            if self.ema is not None:
                self.ema.load_state_dict(shared[EMA])
        return describe(saved, self.strategy.sharded, world_size, self.ema is not None)

    def _load_sharded(self, folder: Path) -> None:
        """DCP shards, written on any number of ranks, into this run's own layout: each rank's DTensor shards
        under fsdp, the full tensors under ddp (every rank) and in one process (no process group: no
        collective), resharding as it reads."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = self._sharded_state()  # the layout to load into
        dcp.load(state, checkpoint_id=str(folder), no_dist=not (dist.is_available() and dist.is_initialized()))
        set_state_dict(self.net, self.optimizer, model_state_dict=state[DCP_NET], optim_state_dict=state[DCP_OPTIMIZER])
        if self.ema is not None:
            set_model_state_dict(self.shadow, state[DCP_EMA])

    def _load_full(self, net_sd: dict, optim_sd: dict, ema_sd: dict | None) -> None:
        """fsdp (collective): full tensors that every rank holds (the optimizer state keyed by parameter name)
        into this rank's shards: each rank keeps its slice."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        full = StateDictOptions(full_state_dict=True)
        set_state_dict(self.net, self.optimizer, model_state_dict=net_sd, optim_state_dict=optim_sd, options=full)
        if self.ema is not None:
            set_model_state_dict(self.shadow, ema_sd, options=full)


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
