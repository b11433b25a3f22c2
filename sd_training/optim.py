"""Optimizer, parameter groups and learning-rate schedule, all counted in optimizer steps; the optimizer
in the backward pass (``optimizer.in_backward``), the gradient clipping of the step, and the switch to a
schedule-free optimizer's evaluation weights around validation, samples and exports (:func:`eval_weights`).

Prodigy, Lion, schedule-free AdamW and CAME come from pytorch-optimizer (``pytorch_optimizer``, imported
when one of them is chosen). What each reads and refuses: ``config.rules``."""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import torch
import torch.distributed as dist

from .config import ConfigError
from .config.schema import LRSchedulerConfig, OptimizerConfig
from .distributed.strategy import local

log = logging.getLogger(__name__)

# Normalisation layers: their weights (scales) and all biases get no weight decay, as in most
# transformer/diffusion recipes (decaying a norm's scale towards 0 only fights the normalisation).
NORM_TYPES = (torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.BatchNorm2d, torch.nn.InstanceNorm2d)


def param_groups(module: torch.nn.Module, weight_decay: float, exclude_norm_and_bias: bool, lr: float | None = None) -> list[dict]:
    """[decayed, not decayed] groups of the trainable parameters of ``module``."""
    decay, no_decay = [], []
    for mod in module.modules():
        for name, p in mod.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if exclude_norm_and_bias and (isinstance(mod, NORM_TYPES) or name == "bias" or p.ndim <= 1):
                no_decay.append(p)
            else:
                decay.append(p)
    extra = {} if lr is None else {"lr": lr}
    groups = [{"params": decay, "weight_decay": weight_decay, **extra}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, **extra})
    return [g for g in groups if g["params"]]


def lr_scale(cfg: OptimizerConfig, global_batch: int) -> float:
    """``scale_lr``: the peak LR is multiplied by (global batch)^0.55 (EveryDream2's rule)."""
    return global_batch ** 0.55 if cfg.scale_lr else 1.0


def build_optimizer(groups: list[dict], cfg: OptimizerConfig, device: torch.device, peak_lr: float) -> torch.optim.Optimizer:
    """The configured optimizer of ``groups``; with ``optimizer.in_backward`` its updates run in the backward
    pass (:class:`InBackward`, attached as ``optimizer.in_backward``)."""
    optimizer = _build(groups, cfg, device, peak_lr)
    if cfg.in_backward:
        optimizer.in_backward = InBackward(optimizer, lambda one: _build(one, cfg, device, peak_lr))
    return optimizer


def _build(groups: list[dict], cfg: OptimizerConfig, device: torch.device, peak_lr: float) -> torch.optim.Optimizer:
    p = cfg.params
    name = cfg.name
    if name == "adamw":
        kwargs = dict(lr=peak_lr, betas=(p.beta1, p.beta2), weight_decay=p.weight_decay, eps=p.epsilon)
        # One fused kernel for all parameters on CUDA. On CPU the per-tensor loop: measured faster than
        # foreach there (benchmarks/bench_step.py: foreach made our step ~7% slower than diffusers' loop).
        impl = cfg.implementation
        if impl == "auto":
            impl = "fused" if device.type == "cuda" else "for_loop"
        if impl == "fused":
            kwargs["fused"] = True
        elif impl == "foreach":
            kwargs["foreach"] = True
        else:
            kwargs["foreach"] = False
        return torch.optim.AdamW(groups, **kwargs)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as e:  # not installed, or a build without this platform's kernels
            raise ConfigError(f"optimizer.name=adamw8bit needs bitsandbytes, which cannot be imported here ({e}): "
                              "pip install bitsandbytes (8-bit AdamW on CUDA; recent versions on the CPU too), or use "
                              "optimizer.name=adamw") from None

        return bnb.optim.AdamW8bit(groups, lr=peak_lr, betas=(p.beta1, p.beta2), weight_decay=p.weight_decay, eps=p.epsilon)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # External LR schedule: relative_step and parameter scaling off (the usual diffusion fine-tuning setting).
        return Adafactor(groups, lr=peak_lr, relative_step=False, scale_parameter=False, warmup_init=False,
                         weight_decay=p.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=peak_lr, momentum=p.momentum, weight_decay=p.weight_decay,
                               nesterov=p.momentum > 0 and cfg.nesterov)
    if name in PACKAGE_OPTIMIZERS:
        return _build_package(name, groups, cfg, peak_lr)
    raise ConfigError(f"unknown optimizer.name '{name}'")


# optimizer.name -> the class of pytorch-optimizer (``pytorch_optimizer``) it builds.
PACKAGE_OPTIMIZERS = {"prodigy": "Prodigy", "lion": "Lion", "adamw_schedulefree": "ScheduleFreeAdamW", "came": "CAME"}


