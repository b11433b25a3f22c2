"""What the Trainer is made of, built from the config: the model parts (the family's components, the
EMA, the precision, the strategy's wrapper) and the optimizer parts (parameter groups, trained encoders,
the optimizer and its LR schedule). Every input is an argument; nothing here trains or saves."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch

from . import adapters
from .speed import compile_cache
from .speed import block_swap, fp8
from .checkpoint import init_weights_from, load_weights_checked
from .config.schema import SHARDED_STRATEGIES, TrainConfig
from .distributed import DistInfo
from .ema import EMA, decay_from_strength
from .families import registry
from .families.base import Family
from .families.components import quantized_base_store
from .memory.fit import check_plan, micro_batch_activations
from .memory.plan import as_dicts, format_plan, memory_plan, module_bytes
from .optim import build_lr_scheduler, build_optimizer, check_in_backward, lr_scale, param_groups
from .distributed.strategy import Strategy
from .speed.precision import autocast_dtype
from .run.run_dir import RunDir
from .run.train_state import Plan, seed_everything

log = logging.getLogger("sd_training.loop")


@dataclass
class ModelParts:
    family: Family
    net: torch.nn.Module  # the trained module, bare (no DDP / FSDP / compile wrapper): its weights are read here
    ema: EMA | None
    strategy: Strategy
    model: torch.nn.Module  # what the step calls: the family's loss module, wrapped (and compiled)
    autocast_dtype: torch.dtype | None  # None: fp32
    scaler: torch.amp.GradScaler  # enabled under fp16 only
    swap: block_swap.BlockSwap | None = None  # model.block_swap: the blocks streamed from host memory


@dataclass
class OptimizerParts:
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    encoders: dict[str, torch.nn.Module]  # trained with the net (a text encoder), by checkpoint name; bare
    encoder_models: dict[str, torch.nn.Module]  # the same as the step calls them (DDP on several ranks)
    device_side_skip: bool  # a fused optimizer takes the non-finite flag as a device tensor (no host sync)


def build_model(cfg: TrainConfig, info: DistInfo, plan: Plan, run_dir: RunDir) -> ModelParts:
    """The family's components (seeded), init_from, the EMA, the precision and the strategy's wrapper."""
    device = info.device
    # Per-rank seed: different noise and timesteps on every rank, reproducible across restarts. Seeded
    # after the generated inputs (cli: quickstart.prepare), which must not move the training RNG.
    seed_everything(cfg.system.seed + info.rank)
    family = registry.create(cfg, device, cfg.system.seed, info.is_main)
    if info.is_main:  # the run folder says where its components came from
        sources = family.component_sources()
        run_dir.sources.write_text(json.dumps(sources, indent=1) + "\n")
        for name, entry in sources.items():
            if "provenance" in entry:
                log.info("%s from %s: %s", name, entry["source"], entry["provenance"].get("what", "see sources.json"))
    net = family.net
    if cfg.model.init_from:
        init_weights_from(cfg.model.init_from, net, family.net_name, want_ema=cfg.model.init_weights == "ema")
    dtype = autocast_dtype(cfg.model.mixed_precision)
    if cfg.model.fp8:  # before the wrapping and the EMA: both see the float8 layers
        fp8.check(adapters.enabled(cfg))
        fp8.convert(family.compile_units(net) or [net], device)
    if adapters.enabled(cfg) and cfg.model.adapter.base_quantization != "none":
        # model.adapter.base_quantization: the base's block layers quantised (or reloaded) before peft wraps them
        log.info("%s", quantized_base_store.prepare(cfg, family, dtype, run_dir.quantized_base, info.is_main))
    if adapters.enabled(cfg):
        # The frozen base in the training precision (FSDP2 shards a unit's parameters in one dtype: fp32 there).
        family.adapters = adapters.apply(cfg, family, dtype if cfg.distributed.strategy not in SHARDED_STRATEGIES else None)
    # Only the trained module (and its EMA) is wrapped; the frozen components never are.
    strategy = Strategy(cfg.distributed.strategy, info.has_group, device, dtype, cfg.distributed, info)
    # Before the EMA and the wrapper: both then see the swapped blocks' weights where they live (the host).
    swap = block_swap.install(cfg, family, net, device, info.world_size, strategy.name)
    ema = _build_ema(cfg, net, family.net_name, plan.total_steps, device)
    # fp16 needs loss scaling (its range underflows small gradients); bf16 does not.
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.model.mixed_precision == "fp16")
    _log_memory_plan(cfg, info, family, net, ema, strategy, dtype, run_dir)
    model = strategy.wrap(family.loss_module, ema.shadow if ema is not None else None, family.shard_units,
                          shadow_units=ema is None or ema.names is None)
    if cfg.model.compile:
        family.compile_cache = compile_cache.for_run(cfg.model.compile_cache, run_dir.root, device, info.is_main)
        family.compile_cache.load()  # before anything compiles
        mode = cfg.model.compile_mode
        if mode in ("reduce-overhead", "max-autotune") and device.type != "cuda":
            log.info("model.compile_mode=%s: CUDA graphs apply on CUDA only; on %s it compiles as %s", mode,
                     device.type, "max-autotune-no-cudagraphs" if mode == "max-autotune" else "default")
        options = {} if mode == "default" else {"mode": mode}
        model = compile_model(model, family, net, cfg.model.compile_scope, **options)
    return ModelParts(family, net, ema, strategy, model, dtype, scaler, swap)


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that record CUDA graphs


def new_cuda_graph_step(*_args) -> None:
    """Each forward of the trained net starts a new CUDA-graph generation: graphs reuse their output
    buffers, and the last step's outputs (a loss kept for the log) stay valid until the next forward."""
    torch.compiler.cudagraph_mark_step_begin()


