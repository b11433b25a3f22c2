"""Bytes the collectives move, counted from the real process groups, and the ring model of the bytes per
optimizer step under ddp, fsdp and hsdp (what ``benchmarks/bench_scaling.py`` scales to 8-512 GPUs).

Counting (:class:`TrafficCounter`): while the counter is entered, the Python-level collectives of
``torch.distributed`` (``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``, ``broadcast`` and
their older spellings) are wrapped: each call adds its payload to its process group's row, then runs the real
collective. That is what FSDP2 calls (its all-gathers and reduce-scatters, HSDP's all-reduce over the
replicate group) on any backend (gloo, NCCL). DDP's Reducer all-reduces its buckets in C++ unless a comm
hook is registered: :func:`count_ddp` registers the default all-reduce hook (the same arithmetic, in
Python) when none is. Not counted: DTensor's functional collectives (``torch.ops._c10d_functional``: a
scalar in a gradient-norm clip) and C++-only paths (DDP's buffer broadcast, coalesced broadcasts).

Payload: the bytes of the full tensor a collective works on (an all-gather's output, a reduce-scatter's
input, an all-reduce's tensor). Per-rank wire bytes of a ring: all-reduce 2(n-1)/n x payload, all-gather and
reduce-scatter (n-1)/n x payload, broadcast (n-1)/n x payload.

The model (:func:`predicted`): from a module's parameters and the FSDP units the family names, the payloads
per process group one optimizer step (one micro-batch) moves: ddp all-reduces every trained parameter's
gradient; fsdp all-gathers each unit's padded parameters in the compute dtype in the forward and again in the
backward (``reshard_after_forward``) and reduce-scatters the trained ones' gradients in the reduce dtype;
hsdp does fsdp's inside the shard group and all-reduces each rank's gradient shard over the replicate group.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist

# name -> (the argument that holds the payload, the ring kind)
COLLECTIVES: dict[str, tuple[str, str]] = {
    "all_reduce": ("tensor", "all_reduce"),
    "all_reduce_coalesced": ("tensors", "all_reduce"),
    "all_gather_single": ("output_tensor", "all_gather"),
    "all_gather_into_tensor": ("output_tensor", "all_gather"),
    "_all_gather_base": ("output_tensor", "all_gather"),
    "all_gather": ("tensor_list", "all_gather"),
    "reduce_scatter_single": ("input", "reduce_scatter"),
    "reduce_scatter_tensor": ("input", "reduce_scatter"),
    "_reduce_scatter_base": ("input", "reduce_scatter"),
    "reduce_scatter": ("input_list", "reduce_scatter"),
    "broadcast": ("tensor", "broadcast"),
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def ring_factor(kind: str, n: int) -> float:
    """Bytes each rank sends per payload byte in a ring of ``n`` ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)  # a list of tensors


