"""The model state of a checkpoint: the trained net, its optimizer state and the EMA, saved in the run's
layout and loaded bit for bit from either layout, written on any number of ranks, into a run of either
strategy on any number of ranks (one process without a process group included). Save and load are
side by side here; the names come from ``layout``.

The two layouts:

- full tensors (``ddp`` or one process), rank 0's files: ``<net>.pt`` (the net's state dict),
  ``optimizer.pt`` (a plain ``optimizer.state_dict()``: state keyed by parameter index, counted through
  the optimizer's groups in order, ``optim.param_groups`` then the family's extra groups) and ``ema.pt``
  (the shadow's state dict and the EMA's scalars);
- DCP shards (``fsdp``, ``hsdp``): ``sharded/`` with the net, the optimizer (keyed by parameter name, as
  ``get_optimizer_state_dict`` writes it) and the EMA shadow, plus ``ema_meta.pt`` (the scalars).

DCP (``torch.distributed.checkpoint``, about a second of import time) is imported where a sharded
checkpoint is written or read, so one-process and DDP runs never load it.

Shards load into any run through DCP, which reshards as it reads: into this rank's DTensor shards under
fsdp and hsdp (a 2-D mesh: each replica group reads the same shards), into full tensors under ddp or in
one process. Full tensors load as they are under ddp; under fsdp and hsdp
every rank keeps its slice of them, the optimizer state renamed from parameter indices to parameter
names first (:func:`indexed_to_named`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .dcp_metadata import read_metadata, safe_reader
from .integrity import CheckpointDamaged
from .optimizer_state import optimizer_change
from .layout import (
    DCP_EMA,
    DCP_METADATA,
    DCP_NET,
    DCP_OPTIMIZER,
    EMA,
    EMA_META,
    OPTIMIZER,
    SHARDED,
    is_sharded,
    plain_name,
    rank_files,
    shared_file,
)


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


# A net carrying this attribute (true) has a frozen base stored elsewhere (model.adapter.base_quantization:
# <run>/quantized_base): its checkpoints hold only its trained parameters (the adapter).
TRAINED_ONLY = "checkpoint_trained_only"


class TrainedOnly:
    """The state of a net's trained parameters only (``TRAINED_ONLY``); loading refuses a state that lacks
    one of them or names anything else of the net's."""

    def __init__(self, net: torch.nn.Module):
        self.net = net

    def _names(self) -> list[str]:
        return [n for n, p in self.net.named_parameters() if p.requires_grad]

    def state_dict(self) -> dict:
        params = dict(self.net.named_parameters())
        return {n: params[n].detach() for n in self._names()}

    def load_state_dict(self, sd: dict) -> None:
        names = set(self._names())
        if set(sd) != names:
            raise RuntimeError(f"the checkpoint's {len(sd)} trained tensors are not this run's {len(names)} "
                               f"(first differing: {sorted(set(sd) ^ names)[:2]})")
        params = dict(self.net.named_parameters())
        with torch.no_grad():
            for n, v in sd.items():
                params[n].copy_(v)