def compile_model(model: torch.nn.Module, family: Family, net: torch.nn.Module, scope: str = "blocks",
                  **options) -> torch.nn.Module:
    """``model.compile``: with ``scope`` blocks, the family's units of ``net`` compiled in place
    (``Family.compile_units``: each block its own small graph, reused by the blocks of its shape: a shorter
    warm-up than one graph of the whole net); else (scope whole, or a family without units) the whole
    wrapped ``model`` (``torch.compile``; the compiled wrapper is only called: weights are always read from
    the bare net, no _orig_mod keys); auto: the family's ``compile_scope_auto``. ``options``:
    ``torch.compile``'s (a test's backend)."""
    if scope == "auto":
        scope = getattr(family, "compile_scope_auto", "blocks")
    units = family.compile_units(net) if scope == "blocks" else None
    if units is None:
        log.info("model.compile: the whole %s compiled as one graph", family.net_name)
        compiled = torch.compile(model, **options)
        if options.get("mode") in CUDA_GRAPH_MODES:
            compiled.register_forward_pre_hook(new_cuda_graph_step)  # outside the graph: on the wrapper
        return compiled
    if options.get("mode") in CUDA_GRAPH_MODES:
        net.register_forward_pre_hook(new_cuda_graph_step)  # the net itself is not compiled, its units are
    # Dynamo keeps at most recompile_limit graphs per function (then runs it eager): a UNet's ResNet blocks
    # are one function with a graph per shape, up to one per unit.
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, len(units))
    for unit in units:
        unit.compile(**options)
    log.info("model.compile: %d units of the %s compiled one by one", len(units), family.net_name)
    return model


def _build_ema(cfg: TrainConfig, net: torch.nn.Module, net_name: str, total_steps: int,
               device: torch.device) -> EMA | None:
    if not cfg.model.use_ema:
        return None
    e = cfg.model.ema
    decay = e.decay
    if e.strength_target is not None:
        decay = decay_from_strength(e.strength_target, total_steps, e.update_every)
        log.info("EMA decay %.8f derived from model.ema.strength_target=%s", decay, e.strength_target)
    # model.adapter: the EMA of the adapters only (the frozen base would be a second copy of itself).
    ema = EMA(net, decay, e.update_every, e.start_step, e.warmup, torch.device("cpu") if e.device == "cpu" else device,
              trainable_only=adapters.enabled(cfg))
    if e.path:
        ema.load_weights(load_weights_checked(e.path, net, net_name, "model.ema.path"))
    return ema


