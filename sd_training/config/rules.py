"""The schema-level rules: every field against its declared choices and range (``fields.check_fields``),
the ``dataset`` section's rules (``dataset.check_dataset``), and the rules that need several keys. Run by
``loading.parse``; the sections' owners check the rest (``checks.check``)."""

from __future__ import annotations

import os
from dataclasses import fields

from .dataset import check_dataset, is_latent_type
from .fields import ConfigError, check_fields
from .schema import SHARDED_STRATEGIES, OptimizerConfig, OptimizerParams, TrainConfig, train_config_class

# Keys of optimizer.params each optimizer reads (learning_rate, weight_decay, max_grad_norm: all).
_OPTIMIZER_KEYS = {
    "adamw": {"beta1", "beta2", "epsilon"},
    "adamw8bit": {"beta1", "beta2", "epsilon"},
    "adafactor": set(),
    "sgd": {"momentum"},
    "prodigy": {"beta1", "beta2", "beta3", "epsilon", "d_coef", "use_bias_correction", "safeguard_warmup"},
    "lion": {"beta1", "beta2"},
    "adamw_schedulefree": {"beta1", "beta2", "epsilon"},
    "came": {"beta1", "beta2", "beta3"},
}
_CHECKED_KEYS = ("beta1", "beta2", "beta3", "epsilon", "momentum", "d_coef", "use_bias_correction", "safeguard_warmup")
# Their optimizer computes from sums over all the parameters, and pytorch-optimizer's implementation does not
# run on FSDP2's sharded (DTensor) parameters: they train under ddp or in one process.
_NOT_UNDER_FSDP = {
    "prodigy": "its step size d comes from sums over every parameter",
    "came": "its factored moments and update clipping reduce over whole tensors",
}