class ModelState:
    """The net, its optimizer and the EMA of one run, in the layout of its strategy (``strategy.sharded``)."""

    def __init__(self, strategy, net: torch.nn.Module, net_name: str, optimizer: torch.optim.Optimizer, ema=None):
        self.strategy, self.net, self.net_name, self.optimizer, self.ema = strategy, net, net_name, optimizer, ema
        # What <net>.pt holds: the whole net, or its trained parameters when the base is stored apart
        self.net_state = TrainedOnly(net) if getattr(net, TRAINED_ONLY, False) else net
        self._save_group = None  # gloo group of asynchronous sharded saves (created at the first one)

    @property
    def shadow(self):
        return self.ema.shadow if self.ema is not None else None

    # -- save -------------------------------------------------------------------------------------
    def plain_objects(self) -> dict:
        """The objects whose ``state_dict()`` rank 0 writes as ``<name>.pt`` files."""
        if self.strategy.sharded:
            return {EMA_META: _EMAScalars(self.ema)} if self.ema is not None else {}
        objs = {self.net_name: self.net_state, OPTIMIZER: self.optimizer}
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

    # -- check ------------------------------------------------------------------------------------
    def optimizer_change(self, folder: Path, shared: dict, saved_name: str | None, name: str) -> str | None:
        """How the checkpoint's optimizer state differs from this run's optimizer (``optimizer_state``);
        None when this run's optimizer can load it."""
        return optimizer_change(folder, shared, self.optimizer, saved_name, name)

    def check_shapes(self, folder: Path, shared: dict, modules: dict | None = None, optimizer: bool = True) -> None:
        """Before anything is loaded: the checkpoint's tensors against this run's model, names and shapes
        (the net, the EMA shadow, the optimizer state; ``modules``: other trained modules by file name).
        Sharded: DCP's index, and every byte range it names inside its files. Raises
        :class:`CheckpointDamaged` naming the file and the parameter. ``optimizer``: False when the optimizer
        state is not loaded (another optimizer's, dropped)."""
        folder = Path(folder)
        expected = shapes_of(self.net_state)
        if is_sharded(folder):
            self._check_dcp(folder / SHARDED, expected, optimizer)
        else:
            if self.net_name in shared:
                check_state_shapes(shared_file(folder, self.net_name), shared[self.net_name], expected)
            if self.ema is not None and EMA in shared:
                ema = shared[EMA]
                if not isinstance(ema, dict) or not isinstance(ema.get("shadow"), dict):
                    raise CheckpointDamaged(shared_file(folder, EMA), "holds no EMA 'shadow' state dict")
                check_state_shapes(shared_file(folder, EMA), ema["shadow"], shapes_of(self.shadow), "EMA parameter")
            if optimizer and OPTIMIZER in shared:
                check_optimizer_shapes(shared_file(folder, OPTIMIZER), shared[OPTIMIZER], self.optimizer, self.net)
        for name, module in (modules or {}).items():
            if name in shared and isinstance(module, torch.nn.Module):
                check_state_shapes(shared_file(folder, name), shared[name], shapes_of(module))

    def _check_dcp(self, folder: Path, expected: dict, optimizer: bool = True) -> None:
        meta = folder / DCP_METADATA
        md = read_metadata(meta)  # never torch's reader: it unpickles anything (see dcp_metadata)
        sizes: dict[str, int] = {}
        for info in md.storage_data.values():
            rel = info.relative_path
            if not plain_name(rel):
                raise CheckpointDamaged(meta, f"names {str(rel)[:200]!r}, a path outside {SHARDED}/")
            if rel not in sizes:
                try:
                    sizes[rel] = (folder / rel).stat().st_size
                except FileNotFoundError:
                    raise CheckpointDamaged(folder / rel, "is missing (DCP's index names it)") from None
            end = info.offset + info.length
            if end > sizes[rel]:
                raise CheckpointDamaged(folder / rel, f"holds {sizes[rel]:,} bytes, DCP's index reads up to byte {end:,} "
                                                      "(cut short)")
        saved = md.state_dict_metadata
        groups = [(DCP_NET, "parameter", expected)]
        if self.ema is not None:  # the shadow: the net's entries, or only its trained parameters (model.adapter)
            groups.append((DCP_EMA, "EMA parameter", shapes_of(self.shadow)))
        for prefix, what, shapes in groups:
            for key, shape in shapes.items():
                m = saved.get(f"{prefix}.{key}")
                if m is None:
                    raise CheckpointDamaged(meta, f"has no {what} '{key}' of this run's model: it was written for "
                                                  "another model")
                size = getattr(m, "size", None)
                if size is not None and tuple(size) != shape:
                    raise CheckpointDamaged(meta, f"holds {what} '{key}' of shape {tuple(size)}, this run's model has "
                                                  f"{shape}: it was written for another model size")
        state_prefix = f"{DCP_OPTIMIZER}.state."
        for key, m in saved.items() if optimizer else ():
            if key.startswith(state_prefix) and getattr(m, "size", None) is not None and len(m.size) > 0:
                param, entry = key[len(state_prefix):].rsplit(".", 1)
                if entry in PARAM_SHAPED_STATE and param in expected and tuple(m.size) != expected[param]:
                    raise CheckpointDamaged(meta, f"holds optimizer state '{key}' of shape {tuple(m.size)}, this "
                                                  f"run's parameter {param} has {expected[param]}")

    # -- load -------------------------------------------------------------------------------------
    def load(self, folder: Path, shared: dict, world_size: int, optimizer: bool = True) -> str | None:
        """Load the checkpoint ``folder`` (``shared``: its plain files, as ``Checkpointer.load`` read them
        on every rank) whichever layout and rank count wrote it. Collective under fsdp. Returns a line
        saying what was converted; None when the layout is this run's own. ``optimizer``: False leaves this
        run's optimizer as it is (the checkpoint's state is another optimizer's: dropped)."""
        folder = Path(folder)
        saved = Layout.of(folder)
        needed = [] if saved.sharded else [self.net_name] + [OPTIMIZER] * optimizer
        if self.ema is not None:
            needed.append(EMA_META if saved.sharded else EMA)
        for name in needed:
            if name not in shared:
                raise RuntimeError(f"checkpoint {folder} has no '{name}' state: it was written with other settings "
                                   "(model.use_ema); resume with those, or start a new run name")
        if saved.sharded:
            param_names(self.net, self.optimizer)  # a trained text encoder has no state there: say so before DCP
            self._load_sharded(folder / SHARDED, optimizer)
            if self.ema is not None:
                self.ema.load_meta_state_dict(shared[EMA_META])
        elif self.strategy.sharded:
            params = dict(self.net.named_parameters())
            optim_sd = (indexed_to_named(shared[OPTIMIZER], param_names(self.net, self.optimizer), params)
                        if optimizer else None)
            self._load_full(shared[self.net_name], optim_sd, shared[EMA]["shadow"] if self.ema is not None else None)
            if self.ema is not None:
                self.ema.load_meta_state_dict(shared[EMA])
        else:
            self.net_state.load_state_dict(shared[self.net_name])
            if optimizer:
                self.optimizer.load_state_dict(shared[OPTIMIZER])
            if self.ema is not None:
                self.ema.load_state_dict(shared[EMA])
        return describe(saved, self.strategy.sharded, world_size, self.ema is not None, optimizer,
                        getattr(self.strategy, "name", None))

    def _load_sharded(self, folder: Path, optimizer: bool = True) -> None:
        """DCP shards, written on any number of ranks, into this run's own layout: each rank's DTensor shards
        under fsdp, the full tensors under ddp (every rank) and in one process (no process group: no
        collective), resharding as it reads."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = self._sharded_state()  # the layout to load into
        if not optimizer:
            del state[DCP_OPTIMIZER]  # DCP loads only the keys asked for
        dcp.load(state, storage_reader=safe_reader(folder), no_dist=not (dist.is_available() and dist.is_initialized()))
        if optimizer:
            set_state_dict(self.net, self.optimizer, model_state_dict=state[DCP_NET],
                           optim_state_dict=state[DCP_OPTIMIZER])
        else:
            set_model_state_dict(self.net, state[DCP_NET])
        if self.ema is not None:
            set_model_state_dict(self.shadow, state[DCP_EMA])

    def _load_full(self, net_sd: dict, optim_sd: dict, ema_sd: dict | None) -> None:
        """fsdp (collective): full tensors that every rank holds (the optimizer state keyed by parameter name)
        into this rank's shards: each rank keeps its slice."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        full = StateDictOptions(full_state_dict=True)
        if optim_sd is None:  # the optimizer state is dropped
            set_model_state_dict(self.net, net_sd, options=full)
        else:
            set_state_dict(self.net, self.optimizer, model_state_dict=net_sd, optim_state_dict=optim_sd, options=full)
        if self.ema is not None:
            set_model_state_dict(self.shadow, ema_sd, options=full)