def _log_memory_plan(cfg: TrainConfig, info: DistInfo, family: Family, net: torch.nn.Module, ema: EMA | None,
                     strategy: Strategy, dtype: torch.dtype | None, run_dir: RunDir) -> None:
    """Per-GPU bytes of the trained and frozen modules under each strategy, before the first step."""
    # Text encoders trained alongside: whole (model.text_encoder.train) or through their adapter.
    replicated = [*family.trained_encoders().values(), *(family.adapters.encoders.values() if family.adapters else ())]
    rows = memory_plan(
        net, family.frozen_on_device(), cfg.optimizer.name, info.world_size, ema is not None,
        cfg.model.ema.device == "cpu", 2 if dtype is not None else 4, family.shard_units,
        cfg.distributed.fsdp_unit, replicated=replicated,
        activations=micro_batch_activations(cfg, net, text_tokens=family.text_tokens(cfg), family=type(family)),
        ema_bytes=module_bytes(ema.shadow) if ema is not None else None, in_backward=cfg.optimizer.in_backward,
        shard_size=strategy.shard_size if strategy.name == "hsdp" else 0,
    )
    check_plan(rows, strategy.plan_name, info.device.type, cfg)  # a batch that cannot fit stops here
    if info.is_main:
        log.info("%s", format_plan(rows, strategy.plan_name, info.world_size))
        plan = {"strategy": strategy.plan_name, "world_size": info.world_size, "rows": as_dicts(rows)}
        run_dir.memory_plan.write_text(json.dumps(plan, indent=1) + "\n")


def build_optimizer_parts(cfg: TrainConfig, info: DistInfo, plan: Plan, parts: ModelParts) -> OptimizerParts:
    """Parameter groups (after wrapping: FSDP2 has replaced the parameters by sharded DTensors), trained
    encoders under DDP, the optimizer and the LR schedule."""
    o, family = cfg.optimizer, parts.family
    check_in_backward(o, parts.strategy.name, info.world_size, plan.accumulation)
    scale = lr_scale(o, plan.global_batch)
    peak_lr = o.params.learning_rate * scale
    if o.scale_lr:
        log.info("optimizer.scale_lr: peak LR %.3g = %.3g x (global batch %d)^0.55",
                 peak_lr, o.params.learning_rate, plan.global_batch)
    if family.adapters is not None:  # only the adapters train (model.adapter)
        groups = family.adapters.param_groups(cfg, peak_lr, scale)
        encoders = dict(family.adapters.encoders)
    else:
        groups = param_groups(parts.net, o.params.weight_decay, o.no_decay_norm_and_bias)
        groups += family.extra_param_groups(peak_lr, scale)
        encoders = family.trained_encoders()
    # Encoders trained with the net (a text encoder) are replicated with plain DDP, never sharded.
    encoder_models = dict(encoders)
    if info.is_distributed:
        ids = [info.device.index] if info.device.type == "cuda" else None
        encoder_models = {name: torch.nn.parallel.DistributedDataParallel(m, device_ids=ids)
                          for name, m in encoders.items()}
    family.use_wrapped_encoders(encoder_models)
    optimizer = build_optimizer(groups, o, parts.strategy.optimizer_device, peak_lr)
    if parts.swap is not None:  # the swapped parameters' state goes to the device with them
        parts.swap.follow_optimizer(optimizer)
    if family.compile_cache is not None:  # model.compile: the compiler's cache, saved after the first step
        family.compile_cache.save_after_first_step(optimizer)
    device_side_skip = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and any(
        g.get("fused") for g in optimizer.param_groups)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, plan.total_steps)
    return OptimizerParts(optimizer, lr_scheduler, encoders, encoder_models, device_side_skip)