def _build_package(name: str, groups: list[dict], cfg: OptimizerConfig, peak_lr: float) -> torch.optim.Optimizer:
    """Prodigy, Lion, schedule-free AdamW or CAME, with the keys ``config.rules`` lets each read."""
    try:
        import pytorch_optimizer
    except ImportError as e:
        raise ConfigError(f"optimizer.name={name} needs pytorch-optimizer, which cannot be imported here ({e}): "
                          "pip install 'pytorch_optimizer>=3.5,<5' (a dependency of sd-training: pip install -e .), "
                          "or use optimizer.name=adamw") from None
    p = cfg.params
    kwargs = dict(lr=peak_lr, weight_decay=p.weight_decay)
    if name == "prodigy":
        lrs = sorted({g.get("lr", peak_lr) for g in groups})
        if len(lrs) > 1:  # its one step size d x the first group's LR moves every group
            raise ConfigError(f"optimizer.name=prodigy steps every parameter group with one learning rate, but "
                              f"these groups have {len(lrs)} ({', '.join(f'{lr:g}' for lr in lrs)}): unset "
                              "model.adapter.learning_rate / model.adapter.text_encoders.learning_rate / the text "
                              "encoder's learning_rate, or use another optimizer")
        kwargs.update(betas=(p.beta1, p.beta2), beta3=p.beta3, eps=p.epsilon, d_coef=p.d_coef,
                      bias_correction=p.use_bias_correction, safeguard_warmup=p.safeguard_warmup)
    elif name == "lion":
        kwargs.update(betas=(p.beta1, p.beta2))
    elif name == "adamw_schedulefree":
        # Its warmup is the LR schedule's (lr_scheduler.params.warmup_length), which sets each group's lr.
        kwargs.update(betas=(p.beta1, p.beta2), eps=p.epsilon, warmup_steps=0)
    else:  # came: its own epsilons (1e-30, 1e-16)
        kwargs.update(betas=(p.beta1, p.beta2, 0.9999 if p.beta3 is None else p.beta3))
    return getattr(pytorch_optimizer, PACKAGE_OPTIMIZERS[name])(groups, **kwargs)


def schedule_free(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer`` keeps separate training and evaluation weights (schedule-free AdamW)."""
    return optimizer is not None and callable(getattr(optimizer, "eval", None)) and bool(optimizer.param_groups) \
        and all("train_mode" in g for g in optimizer.param_groups)


@contextlib.contextmanager
def eval_weights(optimizer: torch.optim.Optimizer | None):
    """Inside: a schedule-free optimizer's parameters hold its evaluation weights (x, the average its
    validation, samples and exports must use); after: its training weights (y) again, bit for bit (a
    host copy is put back: ``train()`` after ``eval()`` restores them only within rounding, and a run
    resumed from the checkpoint saved before an export would then differ from one never stopped).
    Checkpoints are saved outside, in training mode. Any other optimizer: nothing happens. Collective under
    FSDP only in that every rank must enter it (each switches its own shards)."""
    if not schedule_free(optimizer) or not all(g["train_mode"] for g in optimizer.param_groups):
        yield  # another optimizer, or already inside
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if "z" in optimizer.state.get(p, {})]
    with torch.no_grad():
        kept = [local(p).detach().to("cpu", copy=True) for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()
        with torch.no_grad():
            for p, k in zip(params, kept):
                local(p).copy_(k)


def in_eval_weights(method):
    """A method of an object with an ``optimizer`` attribute, run under :func:`eval_weights` of it."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with eval_weights(getattr(self, "optimizer", None)):
            return method(self, *args, **kwargs)

    return wrapper


def lr_factor(step: int, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """Multiplier of the peak LR for the optimizer step with 0-based index ``step``.

    Warmup is linear and reaches the peak on step ``warmup_length - 1``: the first step trains with
    peak / warmup_length rather than 0 (a first step at LR 0 is wasted compute). Decays reach
    ``min_lr_ratio`` on the last step of ``decay_length`` (default: the end of training).
    """
    p = cfg.params
    if cfg.scheduler == "Constant":
        return 1.0
    warm = p.warmup_length
    if warm > 0 and step < warm:
        return (step + 1) / warm
    if cfg.scheduler == "ConstantWithWarmup":
        return 1.0
    decay = p.decay_length if p.decay_length is not None else max(total_steps - warm, 1)
    progress = min(max(step - warm + 1, 0) / decay, 1.0)
    if cfg.scheduler == "LinearWithWarmup":
        return 1.0 - (1.0 - p.min_lr_ratio) * progress
    return p.min_lr_ratio + (1.0 - p.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer, cfg: LRSchedulerConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (its state is just the step counter) stepped once per optimizer step; every param
    group follows the same factor of its own peak LR (e.g. a text encoder with its own LR)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))