def shapes_of(module: torch.nn.Module) -> dict[str, tuple]:
    """Every entry of ``module``'s state dict and its (full: DTensors say their global) shape."""
    return {k: tuple(v.shape) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def check_state_shapes(file: Path, sd, expected: dict, what: str = "parameter") -> None:
    """A saved state dict against ``expected`` (:func:`shapes_of` of this run's module): the same names and
    shapes, or :class:`CheckpointDamaged` naming ``file`` and the first entry that differs."""
    if not isinstance(sd, dict):
        raise CheckpointDamaged(file, f"holds a {type(sd).__name__}, not a state dict")
    for key, shape in expected.items():
        if key not in sd:
            raise CheckpointDamaged(file, f"has no {what} '{key}' of this run's model: it was written for another model")
        t = sd[key]
        if not isinstance(t, torch.Tensor):
            raise CheckpointDamaged(file, f"holds a {type(t).__name__} as {what} '{key}', not a tensor")
        if tuple(t.shape) != shape:
            raise CheckpointDamaged(file, f"holds {what} '{key}' of shape {tuple(t.shape)}, this run's model has "
                                          f"{shape}: it was written for another model size")
    extra = [k for k in sd if k not in expected]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointDamaged(file, f"holds '{extra[0]}'{more}, which this run's model has no {what} of: it was "
                                      "written for another model")


# Optimizer state entries shaped like their parameter: AdamW's and Adafactor's moments, SGD's momentum,
# bitsandbytes' 8-bit (or 32-bit) states, Prodigy's s and p0, schedule-free AdamW's z. Others have shapes
# of their own (Adafactor's and CAME's factored row and column moments, bitsandbytes' quantization map and
# block maxima) and are not checked against it.
PARAM_SHAPED_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "state1", "state2",
                                "s", "p0", "z"})