def _value_at(cfg, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def validate(cfg: TrainConfig) -> None:
    """Choices, ranges and the checks that need several keys; world-size checks come at start-up."""
    # YAML reads a bare on/off as a boolean: yes/no/true/false are accepted and mean on/off.
    on_off = {"yes": "on", "true": "on", "no": "off", "false": "off"}
    cfg.experiment.progress_bar = on_off.get(str(cfg.experiment.progress_bar).lower(), cfg.experiment.progress_bar)
    cfg.model.channels_last = on_off.get(str(cfg.model.channels_last).lower(), cfg.model.channels_last)  # was a bool
    for section in fields(cfg):
        if section.name == "dataset":
            check_dataset(cfg.dataset)
        else:
            check_fields(getattr(cfg, section.name), section.name + ".")
    _check_aliases(cfg)
    if cfg.optimizer.params.beta1 >= 1 or cfg.optimizer.params.beta2 >= 1:
        raise ConfigError("'optimizer.params.beta1' and 'beta2' must be < 1 (the moment estimates would never decay)")
    if cfg.experiment.sample_resolution is not None and cfg.experiment.sample_resolution % 8:
        raise ConfigError(f"'experiment.sample_resolution' must be a multiple of 8 (the VAE downsamples by 8), "
                          f"got {cfg.experiment.sample_resolution}")
    _check_run_name(cfg.experiment.name)
    radius = list(cfg.quickstart.shapes_radius)
    if len(radius) != 2 or not 0 < radius[0] <= radius[1] <= 0.5:
        raise ConfigError(f"'quickstart.shapes_radius' must be [low, high] with 0 < low <= high <= 0.5 (fractions of "
                          f"the image side), got {radius}")
    if cfg.dataset.params.text_embeddings and cfg.model.text_encoder.train:
        raise ConfigError("dataset.params.text_embeddings=true cannot train the text encoder (model.text_encoder.train)")
    if cfg.model.vae.placement == "offload" and not is_latent_type(cfg.dataset.type):
        raise ConfigError("'model.vae.placement=offload' keeps the VAE in host memory between sample grids, but the "
                          f"batches are images (dataset.type={cfg.dataset.type}): every step encodes them with the VAE. "
                          "Train on latent shards (scripts/precompute_latents.py) or use device (or auto)")
    if cfg.model.text_encoder.train and cfg.model.text_encoder_placement in ("cpu", "offload"):
        raise ConfigError(f"'model.text_encoder_placement={cfg.model.text_encoder_placement}' keeps the text encoders "
                          "off the device, but model.text_encoder.train trains one there: use device (or auto)")
    _check_optimizer_keys(cfg.optimizer)
    _check_optimizer_modes(cfg)
    _check_in_backward(cfg)
    if not cfg.model.use_ema:
        for key in ("export_weights", "sample_from"):
            if getattr(cfg.experiment, key) in ("ema", "both"):
                raise ConfigError(f"'experiment.{key}={getattr(cfg.experiment, key)}' needs model.use_ema=true")
    strategy = cfg.distributed.strategy
    if cfg.model.use_ema and cfg.model.ema.device == "cpu" and strategy in SHARDED_STRATEGIES:
        raise ConfigError(f"'model.ema.device=cpu' is not supported with distributed.strategy={strategy} (the EMA is "
                          "sharded like the UNet)")
    if cfg.model.ema.strength_target is not None and not 0 < cfg.model.ema.strength_target < 1:
        raise ConfigError("'model.ema.strength_target' must be within (0, 1)")
    if cfg.lr_scheduler.scheduler == "Constant" and cfg.lr_scheduler.params.warmup_length > 0:
        raise ConfigError("lr_scheduler.scheduler=Constant has no warmup: set lr_scheduler.params.warmup_length=0 or use ConstantWithWarmup")
    if cfg.lr_scheduler.scheduler not in ("CosineWithWarmup", "LinearWithWarmup"):
        if cfg.lr_scheduler.params.decay_length is not None or cfg.lr_scheduler.params.min_lr_ratio != 0.0:
            raise ConfigError("'lr_scheduler.params.decay_length' / 'min_lr_ratio' only apply to CosineWithWarmup and "
                              "LinearWithWarmup (a config file sets them? drop them with ~lr_scheduler.params.decay_length "
                              "~lr_scheduler.params.min_lr_ratio)")
    _check_model_sources(cfg)
    _check_evaluation(cfg)
    if cfg.model.text_encoder.train and strategy in SHARDED_STRATEGIES:
        raise ConfigError(f"'model.text_encoder.train' is not supported with distributed.strategy={strategy} (use "
                          "ddp): the text encoder is not sharded, and one gradient norm cannot mix sharded and plain "
                          "gradients")
    if cfg.distributed.fsdp_cpu_offload and strategy not in SHARDED_STRATEGIES:
        raise ConfigError("'distributed.fsdp_cpu_offload' applies to distributed.strategy=fsdp or hsdp; set the "
                          "strategy or remove it")
    if cfg.distributed.hsdp_shard_size and strategy != "hsdp":
        raise ConfigError(f"'distributed.hsdp_shard_size' applies to distributed.strategy=hsdp, not {strategy}; set "
                          "the strategy or remove it")
    if cfg.model.mixed_precision == "fp16" and strategy in SHARDED_STRATEGIES:
        raise ConfigError(f"'model.mixed_precision=fp16' is not supported with distributed.strategy={strategy}: each "
                          "rank would find fp16 overflows in its own shards and skip steps the others take. Use "
                          "model.mixed_precision=bf16 (GPUs since A100), or distributed.strategy=ddp for fp16")


def _check_run_name(name) -> None:
    """``experiment.name`` is one folder inside experiment.log_dir: a plain name. ``.`` or ``..`` would
    make the run folder log_dir itself (or its parent), and ``experiment.start_fresh`` would then move
    every other run aside with it; a leading dot hides the run; a '/' nests it."""
    text = str(name)
    why = None
    if text in (".", "..") or "/" in text or "\\" in text or os.path.isabs(text):
        why = "it leaves experiment.log_dir or names a folder above the run ('/', '.', '..' and absolute paths)"
    elif not text.strip() or text != text.strip():
        why = "it is empty or starts or ends with a space"
    elif text.startswith("."):
        why = "it starts with a dot (a hidden folder)"
    elif not text.isprintable():
        why = "it holds a control character"
    elif len(text.encode()) > 200:
        why = f"it is {len(text.encode())} bytes long (at most 200: file systems refuse longer names)"
    if why:
        raise ConfigError(f"'experiment.name'={text!r} is not a plain name: {why}. The run folder is "
                          "experiment.log_dir/experiment.name: use a name such as sd15-finetune-1 (put groups of runs "
                          "in experiment.log_dir, e.g. experiment.log_dir=runs/sd15)")


def _check_aliases(cfg: TrainConfig) -> None:
    """Aliases kept for seed-001 configs: they must agree with the key that is actually used."""
    for alias, used, a, b in [
        ("system.dist_backend", "distributed.dist_backend", cfg.system.dist_backend, cfg.distributed.dist_backend),
        ("system.dist_url", "distributed.dist_url", cfg.system.dist_url, cfg.distributed.dist_url),
        ("lr_scheduler.params.learning_rate", "optimizer.params.learning_rate",
         cfg.lr_scheduler.params.learning_rate, cfg.optimizer.params.learning_rate),
        ("dataset.params.num_examples_to_see", "experiment.num_examples_to_see",
         cfg.dataset.params.num_examples_to_see, cfg.experiment.num_examples_to_see),
    ]:
        if a != b and b == _value_at(train_config_class()(), used) and not (isinstance(a, str) and a.startswith("${")):
            # Only the alias was set (an older open-diffusion config): it is the user's value.
            section, key = used.rsplit(".", 1)
            setattr(_value_at(cfg, section), key, a)
            check_fields(_value_at(cfg, section), section + ".")
        elif a != b:
            raise ConfigError(f"'{alias}' ({a}) differs from '{used}' ({b}); set only '{used}' (the alias follows it)")


def _check_optimizer_keys(cfg: OptimizerConfig) -> None:
    """A hyper-parameter the chosen optimizer does not read must stay at its default (never ignored)."""
    defaults = OptimizerParams()
    for key in _CHECKED_KEYS:
        if key not in _OPTIMIZER_KEYS[cfg.name] and getattr(cfg.params, key) != getattr(defaults, key):
            users = sorted(name for name, keys in _OPTIMIZER_KEYS.items() if key in keys)
            raise ConfigError(f"'optimizer.params.{key}' does not apply to optimizer.name={cfg.name} (it is read by "
                              f"{', '.join(users)}); remove it")
    if cfg.name != "adamw" and cfg.implementation != "auto":
        raise ConfigError(f"'optimizer.implementation' only applies to adamw, not {cfg.name}")
    if cfg.name != "sgd" and cfg.nesterov:
        raise ConfigError("'optimizer.nesterov' only applies to optimizer.name=sgd")


def _check_optimizer_modes(cfg: TrainConfig) -> None:
    """What prodigy, adamw_schedulefree and came cannot do (in_backward: in ``_check_in_backward``)."""
    o, name = cfg.optimizer, cfg.optimizer.name
    if name == "prodigy" and o.params.learning_rate < 0.1:
        raise ConfigError(
            f"optimizer.name=prodigy estimates its step size itself and 'optimizer.params.learning_rate' multiplies "
            f"it: {o.params.learning_rate:g} looks like an AdamW learning rate and would train about "
            f"{1 / o.params.learning_rate:,.0f}x slower. Set optimizer.params.learning_rate=1.0 (its authors' value; "
            "optimizer.params.d_coef scales the estimate)")
    if name == "prodigy":
        _check_prodigy_groups(cfg)
    if name == "prodigy" and o.scale_lr:
        raise ConfigError("'optimizer.scale_lr' does not apply to optimizer.name=prodigy (it estimates the step size "
                          "from the gradients, whatever the batch); remove it")
    strategy = cfg.distributed.strategy
    if name in _NOT_UNDER_FSDP and strategy in SHARDED_STRATEGIES:
        raise ConfigError(f"optimizer.name={name} cannot train under distributed.strategy={strategy}: "
                          f"{_NOT_UNDER_FSDP[name]}, and pytorch-optimizer's {name} does not run on FSDP2's sharded "
                          "parameters. Use distributed.strategy=ddp (or one process), or optimizer.name=adamw, lion or "
                          f"adamw_schedulefree under {strategy}")
    if name == "adamw_schedulefree" and cfg.lr_scheduler.scheduler not in ("Constant", "ConstantWithWarmup"):
        raise ConfigError(f"optimizer.name=adamw_schedulefree replaces the LR decay by averaging the weights: "
                          f"'lr_scheduler.scheduler={cfg.lr_scheduler.scheduler}' would decay it on top. Use "
                          "lr_scheduler.scheduler=ConstantWithWarmup (its warmup: lr_scheduler.params.warmup_length) "
                          "or Constant")


def group_learning_rates(cfg: TrainConfig) -> list[tuple[str, str, float]]:
    """(group, key it comes from, peak learning rate) of every parameter group the run trains, as the
    optimizer's groups get them: the net's (the adapter's under model.adapter), and the text encoders'."""
    m, base = cfg.model, ("optimizer.params.learning_rate", cfg.optimizer.params.learning_rate)
    a = getattr(m, "adapter", None)
    if a is not None and a.type is not None:
        net = ("model.adapter.learning_rate", a.learning_rate) if a.learning_rate is not None else base
        out = [("the adapter", *net)]
        if a.text_encoders.train:
            t = a.text_encoders.learning_rate
            out.append(("the text encoders' adapter", *(("model.adapter.text_encoders.learning_rate", t)
                                                         if t is not None else net)))
        return out
    out = [("the net", *base)]
    if m.text_encoder.train:
        t = m.text_encoder.learning_rate
        out.append(("the text encoder", *(("model.text_encoder.learning_rate", t) if t is not None else base)))
    return out


def _check_prodigy_groups(cfg: TrainConfig) -> None:
    """Prodigy multiplies its estimated step size by each group's learning rate, and steps every group with
    one: a per-group rate set like AdamW's (model.adapter.learning_rate=1e-4) trains ~10,000x too slowly."""
    groups = group_learning_rates(cfg)
    for group, key, lr in groups:
        if lr < 0.1 and key != "optimizer.params.learning_rate":  # that one: the check below, as ever
            raise ConfigError(
                f"optimizer.name=prodigy estimates its step size itself and '{key}' multiplies it for {group}: "
                f"{lr:g} looks like an AdamW learning rate and would train about {1 / lr:,.0f}x slower. Set "
                f"{key}=1.0 or remove it (optimizer.params.d_coef scales the estimate)")
    rates = sorted({lr for _, _, lr in groups})
    if len(rates) > 1:
        keys = ", ".join(f"{key}={lr:g}" for _, key, lr in groups)
        raise ConfigError(f"optimizer.name=prodigy steps every parameter group with one learning rate, but this run's "
                          f"groups have {len(rates)} ({keys}): set them equal (1.0) or remove the per-group keys")


def _check_in_backward(cfg: TrainConfig) -> None:
    """``optimizer.in_backward``: each parameter is updated once per backward, from its gradient alone, so
    nothing may need all the gradients of a step together (the rank count is checked at start-up)."""
    if not cfg.optimizer.in_backward:
        return
    why = None
    if cfg.optimizer.name in ("prodigy", "adamw_schedulefree"):
        why = (f"optimizer.name={cfg.optimizer.name}: its step needs every parameter's gradient at once ("
               + ("one step size d from sums over all of them" if cfg.optimizer.name == "prodigy" else
                  "one averaging weight per step for all of them") + "). Use optimizer.name=adamw, adamw8bit, "
               "adafactor, sgd, lion or came with it, or optimizer.in_backward=false")
    elif cfg.system.gradient_accumulation > 1 or cfg.system.global_batch_size:
        why = ("gradient accumulation: every micro-batch's backward would update the weights. Set "
               "system.gradient_accumulation=1 (and system.global_batch_size=0), or optimizer.in_backward=false")
    elif cfg.optimizer.params.max_grad_norm is not None:
        why = (f"clipping by the global gradient norm (optimizer.params.max_grad_norm={cfg.optimizer.params.max_grad_norm}, "
               "default 1.0): each parameter is updated before the others' gradients exist. Set "
               "optimizer.params.max_grad_norm=null (no clipping), or optimizer.in_backward=false")
    elif cfg.model.mixed_precision == "fp16":
        why = ("model.mixed_precision=fp16: the gradient scaler unscales and checks all gradients before the "
               "step. Use model.mixed_precision=bf16 (or no)")
    if why:
        raise ConfigError(f"'optimizer.in_backward' cannot work with {why}")


def _check_model_sources(cfg: TrainConfig) -> None:
    """Every component has a source: model.pretrained, or its own pretrained (the UNet: or its params)."""
    m = cfg.model
    if m.unet.params and m.unet.pretrained is not None:
        raise ConfigError("set either 'model.unet.pretrained' or 'model.unet.params' (from scratch), not both")
    if m.pretrained:
        return
    for name in ("vae", "text_encoder", "tokenizer", "noise_scheduler_training", "noise_scheduler_inference"):
        if name in ("text_encoder", "tokenizer") and m.text_encoder.type == "open_clip":
            continue  # built from open_clip_model + open_clip_weights
        if getattr(m, name).pretrained is None:
            raise ConfigError(
                f"'model.{name}.pretrained' is not set and there is no 'model.pretrained' to take it from: "
                "set model.pretrained=PIPELINE (local folder or hub id) or each component"
            )
    if m.unet.pretrained is None and not m.unet.params:
        raise ConfigError("the UNet has no source: set model.pretrained, model.unet.pretrained, or model.unet.params")


def _check_evaluation(cfg: TrainConfig) -> None:
    ev = cfg.evaluation
    if (ev.ref_stats or ev.ref_images or ev.clip_model) and cfg.experiment.num_eval_images < 1:
        raise ConfigError("'evaluation' scores the eval images: set experiment.num_eval_images (and eval_caption_file)")
    if ev.clip_config and not ev.clip_model:
        raise ConfigError("'evaluation.clip_config' needs 'evaluation.clip_model' (the name it defines)")
    if ev.clip_model and not ev.clip_pretrained:
        raise ConfigError("'evaluation.clip_model' needs 'evaluation.clip_pretrained' (a local weights file)")
    if ev.ref_stats and not ev.ref_images and not os.path.exists(ev.ref_stats):
        raise ConfigError(f"'evaluation.ref_stats' {ev.ref_stats} does not exist and there are no ref_images to compute it from")
    if cfg.experiment.num_eval_images > 0 and not cfg.experiment.eval_caption_file:
        raise ConfigError("'experiment.num_eval_images' > 0 needs 'experiment.eval_caption_file' (the prompts)")
    if cfg.experiment.eval_caption_file and not os.path.exists(cfg.experiment.eval_caption_file):
        raise ConfigError(f"'experiment.eval_caption_file' {cfg.experiment.eval_caption_file} does not exist")


def text_encoder_placement(cfg) -> str:
    """``model.text_encoder_placement`` resolved: ``auto`` is ``offload`` when the batches carry stored text
    states (the steps never run the encoders; samples and eval images do), else ``device``."""
    placement = cfg.model.text_encoder_placement
    if placement != "auto":
        return placement
    stored = bool(cfg.dataset.params.text_embeddings) and is_latent_type(cfg.dataset.type)
    return "offload" if stored else "device"


def vae_placement(cfg) -> str:
    """``model.vae.placement`` resolved: ``auto`` is ``offload`` when the batches are latent shards (the steps
    never run the VAE), else ``device``; a trained VAE (``model.train_target: vae``) stays on the device."""
    placement = cfg.model.vae.placement
    if placement != "auto":
        return placement
    return "offload" if is_latent_type(cfg.dataset.type) and cfg.model.train_target != "vae" else "device"