class TrafficCounter:
    """``with TrafficCounter(labels) as c: ...``: counts every collective issued inside, per process group.

    ``labels``: process group name -> a label (e.g. a device mesh's dim names: :func:`mesh_labels`); the
    default group is ``world``, others their ranks (``ranks 0,1``). ``c.rows()`` gives one row per
    (group, kind): calls, payload bytes, ring bytes sent per rank; ``c.reset()`` starts a new count (a step)."""

    _active = 0  # one counter at a time: the wrappers are module-wide

    def __init__(self, labels: dict[str, str] | None = None):
        self.labels = dict(labels or {})
        self._lock = threading.Lock()
        self._depth = threading.local()  # a collective that calls another (all_gather_into_tensor) counts once
        self._saved: list[tuple[object, str, object]] = []
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.counts: dict[tuple[str, str], dict] = defaultdict(lambda: dict(calls=0, bytes=0, wire_bytes=0.0,
                                                                                group_size=0))

    def label(self, group) -> tuple[str, int]:
        pg = group if group is not None else dist.group.WORLD
        name = pg.group_name
        if name in self.labels:
            return self.labels[name], pg.size()
        if pg is dist.group.WORLD or name == dist.group.WORLD.group_name:
            return "world", pg.size()
        return "ranks " + ",".join(map(str, dist.get_process_group_ranks(pg))), pg.size()

    def add(self, kind: str, group, nbytes: int) -> None:
        label, n = self.label(group)
        with self._lock:
            row = self.counts[(label, kind)]
            row["calls"] += 1
            row["bytes"] += nbytes
            row["wire_bytes"] += ring_factor(kind, n) * nbytes
            row["group_size"] = n

    def _wrap(self, name: str, fn):
        arg, kind = COLLECTIVES[name]
        sig = inspect.signature(fn)
        if arg not in sig.parameters or "group" not in sig.parameters:
            raise RuntimeError(f"torch.distributed.{name} has no '{arg}' / 'group' argument in torch "
                               f"{torch.__version__}: traffic.COLLECTIVES needs updating")
        counter = self

        def counted(*args, **kwargs):
            depth = getattr(counter._depth, "n", 0)
            if depth == 0:
                bound = sig.bind(*args, **kwargs)
                counter.add(kind, bound.arguments.get("group"), _nbytes(bound.arguments[arg]))
            counter._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth.n = depth

        counted.__wrapped__ = fn
        return counted

    def __enter__(self) -> TrafficCounter:
        if TrafficCounter._active:
            raise RuntimeError("a TrafficCounter is already counting (one at a time)")
        TrafficCounter._active += 1
        c10d = dist.distributed_c10d
        try:
            for name in COLLECTIVES:
                original = getattr(c10d, name, None)
                if original is None:
                    continue
                wrapped = self._wrap(name, original)
                for module in (dist, c10d):  # FSDP calls dist.X; c10d's functions call each other through c10d
                    if getattr(module, name, None) is original:
                        self._saved.append((module, name, original))
                        setattr(module, name, wrapped)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
        TrafficCounter._active -= 1

    def rows(self) -> dict[str, dict[str, dict]]:
        """{group label: {kind: {calls, bytes, wire_bytes, group_size}}}."""
        out: dict[str, dict[str, dict]] = {}
        with self._lock:
            for (label, kind), row in sorted(self.counts.items()):
                out.setdefault(label, {})[kind] = dict(row)
        return out


def mesh_labels(mesh) -> dict[str, str]:
    """Process group name -> mesh dim name ("replicate", "shard") of this rank's groups in a device mesh."""
    return {mesh.get_group(name).group_name: name for name in (mesh.mesh_dim_names or ())}


def count_ddp(ddp_module) -> None:
    """Route a DDP module's bucket all-reduces through Python so a :class:`TrafficCounter` sees them: the
    default all-reduce hook (divide by the world size, all-reduce the sum: the Reducer's own arithmetic) when
    no hook is registered (a registered one, e.g. ``grad_reduce_dtype: bf16``'s compression, calls
    ``dist.all_reduce`` itself)."""
    if getattr(ddp_module, "_comm_hooks", None):
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp_module.register_comm_hook(None, default_hooks.allreduce_hook)


# ----------------------------------------------------------------------------------------------
# The model: payload bytes per optimizer step from the parameters.
# ----------------------------------------------------------------------------------------------


def unit_params(net: torch.nn.Module, units: Iterable[torch.nn.Module]) -> list[list[torch.nn.Parameter]]:
    """The parameters of each FSDP unit (innermost first, as ``shard_units`` lists them), then the root's
    (what no unit holds): FSDP2 gives a parameter to the innermost ``fully_shard`` module that holds it."""
    seen: set[int] = set()
    groups = []
    for unit in units:
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        groups.append(own)
    groups.append([p for p in net.parameters() if id(p) not in seen])
    return [g for g in groups if g]


def padded_numel(shape: torch.Size | tuple, n: int) -> int:
    """Elements FSDP2 gathers for a parameter sharded over ``n`` ranks (dim 0 padded to a multiple of n)."""
    shape = tuple(shape) or (1,)
    return math.ceil(shape[0] / n) * n * math.prod(shape[1:])