def check_optimizer_shapes(file: Path, osd, optimizer: torch.optim.Optimizer, net: torch.nn.Module) -> None:
    """A plain optimizer state dict (state keyed by parameter index) against this run's optimizer: its
    groups' sizes, and every state tensor's shape against the parameter it belongs to."""
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict) or not isinstance(osd.get("param_groups"), list):
        raise CheckpointDamaged(file, "holds no optimizer state dict ('state' and 'param_groups')")
    groups = osd["param_groups"]
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise CheckpointDamaged(file, "has parameter groups without a 'params' list")
    saved = [len(g["params"]) for g in groups]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if saved != mine:
        raise CheckpointDamaged(file, f"has parameter groups of {saved} parameters, this run's {mine}: it was written for "
                                      "other trained modules, another model or other optimizer.no_decay_norm_and_bias")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_index = dict(zip([i for g in groups for i in g["params"]], params))
    names = {id(p): n for n, p in net.named_parameters()}
    for index, state in osd["state"].items():
        p = by_index.get(index)
        if p is None or not isinstance(state, dict):
            raise CheckpointDamaged(file, f"holds state for parameter {str(index)[:50]!r}, which its groups do not list")
        for key, t in state.items():
            if key in PARAM_SHAPED_STATE and isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(p.shape):
                raise CheckpointDamaged(file, f"holds '{key}' of shape {tuple(t.shape)} for parameter "
                                              f"{names.get(id(p), index)}, whose shape is {tuple(p.shape)} in this run")


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


def describe(saved: Layout, sharded: bool, world_size: int, ema: bool, optimizer: bool = True,
             strategy: str | None = None) -> str | None:
    """The log line of a resume across layouts or rank counts; None when nothing changed. ``strategy``: the
    resuming run's (hsdp is named as such; a sharded checkpoint is called fsdp's, whichever mesh wrote it:
    DCP holds the same global tensors either way)."""
    if saved.sharded == sharded and saved.world_size == world_size:
        return None
    parts = ["model"] + ["optimizer"] * optimizer + ["EMA"] * ema
    what = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
    if saved.sharded:
        how = "resharded by DCP" if sharded else "gathered from DCP shards"
    else:
        how = "sharded from full tensors" if sharded else "loaded as full tensors (nothing to convert)"
    now = Layout(sharded, world_size)
    kind = strategy if sharded and strategy in ("fsdp", "hsdp") else now.kind
    where = "in one process" if world_size == 1 else f"under {kind} on {world_size} ranks"
    article = "an" if saved.sharded else "a"  # "an fsdp", "a ddp", "a one-process"
    ranks = f"{saved.world_size} rank{'s' if saved.world_size != 1 else ''}"
    return f"resumed {article} {saved.kind} checkpoint of {ranks} {where}: {what} {how}"
