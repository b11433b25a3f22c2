"""Data-parallel strategies for the trained module: DDP (replicated), FSDP2 (``fully_shard`` per unit the
model family names, over all ranks) or HSDP (the same units on a 2-D mesh: sharded inside a group of
``distributed.hsdp_shard_size`` ranks, one node by default, replicated across the groups).

Only the trained module (and its EMA copy) is ever wrapped; frozen components stay plain modules.
Under ``ddp`` every rank holds the full weights; under ``fsdp`` each rank holds 1/world of them, under
``hsdp`` 1/shard_size (each group holds a full copy: the weights are gathered and the gradients
reduce-scattered inside the group, and each shard's gradient is all-reduced across the groups, the only
traffic between nodes). Exports gather the full weights (:meth:`Strategy.plain_copy`). How each is saved
and resumed (full tensors or DCP shards, resharded as read, whatever mesh wrote them) is
``checkpoint.model_state``'s.

hsdp with a single shard group (the shard size is the rank count: one node) is fsdp, and runs as fsdp (a
log line says so): the same sharding, without a replicate dimension of size 1.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameter), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class Strategy:
    def __init__(self, name: str, has_group: bool, device: torch.device, param_dtype: torch.dtype | None,
                 dist_cfg=None, info=None):
        # One process without a process group: neither wrapper does anything useful, so both run the plain
        # module. FSDP2 on one rank (its CPU offload for one GPU) runs in a process group of one.
        self.name = name if has_group else "single"
        self.device = device
        self.param_dtype = param_dtype
        self.cfg = dist_cfg
        self.mesh = None  # hsdp: the 2-D DeviceMesh ("replicate", "shard"), built by wrap (collective)
        world = info.world_size if info is not None else 1
        self.shard_size = world  # ranks one copy of the weights is sharded over (fsdp: all)
        if self.name == "hsdp":
            from . import hsdp_shard_size

            configured = dist_cfg.hsdp_shard_size if dist_cfg is not None else 0
            self.shard_size = hsdp_shard_size(configured, world, info.local_world_size if info is not None else 1)
            if self.shard_size == world:
                log.info("distributed.strategy=hsdp with one shard group of all %d rank(s) (distributed."
                         "hsdp_shard_size=%d%s): nothing to replicate, so it runs as fsdp", world, configured,
                         "" if configured else ": the ranks of one node")
                self.name = "fsdp"
        self.replicas = world // self.shard_size if self.sharded else world

    @property
    def sharded(self) -> bool:
        return self.name in ("fsdp", "hsdp")

    @property
    def cpu_offload(self) -> bool:
        return self.sharded and self.cfg is not None and bool(self.cfg.fsdp_cpu_offload)

    @property
    def plan_name(self) -> str:
        """The strategy's row in the memory plan (one process counts as ddp: the full state on one GPU)."""
        return "fsdp_offload" if self.cpu_offload else (self.name if self.sharded else "ddp")

    @property
    def optimizer_device(self) -> torch.device:
        """Where the optimizer's state and step live: the CPU when FSDP offloads the shards there."""
        return torch.device("cpu") if self.cpu_offload else self.device

    def wrap(self, net: torch.nn.Module, ema_shadow: torch.nn.Module | None,
             shard_units: Callable[[torch.nn.Module, str], list[torch.nn.Module]] | None = None,
             shadow_units: bool = True) -> torch.nn.Module:
        """Returns the module to call in the forward pass. ``shard_units(module, distributed.fsdp_unit)``:
        the submodules FSDP2 shards separately, innermost first (the model family knows its layout).
        ``shadow_units``: the EMA shadow is a copy of the net, sharded by the same units; else (an EMA of
        some parameters only) one unit. Either way each parameter is split on dim 0 as the net's is."""
        self.module_cls = type(net)  # FSDP2 swaps the class of a module it shards
        c = self.cfg
        bf16_reduce = c is not None and c.grad_reduce_dtype == "bf16"
        if self.name == "ddp":
            ids = [self.device.index] if self.device.type == "cuda" else None
            # Frozen weights stored by a quantisation library (model.adapter.base_quantization: bitsandbytes'
            # parameters, torchao's tensor subclasses) are not broadcast at wrapping: every rank quantised or
            # reloaded the same base, and the packed bytes cannot be broadcast without their statistics.
            quantized = [n for n, p in net.named_parameters()
                         if not p.requires_grad and type(p) is not torch.nn.Parameter]
            if quantized:
                torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, quantized)
            # Gradients live in the all-reduce buckets (no second copy); the bucket size and static graph
            # are the user's (distributed.bucket_cap_mb, distributed.static_graph).
            ddp = torch.nn.parallel.DistributedDataParallel(
                net, device_ids=ids, gradient_as_bucket_view=True,
                bucket_cap_mb=c.bucket_cap_mb if c is not None else 25.0,
                static_graph=bool(c is not None and c.static_graph),
            )
            if bf16_reduce:  # half the traffic: buckets are cast to bf16 for the all-reduce, back to fp32 after
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
            return ddp
        if self.sharded:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

            # Parameters are gathered in the compute dtype; gradients reduced in fp32 (or bf16).
            mp = MixedPrecisionPolicy(param_dtype=self.param_dtype,
                                      reduce_dtype=torch.bfloat16 if bf16_reduce else torch.float32)
            kw = dict(mp_policy=mp, reshard_after_forward=bool(c.reshard_after_forward) if c is not None else True)
            if self.name == "hsdp":  # FSDP2 on a 2-D mesh: Shard(0) inside a group, Replicate across groups
                if self.mesh is None:
                    from . import hsdp_mesh

                    self.mesh = hsdp_mesh(self.device.type, self.replicas * self.shard_size, self.shard_size)
                    log.info("hsdp: %d replica(s) x %d-rank shard groups (distributed.hsdp_shard_size)",
                             self.replicas, self.shard_size)
                kw["mesh"] = self.mesh
            if self.cpu_offload:  # shards in pinned CPU memory, each unit copied in for its compute
                kw["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
            level = c.fsdp_unit if c is not None else "layer"
            for module in [net] + ([ema_shadow] if ema_shadow is not None else []):
                units = shard_units is not None and (module is net or shadow_units)
                for unit in (shard_units(module, level) if units else []):
                    fully_shard(unit, **kw)
                fully_shard(module, **kw)
            return net
        return net

    def sync_context(self, model: torch.nn.Module, sync: bool):
        """Skip the gradient all-reduce on micro-batches that are not the last of an accumulation."""
        if self.name == "ddp" and not sync:
            return model.no_sync()
        if self.sharded:  # hsdp: neither the reduce-scatter in the group nor the all-reduce across groups
            model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def plain_copy(self, module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """An unsharded module with the full weights on every rank, for export, samples and eval images.

        DDP: the module itself. FSDP and HSDP (collective, every rank calls it): the shards are all-gathered into
        full tensors on ``device`` and assigned to a module built on the meta device (no random init,
        no second CPU copy). Every rank holds the full weights for as long as the copy lives, as DDP
        does all the time, so eval images are split across all ranks instead of waiting on rank 0."""
        if not self.sharded:
            return module
        sd = self.full_state_dict(module)
        with torch.device("meta"):
            plain = self.module_cls.from_config(module.config)
            for name, config in getattr(module, "peft_config", {}).items():  # model.adapter: the same adapters
                plain.add_adapter(config, adapter_name=name)
        plain.load_state_dict({k: v.to(device) for k, v in sd.items()}, assign=True)
        leftover = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
        if leftover:  # a buffer the state dict does not hold (non-persistent): build it the slow way
            plain = self.module_cls.from_config(module.config)
            for name, config in getattr(module, "peft_config", {}).items():
                plain.add_adapter(config, adapter_name=name)
            plain.load_state_dict(sd)
        return plain.to(device).eval().requires_grad_(False)

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s state dict with full tensors (FSDP, HSDP: all-gathered, collective; on the shards' device)."""
        if not self.sharded:
            return module.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
