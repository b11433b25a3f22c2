"""``model.block_swap``: N of the trained net's blocks live in host memory and stream through the device.

The blocks are the family's repeated blocks in execution order (``Family.swap_units``); the last N of them
are swapped. Each swapped tensor's master copy is a host buffer (pinned when the device is a GPU) made once
and reused every step; the device holds a copy only while the block runs:

- forward: a block's pre-hook makes it ready (waits for its copy) and starts the next swapped block's
  host-to-device copy on a side stream (CUDA streams and events; on another device the same path with
  synchronous copies), so the copy overlaps this block's compute; its forward hook drops the device copy
  (the weights did not change: nothing is copied back).
- backward: gradient checkpointing recomputes each block's forward, whose pre-hook brings the block in
  again, in the reverse order, prefetching the block before it. A block whose swapped tensors are frozen
  (an adapter's base) is dropped when the next one comes in (autograd keeps what the backward still
  reads). A block whose swapped weights train (a full fine-tune, with ``optimizer.in_backward``) stays
  until every one of its parameters has had its gradient and its update; its weights are then copied back
  into the host buffers. The optimizer state of those parameters stays on the device.
- the end of each backward releases whatever is left and waits for the copies back.

At most ``window`` (2) swapped blocks are on the device at once: the one computing and the one arriving.
``moves`` records every move (block, direction, phase, bytes) for tests and the log.

Why the rules (``check_config``): without gradient checkpointing autograd keeps every block's weights for
its backward, so nothing would leave the device; an optimizer step after the backward would need every
swapped weight, gradient and state on the device at once (``optimizer.in_backward`` updates each block
while it is there, as kohya's fused backward pass with ``blocks_to_swap`` does); FSDP already shards the
blocks; DDP broadcasts and reduces parameters that must sit on its one device; CUDA graphs replay fixed
weight addresses; a device EMA of a full fine-tune would hold a device copy of every swapped block.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from ..config import ConfigError

log = logging.getLogger(__name__)

WINDOW = 2  # swapped blocks on the device at once: the one computing and the one arriving
FORWARD, BACKWARD = "forward", "backward"
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass
class Move:
    block: int  # index into the swap's blocks
    direction: str  # "in" (host to device) or "out" (device copy dropped; bytes > 0: copied back to the host)
    phase: str  # FORWARD or BACKWARD
    bytes: int


@dataclass
class _Slot:
    """One swapped block: its swapped tensors (parameters and buffers whose ``.data`` moves), their host
    buffers, the device copies while resident."""

    index: int
    module: torch.nn.Module
    owners: list[torch.Tensor]
    hosts: list[torch.Tensor]
    trained: list[torch.nn.Parameter]  # swapped parameters that train (their updates are copied back)
    device_data: list[torch.Tensor] | None = None
    event: object = None  # the copy in flight (CUDA)
    active: bool = False  # its device copies are what its tensors point at
    pending: int = 0  # trained parameters still waiting for their gradient in this backward
    nbytes: int = field(default=0)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class BlockSwap:
    """Streams ``blocks[len(blocks) - swapped:]`` through ``device`` from ``host`` (see the module).
    ``swap_trained``: also swap parameters that train (a full fine-tune); False: they stay on the device
    (an adapter's weights), only the frozen ones swap."""

    def __init__(self, blocks: list[torch.nn.Module], swapped: int, device: torch.device,
                 host: torch.device = torch.device("cpu"), swap_trained: bool = True, window: int = WINDOW):
        if not 0 < swapped <= len(blocks):
            raise ConfigError(f"'model.block_swap' is {swapped}, but the net has {len(blocks)} blocks to swap")
        self.blocks, self.device, self.host, self.window = list(blocks), device, host, window
        self.first = len(blocks) - swapped
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.optimizer = None  # follow_optimizer: state created on the host by a resume goes to the device
        self.moves: list[Move] = []
        self.max_resident = 0
        self._released_in_backward: list[_Slot] = []
        self._callback_queued = False
        self._wrote_back = False
        self.slots = [self._make_slot(i, b, swap_trained) for i, b in enumerate(self.blocks) if i >= self.first]
        self.handles = []
        for index, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(_hook(self._pre, index)))
        for slot in self.slots:
            self.handles.append(slot.module.register_forward_hook(_hook(self._post, slot.index)))
            for p in slot.trained:
                self.handles.append(p.register_post_accumulate_grad_hook(_hook(self._grad_in, slot.index)))
        log.info("model.block_swap: %d of %d blocks (%.1f MiB) live in host memory and stream through %s",
                 swapped, len(blocks), sum(s.nbytes for s in self.slots) / 2**20, device)

    # ------------------------------------------------------------------ set-up
    def _make_slot(self, index: int, block: torch.nn.Module, swap_trained: bool) -> _Slot:
        owners = [p for p in block.parameters() if swap_trained or not p.requires_grad]
        owners += [b for b in block.buffers()]  # (constants: diffusion blocks update no buffer in forward)
        odd = next((t for t in owners if type(t) not in (torch.Tensor, torch.nn.Parameter)
                    or type(t.data) is not torch.Tensor), None)
        if odd is not None:  # a quantised layer's packed weight and its scales move together or not at all
            raise ConfigError(f"'model.block_swap' cannot move the {type(odd).__name__} weights of block {index} "
                              f"({type(block).__name__}): only plain tensors swap (a quantised base does not)")
        hosts = []
        with torch.no_grad():
            for t in owners:
                host = alike(t, self.host, pin=self.cuda)
                host.copy_(t)
                t.data = host  # the master copy from now on; the device copy it had is freed
                hosts.append(host)
        trained = [p for p in owners if isinstance(p, torch.nn.Parameter) and p.requires_grad]
        nbytes = sum(h.numel() * h.element_size() for h in hosts)
        return _Slot(index, block, owners, hosts, trained, nbytes=nbytes)

    def move_rest(self, net: torch.nn.Module) -> None:
        """Every tensor of ``net`` the swap does not own onto the device (the families build the net in host
        memory when it swaps: the whole net never sits on the device at load)."""
        owned = {id(t) for s in self.slots for t in s.owners}
        with torch.no_grad():
            for t in [*net.parameters(), *net.buffers()]:
                if id(t) not in owned and t.device != self.device:
                    t.data = t.data.to(self.device)

    def follow_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer whose state of the swapped trained parameters must sit on the device when they
        update (a loaded state is put where each parameter is: the host, for a swapped one)."""
        self.optimizer = optimizer

    def slot(self, index: int) -> _Slot | None:
        return self.slots[index - self.first] if index >= self.first else None

    @property
    def resident(self) -> int:
        return sum(s.device_data is not None for s in self.slots)

    # ------------------------------------------------------------------ hooks
    def _pre(self, index: int) -> None:
        backward = _in_backward()
        if backward:
            self._queue_end_of_backward()
            self._release_done(keep=index)
        slot = self.slot(index)
        if slot is not None:
            self._bring_in(slot, BACKWARD if backward else FORWARD)
            self._activate(slot)
            if backward and slot.trained and slot.pending == 0:
                slot.pending = len(slot.trained)
        step = -1 if backward else 1
        ahead = next((i for i in range(index + step, len(self.blocks) if step > 0 else self.first - 1, step)
                      if i >= self.first), None)
        if ahead is not None and self.resident < self.window:
            self._bring_in(self.slot(ahead), BACKWARD if backward else FORWARD)

    def _post(self, index: int) -> None:
        slot = self.slot(index)
        if not _in_backward():
            self._release(slot, FORWARD)  # the forward does not change weights: nothing to copy back
        # In backward (a recompute, which may also stop early without this hook) the next block's pre-hook,
        # the block's last gradient or the end of the backward releases it.

    def _grad_in(self, index: int) -> None:
        slot = self.slot(index)
        if not slot.active:  # its update would run on the host copy, or fail on mixed devices
            raise RuntimeError(f"model.block_swap: a parameter of swapped block {index} ({type(slot.module).__name__}) "
                               "got its gradient while the block was in host memory: gradient checkpointing does not "
                               "recompute that block whole (Family.swap_units must name only such blocks)")
        slot.pending -= 1
        if slot.pending == 0:  # its update runs in the hooks after this one: copied back at the next event
            self._released_in_backward.append(slot)

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._release_done(keep=None)
        for slot in self.slots:
            if slot.device_data is not None:
                self._release(slot, BACKWARD, write_back=bool(slot.trained) and slot.active)
        if self.cuda and self._wrote_back:  # the host buffers are read on the host next (EMA, checkpoints)
            self.stream.synchronize()
        self._wrote_back = False

    def _release_done(self, keep: int | None) -> None:
        """Backward: the blocks whose gradients are all in, and the active blocks with nothing training."""
        done, self._released_in_backward = self._released_in_backward, []
        for slot in done:
            self._release(slot, BACKWARD, write_back=True)
        for slot in self.slots:
            if slot.active and slot.index != keep and not slot.trained:
                self._release(slot, BACKWARD)

    # ------------------------------------------------------------------ moves
    def _stream(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _bring_in(self, slot: _Slot, phase: str) -> None:
        if slot.device_data is not None:
            return
        self._make_room()
        with self._stream():
            slot.device_data = [alike(h, self.device).copy_(h, non_blocking=True) for h in slot.hosts]
            if self.cuda:
                slot.event = torch.cuda.Event()
                slot.event.record(self.stream)
        self.moves.append(Move(slot.index, "in", phase, slot.nbytes))
        self.max_resident = max(self.max_resident, self.resident)

    def _make_room(self) -> None:
        """A block needed now while the window is full of prefetched blocks not used (a wrong guess of the
        order): they are dropped (nothing to copy back)."""
        for slot in self.slots:
            if self.resident < self.window:
                return
            if slot.device_data is not None and not slot.active:
                self._drop(slot)

    def _activate(self, slot: _Slot) -> None:
        if slot.active:
            return
        if slot.event is not None:  # compute waits for the copy; the allocator for the compute to end
            current = torch.cuda.current_stream(self.device)
            current.wait_event(slot.event)
            for t in slot.device_data:
                t.record_stream(current)
            slot.event = None
        for owner, data in zip(slot.owners, slot.device_data):
            owner.data = data
        slot.active = True
        self._state_to_device(slot)

    def _release(self, slot: _Slot, phase: str, write_back: bool = False) -> None:
        if slot.device_data is None:
            return
        written = 0
        if write_back and slot.active and slot.trained:
            trained = {id(p) for p in slot.trained}
            with self._stream():
                if self.cuda:
                    self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the updates are done
                for owner, host, data in zip(slot.owners, slot.hosts, slot.device_data):
                    if id(owner) in trained:
                        host.copy_(data, non_blocking=True)
                        written += host.numel() * host.element_size()
                        if self.cuda:
                            data.record_stream(self.stream)
            self._wrote_back = True
        self.moves.append(Move(slot.index, "out", phase, written))
        self._drop(slot)

    def _drop(self, slot: _Slot) -> None:
        for owner, host in zip(slot.owners, slot.hosts):
            owner.data = host
        slot.device_data, slot.event, slot.active, slot.pending = None, None, False, 0

    def _state_to_device(self, slot: _Slot) -> None:
        """A loaded optimizer state of a swapped parameter was put on the host (where the parameter was at
        load): its tensors go to the device before the update (a CPU step count stays, as torch keeps it)."""
        if self.optimizer is None or not slot.trained:
            return
        fused = any(g.get("fused") or g.get("capturable") for g in self.optimizer.param_groups)
        for p in slot.trained:
            state = self.optimizer.state.get(p)
            for key, value in (state or {}).items():
                if torch.is_tensor(value) and value.device.type != self.device.type and (value.dim() or fused):
                    state[key] = value.to(self.device)

    def remove(self) -> None:
        """Hooks removed and every block's tensors back on the device (tests)."""
        for h in self.handles:
            h.remove()
        for slot in self.slots:
            self._drop(slot)
            for owner, host in zip(slot.owners, slot.hosts):
                owner.data = host.to(self.device)