class InBackward:
    """``optimizer.in_backward``: every trained parameter is updated in the backward pass as soon as its
    gradient is complete (``register_post_accumulate_grad_hook``; under FSDP2, once its gradient is
    reduce-scattered into the shard), and its gradient is freed at once, so the gradients of the whole net
    never exist together (kohya's fused backward pass, torch's optimizer-in-backward).

    Each parameter has an optimizer of its own (the configured class, one group, one parameter), whose
    state is the run's optimizer's ``state`` (shared, so its ``state_dict()`` and checkpoints are the
    ordinary optimizer's, with the same keys and numbering) and whose hyper-parameters are copied from the
    run's optimizer's group before every update: the LR schedule, a changed peak LR on resume and a loaded
    state apply as they do to the ordinary step. The run's optimizer's own ``step()`` then finds no gradient
    and changes nothing (its step hooks still run).

    A parameter whose gradient is not finite is not updated (on the device with a fused optimizer, else a
    host check per parameter); the step's gradient norm (:meth:`grad_norm`, from each gradient as it
    arrived) is then non-finite and the step is counted as skipped. Unlike the ordinary step, the
    parameters with finite gradients were updated (a non-finite loss makes every gradient non-finite)."""

    def __init__(self, optimizer: torch.optim.Optimizer, build_one):
        self.optimizer = optimizer
        self.fused = any(g.get("fused") for g in optimizer.param_groups)
        self._sq: torch.Tensor | None = None  # sum of the squared gradient norms of this backward
        # The ranks whose shards make up one gradient: FSDP2's mesh (all ranks), or hsdp's "shard" dimension
        # (the other groups hold the same shards: summing over every rank would count each replica)
        self._group = None
        self._done: set[int] = set()
        self.handles = []
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                one = build_one([{**{k: v for k, v in group.items() if k != "params"}, "params": [p]}])
                self.handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._update, one, index)))

    def _update(self, one: torch.optim.Optimizer, index: int, p: torch.Tensor) -> None:
        if id(p) in self._done:
            raise RuntimeError(
                "optimizer.in_backward: a parameter received its gradient twice in one backward (reentrant gradient "
                "checkpointing, or a weight used by two modules): its first update would have used part of its "
                "gradient. Set optimizer.in_backward=false")
        self._done.add(id(p))
        grad = p.grad
        if self._group is None and hasattr(grad, "device_mesh"):
            mesh = grad.device_mesh
            self._group = mesh.get_group("shard") if "shard" in (mesh.mesh_dim_names or ()) else dist.group.WORLD
        sq = torch.linalg.vector_norm(grad.to_local() if hasattr(grad, "to_local") else grad,
                                      dtype=torch.float32).square()
        self._sq = sq if self._sq is None else self._sq + sq
        one.state = self.optimizer.state  # re-bound every time: load_state_dict replaces the dict
        mine = one.param_groups[0]
        for key, value in self.optimizer.param_groups[index].items():
            if key != "params":
                mine[key] = value
        if self.fused:  # skipped on the device, as the ordinary fused step does (no host sync)
            one.found_inf = (~torch.isfinite(sq)).float()
            one.step()
            one.found_inf = None
        elif bool(torch.isfinite(sq)):
            one.step()
        p.grad = None

    def grad_norm(self) -> torch.Tensor:
        """The global norm of the gradients of the backward just run (all ranks' shards under FSDP2), and a
        fresh count for the next one."""
        sq, self._sq, self._done = self._sq, None, set()
        if sq is None:
            return torch.zeros(())
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl" and sq.device.type == "cpu":  # shards offloaded to the CPU
                sq = sq.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(sq, group=self._group)  # the shards' squares (FSDP2, hsdp): every rank gets the same norm
        return sq.sqrt()


def check_in_backward(cfg: OptimizerConfig, strategy: str, world_size: int, accumulation: int) -> None:
    """What only start-up knows: the rank count under ddp and an accumulation derived from the global batch."""
    if not cfg.in_backward:
        return
    if strategy == "ddp" and world_size > 1:
        raise ConfigError(f"'optimizer.in_backward' cannot work with distributed.strategy=ddp on {world_size} ranks: "
                          "DDP all-reduces gradients in buckets after the hooks that would update each parameter. "
                          "Use distributed.strategy=fsdp (FSDP2 updates each shard once it is reduced), or "
                          "optimizer.in_backward=false")
    if accumulation > 1:
        raise ConfigError(f"'optimizer.in_backward' cannot work with gradient accumulation ({accumulation} micro-batches "
                          "from system.global_batch_size): every micro-batch's backward would update the weights. "
                          "Lower system.global_batch_size to system.batch_size x ranks, or optimizer.in_backward=false")


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
    """The step's global gradient norm, the gradients clipped to ``max_norm`` (None or 0: not clipped).
    ``optimizer.in_backward``: the norm of the gradients the updates in the backward used (never clipped:
    the config refuses a max_grad_norm)."""
    in_backward = getattr(optimizer, "in_backward", None)
    if in_backward is not None:
        return in_backward.grad_norm()
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    # FSDP2's sharded gradients give a DTensor norm (replicated; under hsdp reduced over the "shard" dimension
    # of the 2-D mesh only, each replica group holding the same shards): the guards read it as a plain tensor
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