def predicted(strategy: str, groups: list[list[torch.nn.Parameter]], world: int, shard: int | None = None,
              param_bytes: int = 4, reduce_bytes: int = 4, grad_bytes: int = 4,
              reshard_after_forward: bool = True) -> dict[str, dict[str, dict]]:
    """Payloads per process group one optimizer step moves (same rows as :meth:`TrafficCounter.rows`).

    ``groups``: :func:`unit_params`; ``param_bytes``: the gathered (compute) dtype's size; ``reduce_bytes``:
    FSDP's reduce dtype; ``grad_bytes``: what DDP all-reduces (4: fp32 buckets, 2: the bf16 hook)."""
    rows: dict[str, dict[str, dict]] = {}

    def add(label: str, kind: str, calls: int | None, nbytes: int, n: int) -> None:
        if n > 1 and nbytes:
            rows.setdefault(label, {})[kind] = dict(calls=calls, bytes=nbytes, wire_bytes=ring_factor(kind, n) * nbytes,
                                                    group_size=n)

    if strategy == "ddp":  # calls: DDP's buckets (bucket_cap_mb), not modelled
        trained = sum(p.numel() for g in groups for p in g if p.requires_grad)
        add("world", "all_reduce", None, trained * grad_bytes, world)
        return rows
    if strategy not in ("fsdp", "hsdp"):
        raise ValueError(f"strategy {strategy!r}: ddp, fsdp or hsdp")
    n = world if strategy == "fsdp" else (shard or world)
    label = "world" if strategy == "fsdp" else "shard"
    gathers = 2 if reshard_after_forward else 1
    ag = sum(padded_numel(p.shape, n) for g in groups for p in g) * param_bytes
    rs_groups = [[p for p in g if p.requires_grad] for g in groups]
    rs = sum(padded_numel(p.shape, n) for g in rs_groups for p in g) * reduce_bytes
    n_rs = sum(1 for g in rs_groups if g)
    add(label, "all_gather", gathers * len(groups), gathers * ag, n)
    add(label, "reduce_scatter", n_rs, rs, n)
    if strategy == "hsdp":
        add("replicate", "all_reduce", n_rs, rs // n, world // n)
    return rows


def link_bytes(strategy: str, params: int, n: int, gpus_per_node: int, param_bytes: int = 2, reduce_bytes: int = 4,
               grad_bytes: int = 4) -> dict[str, float]:
    """Bytes each GPU sends per optimizer step over NVLink (inside a node) and the network (across nodes): the
    ring volumes of :func:`predicted` for ``params`` parameters (no padding, every unit gathered twice) on ``n``
    GPUs, ``gpus_per_node`` to a node. A ring over ranks of several nodes runs at its slowest link, the network.

    ddp: 2(n-1)/n x the gradients; fsdp: (n-1)/n x (the forward's and the backward's all-gathers + the
    reduce-scatter); hsdp: fsdp's inside a node's group, then 2(r-1)/r x its gradient shard across r nodes."""
    local = n <= gpus_per_node
    out = {"nvlink": 0.0, "network": 0.0}
    if strategy == "ddp":
        out["nvlink" if local else "network"] = ring_factor("all_reduce", n) * params * grad_bytes
    elif strategy == "fsdp":
        out["nvlink" if local else "network"] = ring_factor("all_gather", n) * params * (2 * param_bytes + reduce_bytes)
    elif strategy == "hsdp":
        s = min(n, gpus_per_node)
        r = n // s
        out["nvlink"] = ring_factor("all_gather", s) * params * (2 * param_bytes + reduce_bytes)
        out["network"] = ring_factor("all_reduce", r) * params / s * reduce_bytes
    else:
        raise ValueError(f"strategy {strategy!r}: ddp, fsdp or hsdp")
    return out


def traffic_seconds(strategy: str, params: int, n: int, nvlink_gbps: float = 450.0, internode_gbps: float = 50.0,
                    gpus_per_node: int = 8, **dtypes) -> dict[str, float]:
    """Seconds per optimizer step each link is busy (:func:`link_bytes` / its GB/s per GPU) and their sum (the
    two links' collectives taken as serial: hsdp's all-reduce waits for its group's reduce-scatter)."""
    b = link_bytes(strategy, params, n, gpus_per_node, **dtypes)
    out = {"nvlink": b["nvlink"] / (nvlink_gbps * 1e9), "network": b["network"] / (internode_gbps * 1e9)}
    out["total"] = out["nvlink"] + out["network"]
    return out