def alike(t: torch.Tensor, device: torch.device, pin: bool = False) -> torch.Tensor:
    """An empty tensor with ``t``'s shape, strides (a channels-last weight stays so) and dtype on ``device``,
    at ``t``'s offset from a 64-byte boundary: CPU kernels choose their vector paths by the weights' alignment
    (loaded weights sit at any offset in the file's buffer), so the results stay bit-identical to those of the
    weights where they were. (A GPU's weights start on the allocator's boundary: offset 0, a plain tensor.)"""
    size = t.element_size()
    span = (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * size if t.numel() else 0
    raw = torch.empty(span + 64, dtype=torch.uint8, device=device, pin_memory=pin)
    start = (t.data_ptr() - raw.data_ptr()) % 64
    start -= start % size  # (a weight off its own dtype's alignment: the nearest aligned start before)
    return raw[start:start + span].view(t.dtype).as_strided(t.shape, t.stride())


def _hook(method, index: int):
    """A hook calling ``method(index)``, run eagerly under per-block compile (a graph break: it moves
    tensors and records stream events, which a graph cannot hold). Copies of the net keep it: one that shares
    the swapped tensors (an adapter's EMA applied to the net for exports and samples) needs them brought in."""

    @torch.compiler.disable
    def hook(*_args):
        method(index)

    return hook


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class SwapPlan:
    """Parameter counts for the memory plan (weights only: gradients are freed in the backward, the
    optimizer state stays on the device): ``swapped`` live in host memory, ``in_flight`` are on the device
    at the worst moment (the two largest swapped blocks). The device saves ``swapped - in_flight``."""

    swapped: int
    in_flight: int
    blocks: int  # the net's blocks that can swap


def plan(units: list[torch.nn.Module], swapped: int, swap_trained: bool = True) -> SwapPlan:
    """The swap's counts for ``units`` (``Family.swap_units``, on the meta device too), the last ``swapped``
    of them swapped; ``swap_trained`` False: an adapter's run, whose trained parameters stay."""
    sizes = [sum(p.numel() for p in u.parameters() if swap_trained or not p.requires_grad)
             for u in units[len(units) - swapped:]] if swapped else []
    return SwapPlan(sum(sizes), sum(sorted(sizes)[-WINDOW:]), len(units))


# ---------------------------------------------------------------------------------------------- the config
def check_config(cfg) -> None:
    """What ``model.block_swap`` cannot work with, refused at config load with the reason (the block count
    and the rank count: :func:`install`, at start-up)."""
    m, n = cfg.model, cfg.model.block_swap
    if not n:
        return
    adapter = bool(getattr(getattr(m, "adapter", None), "enabled", False))
    why = None
    if cfg.distributed.strategy in ("fsdp", "hsdp"):
        why = (f"distributed.strategy={cfg.distributed.strategy}: FSDP already shards the blocks over the ranks (and "
               "can keep its shards in host memory itself). Use one or the other")
    elif not m.gradient_checkpointing:
        why = ("model.gradient_checkpointing=false: autograd would keep every block's device weights for its "
               "backward, so nothing would leave the device. Set model.gradient_checkpointing=true")
    elif m.train_target != "unet":
        why = f"model.train_target={m.train_target}: only the diffusion net's blocks swap"
    elif not adapter and not cfg.optimizer.in_backward:
        why = ("a full fine-tune without optimizer.in_backward: the optimizer step after the backward would need "
               "every swapped block's weights and gradients on the device at once. Set optimizer.in_backward=true "
               "(each block is updated in the backward while it is on the device), or train an adapter")
    elif not adapter and m.use_ema and m.ema.device != "cpu":
        why = ("an EMA on the device in a full fine-tune: it would hold a device copy of every swapped block. Set "
               "model.ema.device=cpu")
    elif adapter and m.adapter.export_merged:
        why = ("model.adapter.export_merged: the merged copy is the whole net in fp32 on one device, and the swapped "
               "blocks' base lives in host memory. Set it to false and merge the exported LoRA where the full "
               "model fits")
    elif m.compile and m.compile_mode in CUDA_GRAPH_MODES:
        why = (f"model.compile_mode={m.compile_mode}: CUDA graphs replay fixed weight addresses, and a swapped "
               "block's device copy is new every step. Use compile_mode default or max-autotune-no-cudagraphs")
    if why:
        raise ConfigError(f"'model.block_swap' cannot work with {why}")


def install(cfg, family, net: torch.nn.Module, device: torch.device, world_size: int,
            strategy: str) -> BlockSwap | None:
    """The run's swap (``model.block_swap`` > 0) over ``family.swap_units(net)``; what only start-up knows
    is checked here: the block count and the wrapper (``strategy``: ``Strategy.name``, ``single`` for one
    process without a process group)."""
    n = cfg.model.block_swap
    if not n:
        return None
    if strategy == "ddp":  # (torchrun with one rank wraps too)
        raise ConfigError(f"'model.block_swap' cannot work with distributed.strategy=ddp on {world_size} rank(s) "
                          "under torchrun: DDP broadcasts every parameter from rank 0 and reduces gradients in "
                          "buckets that need its parameters on its one device (and a full fine-tune's "
                          "optimizer.in_backward cannot run under DDP on several ranks). Train one process with "
                          "plain python train.py, or use distributed.strategy=fsdp instead of model.block_swap")
    units = family.swap_units(net)
    if not units:
        raise ConfigError(f"'model.block_swap' needs repeated blocks, and the {family.net_name} of this family has "
                          "none it can swap: set model.block_swap=0")
    if n > len(units):
        raise ConfigError(f"'model.block_swap' is {n}, but the {family.net_name} has {len(units)} blocks that can "
                          f"swap: set it to at most {len(units)}")
    adapter = bool(getattr(getattr(cfg.model, "adapter", None), "enabled", False))
    swap = BlockSwap(units, n, device, swap_trained=not adapter)
    swap.move_rest(net)
    return swap
