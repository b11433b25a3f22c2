"""The typed configuration: dataclass schema, ``load(argv)``, validation, ``--help`` and dump.

Precedence is schema defaults < YAML (``config=path.yaml``) < ``key.sub=value`` on the command line.
Section and key names follow open-diffusion's template config so an existing config runs once its
``???`` are filled. Unknown keys and wrong types fail at start-up with the key's full path and the
closest valid key.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Dict, List, Optional, get_args, get_origin, get_type_hints

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from .fields import ConfigError, f
from .schema.dataset import DatasetConfig, is_latent_type
from .schema.objective import ObjectiveConfig
from .schema.text_encoder import TextEncoderConfig
from .schema.vae_training import VAEObjectiveConfig

# Files that ship inside the package (sd_training/assets/NAME): a config names them ${asset:NAME}, which
# resolves to an absolute path wherever the package is installed and whatever the working directory.
ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")


def _asset(name: str) -> str:
    path = os.path.join(ASSETS, str(name))
    if not os.path.exists(path):
        raise ConfigError(f"${{asset:{name}}}: no such file or folder in {ASSETS} "
                          f"(shipped: {', '.join(sorted(os.listdir(ASSETS))) if os.path.isdir(ASSETS) else 'none'})")
    return path


# omegaconf 2.4 renamed register_new_resolver (which it deprecates) to register_resolver.
(getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver)("asset", _asset, replace=True)

# ----------------------------------------------------------------------------------------------
# Schema. Every field: f(default, "one-line help with its unit").
# ----------------------------------------------------------------------------------------------


@dataclass
class WandbConfig:
    mode: str = f("auto", "online | offline | disabled | auto (online when wandb has credentials, else offline)")
    project: str = f("${experiment.project}", "wandb project")
    entity: Optional[str] = f(None, "wandb team or user (None: wandb's default entity)")
    api_key: Optional[str] = f(None, "discouraged: prefer the WANDB_API_KEY environment variable or `wandb login`")
    tags: List[str] = f([], "tags attached to the wandb run")


@dataclass
class SystemConfig:
    gradient_accumulation: int = f(1, "micro-batches per optimizer step (leave at 1 with global_batch_size)")
    global_batch_size: int = f(0, "images per optimizer step over all ranks; when set, the accumulation is derived from it, the batch size and the rank count, so a resume on another rank count keeps it (0: batch_size x gradient_accumulation x ranks)")
    batch_size: int = f(32, "images per device per micro-batch")
    workers: int = f(6, "data-loading worker processes per device (SLURM: cpus-per-task)")
    dist_backend: str = f("${distributed.dist_backend}", "alias of distributed.dist_backend (must agree with it)")
    dist_url: str = f("${distributed.dist_url}", "alias of distributed.dist_url (must agree with it)")
    device: str = f("auto", "auto (cuda when available, else cpu) | cpu | cuda")
    seed: int = f(0, "global seed; each rank derives its own from it")
    tf32: bool = f(True, "CUDA: fp32 matmuls and convolutions use TF32 tensor cores (Ampere and newer; the frozen fp32 parts, fp32 training); False: full fp32")


@dataclass
class DistributedConfig:
    dist_backend: str = f("auto", "auto (nccl on CUDA, gloo on CPU) | nccl | gloo")
    dist_url: str = f("env://", "process-group init method; env:// reads MASTER_ADDR/MASTER_PORT")
    timeout_minutes: float = f(30.0, "minutes a collective may wait before the job fails")
    strategy: str = f("ddp", "ddp (replicated UNet) | fsdp (FSDP2 fully_shard per UNet block, sharded checkpoints)")
    bucket_cap_mb: float = f(25.0, "ddp: gradient bucket size in MB (larger: fewer, bigger all-reduces)")
    static_graph: bool = f(False, "ddp: the graph is the same every step (no unused parameters): lets DDP overlap more")
    grad_reduce_dtype: str = f("fp32", "dtype gradients are reduced in: fp32 | bf16 (half the traffic; ddp: a compression hook, fsdp: reduce_dtype)")
    fsdp_unit: str = f("layer", "fsdp: shard units: layer (each resnet and transformer block) | block (each down/mid/up block)")
    fsdp_cpu_offload: bool = f(False, "fsdp: keep the weight, gradient, optimizer and EMA shards in pinned CPU memory (CPUOffloadPolicy; the optimizer steps on the CPU): fits larger models in less GPU memory, slower")
    reshard_after_forward: bool = f(True, "fsdp: free the gathered parameters after the forward (less memory; False: no re-gather in backward)")
    flag_sync_every: int = f(10, "optimizer steps between the host checks: the ranks agree on a stop signal or a timed save, the non-finite counters are read (1: every step)")


@dataclass
class ExperimentConfig:
    log_dir: str = f("runs", "directory that holds run directories")
    name: str = f(MISSING, "run name: the run directory is log_dir/name")
    project: str = f("sd-training", "project name (the wandb project by default)")
    num_examples_to_see: int = f(MISSING, "images to train on, all devices together")
    save_every: int = f(2000, "optimizer steps between exported pipelines (and at the end)")
    save_only_most_recent: bool = f(True, "keep only the newest exported pipeline (pipelines/current)")
    checkpoint_every: Optional[int] = f(None, "optimizer steps between resume checkpoints (None: save_every)")
    save_every_minutes: Optional[float] = f(None, "also write a resume checkpoint after this many minutes since the last one")
    checkpoint_async: bool = f(True, "write resume checkpoints in a background thread: the step waits only for a copy to host memory (FSDP's sharded state is written synchronously)")
    keep_last_checkpoints: int = f(2, "complete resume checkpoints kept (older ones are deleted)")
    keep_checkpoint_every: Optional[int] = f(None, "optimizer steps: checkpoints at multiples of this are kept forever")
    resume: bool = f(True, "continue from the newest complete checkpoint in the run directory, if any")
    start_fresh: bool = f(False, "a run directory that holds checkpoints: move its contents aside (<name>.old-<time>) and start over")
    allow_config_change: bool = f(False, "resume although keys that change the training differ from the checkpoint's config")
    max_nonfinite_steps: int = f(10, "consecutive optimizer steps with a non-finite loss or gradient before the run saves and stops")
    export_weights: str = f("auto", "pipelines exported: auto (raw, plus ema with model.use_ema) | raw | ema | both")
    sample_from: str = f("auto", "weights of the sample grids: auto (ema with model.use_ema, else raw) | raw | ema | both")
    requeue: bool = f(True, "on SIGUSR1/SIGTERM under SLURM: save, then `scontrol requeue` the job")
    log_every: int = f(10, "optimizer steps between metric lines")
    record_sample_keys: bool = f(False, "write the keys of every step's samples to sample_keys/rank_<N>.jsonl (which data each step trained on; compare runs and layouts)")
    progress_bar: str = f("auto", "live progress bar: auto (on an interactive terminal, not under SLURM batch) | on | off")
    tensorboard: bool = f(False, "also write tensorboard event files to <run>/tensorboard")
    peak_tflops: Optional[float] = f(None, "peak dense TFLOP/s of one device for MFU (None: the A100/H100/H200 table; CPU: no MFU)")
    sample_prompts: List[str] = f(
        ["a photo of a cat", "a red circle on a blue background", "a painting of a lighthouse at sunset"],
        "prompts of the sample grid written with each exported pipeline",
    )
    sample_per_prompt: int = f(4, "images per prompt in the sample grid (seeds sample_seed, sample_seed+1, ...)")
    eval_caption_file: Optional[str] = f(None, "prompt file (.txt one per line, or .csv with a caption column) for eval images")
    num_eval_images: int = f(0, "images generated from eval_caption_file at each export, split across ranks (0: none)")
    sample_seed: int = f(0, "first generator seed of the sample grid (fixed, so grids compare across steps)")
    sample_steps: int = f(25, "denoising steps per sample")
    sample_guidance_scale: float = f(7.5, "classifier-free guidance scale of the samples")
    sample_resolution: Optional[int] = f(None, "pixels of the samples (None: dataset.params.resolution)")


@dataclass
class OptimizerParams:
    learning_rate: float = f(1e-4, "peak learning rate")
    beta1: float = f(0.9, "AdamW beta1")
    beta2: float = f(0.999, "AdamW beta2")
    weight_decay: float = f(0.01, "decoupled weight decay (AdamW)")
    epsilon: float = f(1e-8, "AdamW epsilon")
    momentum: float = f(0.0, "SGD momentum")
    max_grad_norm: Optional[float] = f(1.0, "clip the gradient norm to this after accumulation (None: no clipping)")


@dataclass
class OptimizerConfig:
    name: str = f("adamw", "adamw | adamw8bit (bitsandbytes) | adafactor | sgd")
    params: OptimizerParams = f(OptimizerParams, "optimizer hyper-parameters")
    implementation: str = f("auto", "adamw kernels: auto (fused on CUDA, for_loop on CPU) | fused | foreach | for_loop")
    nesterov: bool = f(False, "sgd: Nesterov momentum")
    scale_lr: bool = f(False, "multiply the peak LR by (global batch)^0.55 (EveryDream2's rule; the result is logged)")
    no_decay_norm_and_bias: bool = f(True, "no weight decay on normalisation weights and biases")


@dataclass
class LRSchedulerParams:
    learning_rate: float = f("${optimizer.params.learning_rate}", "peak learning rate (must agree with the optimizer's)")
    warmup_length: int = f(500, "optimizer steps of linear warmup from 0")
    decay_length: Optional[int] = f(None, "Cosine/LinearWithWarmup: optimizer steps of decay after warmup (None: to the end)")
    min_lr_ratio: float = f(0.0, "Cosine/LinearWithWarmup: the final learning rate as a fraction of the peak")


@dataclass
class LRSchedulerConfig:
    scheduler: str = f("ConstantWithWarmup", "Constant | ConstantWithWarmup | CosineWithWarmup | LinearWithWarmup")
    params: LRSchedulerParams = f(LRSchedulerParams, "schedule parameters, counted in optimizer steps")


@dataclass
class ComponentConfig:
    pretrained: Optional[str] = f(None, "pipeline root or component folder, local path or hub id (None: from model.pretrained)")


@dataclass
class VAEConfig:
    pretrained: Optional[str] = f(None, "pipeline root or vae folder (None: from model.pretrained)")
    dtype: str = f("auto", "frozen VAE weights: auto (bf16 under bf16, else fp32) | fp32 | bf16 | fp16 (upcast to fp32 on overflow)")
    latent_sampling: str = f("sample", "latents of online encoding: sample (of the posterior, as SD trains) | mean")


@dataclass
class UNetConfig:
    pretrained: Optional[str] = f(None, "pipeline root or unet folder to start from (None: model.pretrained, else from scratch)")
    target: str = f("UNet2DConditionModel", "diffusers UNet class used for from-scratch training")
    params: Dict[str, Any] = f({}, "constructor arguments of target for from-scratch training")


@dataclass
class EMAConfig:
    decay: float = f(0.9999, "EMA decay per update")
    update_every: int = f(1, "optimizer steps between EMA updates")
    start_step: int = f(0, "optimizer steps during which the EMA copies the weights instead of averaging")
    warmup: bool = f(False, "ramp the decay as min(decay, (1 + n) / (10 + n)) over the first n updates")
    device: str = f("auto", "auto (the UNet's device) | cpu (seed 000: saves accelerator memory; use a larger update_every)")
    strength_target: Optional[float] = f(None, "EveryDream2: derive decay so decay^(updates in the run) = this (overrides decay; logged)")
    path: Optional[str] = f(None, "pipeline root or unet folder holding EMA weights to start from (None: copy of the UNet)")


@dataclass
class ModelConfig:
    pretrained: Optional[str] = f(None, "diffusers pipeline: local folder or hub id (the default for every component)")
    family: str = f("auto", "auto (from the pipeline's model_index.json) | sd (SD 1.x/2.x) | sdxl")
    revision: Optional[str] = f(None, "hub revision of the pretrained pipeline")
    vae: VAEConfig = f(VAEConfig, "the frozen autoencoder")
    text_encoder: TextEncoderConfig = f(TextEncoderConfig, "the text encoder (frozen unless train)")
    tokenizer: ComponentConfig = f(ComponentConfig, "the tokenizer")
    text_encoder_2: ComponentConfig = f(ComponentConfig, "sdxl: the second text encoder (OpenCLIP bigG, CLIPTextModelWithProjection)")
    tokenizer_2: ComponentConfig = f(ComponentConfig, "sdxl: the second tokenizer")
    noise_scheduler_training: ComponentConfig = f(ComponentConfig, "scheduler config for training noise (built as DDPMScheduler)")
    noise_scheduler_inference: ComponentConfig = f(ComponentConfig, "scheduler of exported pipelines and samples (its own class)")
    unet: UNetConfig = f(UNetConfig, "the trained UNet")
    train_target: str = f("unet", "unet (the diffusion model) | vae (the autoencoder stage, see vae_training)")
    use_ema: bool = f(False, "keep an exponential moving average of the UNet weights; exported as pipelines/*_ema")
    ema: EMAConfig = f(EMAConfig, "EMA settings")
    mixed_precision: str = f("no", "no | bf16 | fp16 (fp16 uses a gradient scaler)")
    gradient_checkpointing: bool = f(False, "recompute activations in backward (~40% slower, much less memory)")
    xformers: bool = f(False, "use xformers memory-efficient attention (falls back to SDPA, with a warning, where unavailable)")
    attention: str = f("sdpa", "sdpa | xformers | sliced: attention backend (model.xformers=True means xformers)")
    channels_last: bool = f(False, "UNet weights and inputs in channels-last memory format (faster convolutions on recent GPUs)")
    compile: bool = f(False, "torch.compile the UNet (minutes of compilation; saved weights never carry its prefix)")
    init_from: Optional[str] = f(None, "stage 2: start the UNet from another run's dir, checkpoint (step_N) or exported pipeline")
    init_weights: str = f("ema", "with init_from: ema (when present, else raw) | raw")


@dataclass
class QuickstartConfig:
    tiny_pipeline: Optional[str] = f(None, "folder: build a tiny random-weight pipeline here when absent (point model.pretrained at it)")
    shapes_dataset: Optional[str] = f(None, "folder: write generated-shapes WebDataset shards here when absent")
    shapes_samples: int = f(2000, "images in the generated-shapes dataset")
    shapes_per_shard: int = f(250, "images per generated shard")
    shapes_size: int = f(64, "pixels (square) of the generated images")
    shapes_radius: List[float] = f([0.25, 0.4], "range of a shape's half-size, as a fraction of the image side")
    shapes_offset: float = f(0.1, "largest shift of a shape's centre from the image centre, as a fraction of the side")


@dataclass
class ValidationConfig:
    path: Optional[str] = f(None, "held-out shards (same format as dataset.params.path); None: no validation")
    num_batches: int = f(4, "batches per rank, read once and kept: every validation scores the same images")
    every: Optional[int] = f(None, "optimizer steps between validations (None: experiment.save_every); also at step 0")
    seed: int = f(1234, "seed of the fixed noise and timesteps, so the loss compares across steps and restarts")


@dataclass
class EvaluationConfig:
    ref_stats: Optional[str] = f(None, ".npz FID reference statistics: read if present, else written from ref_images")
    ref_images: Optional[str] = f(None, "FID reference set: image folder or WebDataset shards (held-out data)")
    ref_max_images: Optional[int] = f(None, "images of the reference set used (None: all)")
    clip_model: Optional[str] = f(None, "open_clip model name for CLIP score (e.g. ViT-L-14), or local-dir:PATH")
    clip_pretrained: Optional[str] = f(None, "local weights file of clip_model (nothing is downloaded)")
    clip_config: Optional[str] = f(None, "open_clip model config .json defining clip_model, when open_clip does not bundle it")
    asynchronous: bool = f(True, "score in a background process so training does not wait (results logged with their step)")
    threads: Optional[int] = f(None, "CPU threads of the background evaluation (None: torch's default)")
    device: str = f("cpu", "device of Inception / CLIP: cpu | cuda | auto")


@dataclass
class TrainConfig:
    wandb: WandbConfig = f(WandbConfig, "Weights & Biases tracking")
    system: SystemConfig = f(SystemConfig, "per-device batch, accumulation, workers, device")
    distributed: DistributedConfig = f(DistributedConfig, "process group")
    experiment: ExperimentConfig = f(ExperimentConfig, "run name, length, saving, samples")
    optimizer: OptimizerConfig = f(OptimizerConfig, "optimizer")
    model: ModelConfig = f(ModelConfig, "models")
    dataset: DatasetConfig = f(DatasetConfig, "training data")
    lr_scheduler: LRSchedulerConfig = f(LRSchedulerConfig, "learning-rate schedule")
    objective: ObjectiveConfig = f(ObjectiveConfig, "prediction type, loss weighting, noise and timestep sampling")
    validation: ValidationConfig = f(ValidationConfig, "held-out loss at fixed timesteps and noise")
    evaluation: EvaluationConfig = f(EvaluationConfig, "FID / CLIP score of the eval images (experiment.num_eval_images)")
    vae_training: VAEObjectiveConfig = f(VAEObjectiveConfig, "autoencoder-stage losses (model.train_target=vae)")
    quickstart: QuickstartConfig = f(QuickstartConfig, "generated model and data for runs with no downloads (configs/quickstart.yaml)")


# ----------------------------------------------------------------------------------------------
# Schema walking: the valid key paths, free-form dict fields, help text.
# ----------------------------------------------------------------------------------------------


def _is_free_dict(tp) -> bool:
    return tp is dict or get_origin(tp) in (dict, Dict)


def _unwrap_optional(tp):
    args = [a for a in get_args(tp) if a is not type(None)]
    return args[0] if get_origin(tp) is not None and len(args) == 1 and type(None) in get_args(tp) else tp


def schema_entries(cls=TrainConfig, prefix: str = ""):
    """Yield (path, type, default, help, is_section) for every field of the schema, depth first."""
    hints = get_type_hints(cls)
    instance = cls()
    for fld in fields(cls):
        path = f"{prefix}{fld.name}"
        tp = _unwrap_optional(hints[fld.name])
        if is_dataclass(tp):
            yield path, tp, None, fld.metadata.get("help", ""), True
            yield from schema_entries(tp, path + ".")
        else:
            yield path, tp, getattr(instance, fld.name), fld.metadata.get("help", ""), False


def _all_paths() -> list[str]:
    return [p for p, *_ in schema_entries()]


def _suggest(bad_path: str) -> str:
    paths = _all_paths()
    # Same leaf in another section first ("experiment.batch_size" -> "system.batch_size"), then spelling.
    leaf = bad_path.rsplit(".", 1)[-1]
    same_leaf = [p for p in paths if p.rsplit(".", 1)[-1] == leaf]
    close = same_leaf or difflib.get_close_matches(bad_path, paths, n=1, cutoff=0.6)
    if not close:
        close = [p for p in paths if p.rsplit(".", 1)[-1] in difflib.get_close_matches(leaf, [q.rsplit(".", 1)[-1] for q in paths], n=1)]
    return f"; did you mean '{close[0]}'?" if close else ""


def _str_fields() -> dict[str, bool]:
    return {path: True for path, tp, _d, _h, is_section in schema_entries() if not is_section and tp is str}


_STR_FIELDS = _str_fields()  # key path -> True, for the string fields of the schema


def _unbool_strings(user: DictConfig) -> None:
    """YAML 1.1 reads a bare no/yes/off/on as a boolean; a string field (e.g. model.mixed_precision: no)
    gets the word back instead of a type error."""
    for path, tp, _default, _help, is_section in schema_entries():
        if is_section or tp is not str:
            continue
        value = OmegaConf.select(user, path, default=None, throw_on_missing=False, throw_on_resolution_failure=False)
        if isinstance(value, bool):
            OmegaConf.update(user, path, "yes" if value else "no", force_add=True)


_BOOL_WORDS = {"y", "yes", "n", "no", "true", "false", "on", "off"}


def _quote_bool_words(override: str) -> str:
    """``experiment.name=off``: a string field keeps the word as typed (YAML would read a bool)."""
    key, sep, value = override.partition("=")
    if sep and value.lower() in _BOOL_WORDS and _STR_FIELDS.get(key.strip()):
        return f"{key}='{value}'"
    return override


def _check_keys(node: Any, cls, prefix: str = "") -> None:
    """Reject keys the schema does not have, before OmegaConf's merge (whose messages are terse)."""
    if not isinstance(node, (dict, DictConfig)):
        return
    hints = get_type_hints(cls)
    names = {fl.name for fl in fields(cls)}
    for key in node.keys():
        path = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{path}'{_suggest(path)}")
        tp = _unwrap_optional(hints[key])
        if is_dataclass(tp):
            value = node[key] if isinstance(node, dict) else node._get_node(key)._value()
            if isinstance(value, (dict, DictConfig)):
                _check_keys(value, tp, path + ".")


# ----------------------------------------------------------------------------------------------
# Loading.
# ----------------------------------------------------------------------------------------------


def parse_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``config=path`` (repeatable: later files override earlier ones, e.g. a per-model base
    config then a recipe) from ``key=value`` overrides; anything else is an error."""
    config_paths, overrides = [], []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"argument '{arg}' is not key=value (use config=path.yaml and key.sub=value; --help lists keys)")
        key, value = arg.split("=", 1)
        if key in ("config", "--config"):
            config_paths.append(value)
        else:
            overrides.append(f"{key.lstrip('-')}={value}")
    return config_paths, overrides


def parse(argv: list[str] | None = None, *, yaml_text: str | None = None) -> TrainConfig:
    """The resolved ``TrainConfig`` from the command line (and/or YAML text), with the schema's own checks.

    The sections' owners check the rest: use ``sd_training.configure.load`` for a config to train with."""
    argv = sys.argv[1:] if argv is None else argv
    config_paths, overrides = parse_argv(argv)
    layers = []
    for config_path in config_paths:
        if not os.path.exists(config_path):
            raise ConfigError(f"config file '{config_path}' does not exist")
        try:
            layers.append(OmegaConf.load(config_path))
        except Exception as e:  # yaml syntax errors
            raise ConfigError(f"cannot parse config file '{config_path}': {e}") from e
    if yaml_text is not None:
        layers.append(OmegaConf.create(yaml_text))
    try:
        layers.append(OmegaConf.from_dotlist([_quote_bool_words(o) for o in overrides]))
    except Exception as e:
        raise ConfigError(f"cannot parse command-line overrides {overrides}: {e}") from e

    user = OmegaConf.merge(*layers) if layers else OmegaConf.create({})
    if not isinstance(user, DictConfig):
        raise ConfigError(f"config files {config_paths} must hold a mapping of sections")
    _check_keys(user, TrainConfig)
    _unbool_strings(user)
    # A ??? that no later layer filled. Checked before the schema merge, where OmegaConf would let a
    # ??? fall back to the schema default instead of stopping.
    _raise_missing(sorted(OmegaConf.missing_keys(user)))
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), user)
    except ConfigKeyError as e:
        raise ConfigError(f"unknown config key '{e.full_key}'{_suggest(str(e.full_key))}") from None
    except ValidationError as e:
        raise ConfigError(f"wrong type for '{e.full_key}': {str(e).splitlines()[0]}") from None
    return resolve(cfg)


def _raise_missing(missing: list[str]) -> None:
    if not missing:
        return
    hint = ""
    if "wandb.api_key" in missing:
        hint = " (wandb.api_key is optional here: delete the line and export WANDB_API_KEY instead)"
    raise ConfigError(
        "required config keys are not set (they are ??? in the config): " + ", ".join(missing)
        + f". Set them in the YAML or on the command line, e.g. {missing[0]}=...{hint}"
    )


def _mixture_path(cfg: DictConfig) -> None:
    """``dataset.params.sources`` replaces ``path``, which then names the sources joined by '::'."""
    params = cfg.dataset.params
    sources = params.get("sources") or []
    if not sources:
        return
    if not OmegaConf.is_missing(params, "path"):
        raise ConfigError("'dataset.params.path' and 'dataset.params.sources' are both set: a mixture's paths are "
                          "in its sources; remove dataset.params.path")
    if any(not hasattr(e, "get") or not e.get("path") for e in sources):
        return  # named by the dataset checks
    params.path = "::".join(str(e.get("path")) for e in sources)


def resolve(cfg: DictConfig) -> TrainConfig:
    """Check required keys, resolve interpolations, convert to dataclasses and validate."""
    _mixture_path(cfg)
    _raise_missing(sorted(OmegaConf.missing_keys(cfg)))
    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"required config key '{e.full_key}' is not set (interpolated from a ??? value)") from None
    except InterpolationResolutionError as e:
        raise ConfigError(f"cannot resolve the interpolation in '{e.full_key}': {e.msg}") from None
    except ValidationError as e:
        raise ConfigError(f"wrong type for '{e.full_key}': {str(e).splitlines()[0]}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config at '{getattr(e, 'full_key', '?')}': {str(e).splitlines()[0]}") from None
    validate(obj)
    return obj


def _choice(path: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"'{path}' is '{value}', expected one of {', '.join(allowed)}{hint}")


# Range rules for numeric keys. Every int/float key must be a finite number >= 0 unless listed in
# MAY_BE_NEGATIVE; AT_LEAST_ONE keys, when set, must be >= 1; POSITIVE ones > 0; UNIT ones within [0, 1].
MAY_BE_NEGATIVE = {"objective.logit_mean", "dataset.params.tags.abs_min_score", "dataset.params.tags.min_score"}
AT_LEAST_ONE = {
    "distributed.flag_sync_every",
    "experiment.checkpoint_every", "experiment.keep_checkpoint_every", "experiment.sample_steps",
    "lr_scheduler.params.decay_length", "validation.every", "validation.num_batches", "model.ema.update_every",
    "dataset.params.consider_every_nth", "dataset.params.shuffle_buffer", "experiment.max_nonfinite_steps",
    "evaluation.threads", "evaluation.ref_max_images", "model.text_encoder.max_length", "dataset.params.bucket_step",
    "quickstart.shapes_samples", "quickstart.shapes_per_shard", "quickstart.shapes_size",
}
POSITIVE = {
    "distributed.bucket_cap_mb",
    "distributed.timeout_minutes", "experiment.save_every_minutes", "experiment.peak_tflops", "dataset.params.io_timeout",
    "objective.logit_std", "optimizer.params.epsilon",
}
UNIT = {
    "model.ema.decay", "model.ema.strength_target", "optimizer.params.beta1", "optimizer.params.beta2",
    "dataset.params.random_flip", "dataset.params.caption_dropout", "dataset.params.shuffle_tags",
    "lr_scheduler.params.min_lr_ratio",
}


def _value_at(cfg, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def check_ranges(cfg: TrainConfig) -> None:
    """Every numeric key of the schema against its range, at start-up: a bad value fails now, naming the
    key, rather than hours later (a ZeroDivisionError after warmup, gradient ascent from a negative
    clip norm, an EMA that diverges)."""
    import math

    for path, tp, _default, _help, is_section in schema_entries():
        if is_section or tp not in (int, float):
            continue
        v = _value_at(cfg, path)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isnan(v):
            raise ConfigError(f"'{path}' is NaN: set a number (a NaN often comes from an interpolation or a typo in the YAML)")
        if math.isinf(v):
            raise ConfigError(f"'{path}' is infinite ({v}): set a finite number")
        if path in UNIT and not 0.0 <= v <= 1.0:
            raise ConfigError(f"'{path}' must be within [0, 1], got {v}")
        if path in POSITIVE and v <= 0:
            raise ConfigError(f"'{path}' must be > 0, got {v}")
        if path in AT_LEAST_ONE and v < 1:
            raise ConfigError(f"'{path}' must be >= 1 when set, got {v} (leave it unset for the default)")
        if path not in MAY_BE_NEGATIVE and v < 0:
            raise ConfigError(f"'{path}' must be >= 0, got {v}")
    if cfg.optimizer.params.beta1 >= 1 or cfg.optimizer.params.beta2 >= 1:
        raise ConfigError("'optimizer.params.beta1' and 'beta2' must be < 1 (the moment estimates would never decay)")
    if cfg.experiment.sample_resolution is not None and cfg.experiment.sample_resolution % 8:
        raise ConfigError(f"'experiment.sample_resolution' must be a multiple of 8 (the VAE downsamples by 8), "
                          f"got {cfg.experiment.sample_resolution}")
    root = os.path.normpath(os.path.join(cfg.experiment.log_dir, cfg.experiment.name))
    if os.path.isabs(cfg.experiment.name) or os.path.relpath(root, cfg.experiment.log_dir).startswith(".."):
        raise ConfigError(f"'experiment.name' ({cfg.experiment.name}) leaves experiment.log_dir: use a plain name "
                          "(sub/folders are fine, '..' and absolute paths are not)")


def validate(cfg: TrainConfig) -> None:
    """Checks that need several keys or a closed set of values; world-size checks come at start-up."""
    check_ranges(cfg)
    radius = list(cfg.quickstart.shapes_radius)
    if len(radius) != 2 or not 0 < radius[0] <= radius[1] <= 0.5:
        raise ConfigError(f"'quickstart.shapes_radius' must be [low, high] with 0 < low <= high <= 0.5 (fractions of "
                          f"the image side), got {radius}")
    _choice("wandb.mode", cfg.wandb.mode, ("auto", "online", "offline", "disabled"))
    _choice("system.device", cfg.system.device, ("auto", "cpu", "cuda"))
    _choice("distributed.dist_backend", cfg.distributed.dist_backend, ("auto", "nccl", "gloo"))
    _choice("distributed.strategy", cfg.distributed.strategy, ("ddp", "fsdp"))
    _choice("distributed.grad_reduce_dtype", cfg.distributed.grad_reduce_dtype, ("fp32", "bf16"))
    _choice("distributed.fsdp_unit", cfg.distributed.fsdp_unit, ("layer", "block"))
    _choice("optimizer.name", cfg.optimizer.name, ("adamw", "adamw8bit", "adafactor", "sgd"))
    _choice("optimizer.implementation", cfg.optimizer.implementation, ("auto", "fused", "foreach", "for_loop"))
    _choice("lr_scheduler.scheduler", cfg.lr_scheduler.scheduler, ("Constant", "ConstantWithWarmup", "CosineWithWarmup", "LinearWithWarmup"))
    _choice("model.vae.dtype", cfg.model.vae.dtype, ("auto", "fp32", "bf16", "fp16"))
    _choice("model.train_target", cfg.model.train_target, ("unet", "vae"))
    _choice("model.vae.latent_sampling", cfg.model.vae.latent_sampling, ("sample", "mean"))
    latents = is_latent_type(cfg.dataset.type)
    if latents and getattr(cfg.dataset.params, "text_embeddings", False) and cfg.model.text_encoder.train:
        raise ConfigError("dataset.params.text_embeddings=true cannot train the text encoder (model.text_encoder.train)")
    _choice("model.ema.device", cfg.model.ema.device, ("auto", "cpu"))
    _choice("model.init_weights", cfg.model.init_weights, ("ema", "raw"))
    _choice("experiment.export_weights", cfg.experiment.export_weights, ("auto", "raw", "ema", "both"))
    _choice("experiment.sample_from", cfg.experiment.sample_from, ("auto", "raw", "ema", "both"))
    # YAML reads a bare on/off as a boolean: yes/no/true/false are accepted and mean on/off.
    cfg.experiment.progress_bar = {"yes": "on", "true": "on", "no": "off", "false": "off"}.get(
        str(cfg.experiment.progress_bar).lower(), cfg.experiment.progress_bar)
    _choice("experiment.progress_bar", cfg.experiment.progress_bar, ("auto", "on", "off"))
    _check_optimizer_keys(cfg.optimizer)
    if not cfg.model.use_ema:
        for key in ("export_weights", "sample_from"):
            if getattr(cfg.experiment, key) in ("ema", "both"):
                raise ConfigError(f"'experiment.{key}={getattr(cfg.experiment, key)}' needs model.use_ema=true")
    if cfg.model.use_ema and cfg.model.ema.device == "cpu" and cfg.distributed.strategy == "fsdp":
        raise ConfigError("'model.ema.device=cpu' is not supported with distributed.strategy=fsdp (the EMA is sharded like the UNet)")
    if cfg.model.ema.update_every < 1:
        raise ConfigError("'model.ema.update_every' must be >= 1")
    if cfg.model.ema.strength_target is not None and not 0 < cfg.model.ema.strength_target < 1:
        raise ConfigError("'model.ema.strength_target' must be within (0, 1)")
    if cfg.lr_scheduler.scheduler == "Constant" and cfg.lr_scheduler.params.warmup_length > 0:
        raise ConfigError("lr_scheduler.scheduler=Constant has no warmup: set lr_scheduler.params.warmup_length=0 or use ConstantWithWarmup")
    if cfg.experiment.max_nonfinite_steps < 1:
        raise ConfigError("'experiment.max_nonfinite_steps' must be >= 1")
    _choice("model.mixed_precision", cfg.model.mixed_precision, ("no", "bf16", "fp16"))
    _choice("model.attention", cfg.model.attention, ("sdpa", "xformers", "sliced"))
    for path, value in [
        ("system.batch_size", cfg.system.batch_size),
        ("system.gradient_accumulation", cfg.system.gradient_accumulation),
        ("experiment.num_examples_to_see", cfg.experiment.num_examples_to_see),
        ("experiment.save_every", cfg.experiment.save_every),
        ("experiment.log_every", cfg.experiment.log_every),
        ("dataset.params.resolution", cfg.dataset.params.resolution),
    ]:
        if value < 1:
            raise ConfigError(f"'{path}' must be >= 1, got {value}")
    if cfg.system.global_batch_size < 0:
        raise ConfigError(f"'system.global_batch_size' must be >= 0 (0: derived), got {cfg.system.global_batch_size}")
    if cfg.system.workers < 0:
        raise ConfigError(f"'system.workers' must be >= 0, got {cfg.system.workers}")
    if cfg.dataset.params.resolution % 8:
        raise ConfigError(f"'dataset.params.resolution' must be a multiple of 8 (the VAE downsamples by 8), got {cfg.dataset.params.resolution}")
    # Aliases kept for seed-001 configs: they must agree with the key that is actually used.
    for alias, used, a, b in [
        ("system.dist_backend", "distributed.dist_backend", cfg.system.dist_backend, cfg.distributed.dist_backend),
        ("system.dist_url", "distributed.dist_url", cfg.system.dist_url, cfg.distributed.dist_url),
        ("lr_scheduler.params.learning_rate", "optimizer.params.learning_rate",
         cfg.lr_scheduler.params.learning_rate, cfg.optimizer.params.learning_rate),
        ("dataset.params.num_examples_to_see", "experiment.num_examples_to_see",
         cfg.dataset.params.num_examples_to_see, cfg.experiment.num_examples_to_see),
    ]:
        if a != b and b == _value_at(TrainConfig(), used) and not (isinstance(a, str) and a.startswith("${")):
            # Only the alias was set (an older open-diffusion config): it is the user's value.
            section, key = used.rsplit(".", 1)
            setattr(_value_at(cfg, section), key, a)
        elif a != b:
            raise ConfigError(f"'{alias}' ({a}) differs from '{used}' ({b}); set only '{used}' (the alias follows it)")
    if cfg.lr_scheduler.params.warmup_length < 0:
        raise ConfigError("'lr_scheduler.params.warmup_length' must be >= 0")
    if not 0.0 <= cfg.lr_scheduler.params.min_lr_ratio <= 1.0:
        raise ConfigError("'lr_scheduler.params.min_lr_ratio' must be within [0, 1]")
    if cfg.lr_scheduler.scheduler not in ("CosineWithWarmup", "LinearWithWarmup"):
        if cfg.lr_scheduler.params.decay_length is not None or cfg.lr_scheduler.params.min_lr_ratio != 0.0:
            raise ConfigError("'lr_scheduler.params.decay_length' / 'min_lr_ratio' only apply to CosineWithWarmup and LinearWithWarmup")
    m = cfg.model
    if m.unet.params and m.unet.pretrained is not None:
        raise ConfigError("set either 'model.unet.pretrained' or 'model.unet.params' (from scratch), not both")
    if not m.pretrained:
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
    if cfg.model.text_encoder.train and cfg.distributed.strategy == "fsdp":
        raise ConfigError("'model.text_encoder.train' is not supported with distributed.strategy=fsdp (use ddp): the "
                          "text encoder is not sharded, and one gradient norm cannot mix sharded and plain gradients")
    if cfg.distributed.fsdp_cpu_offload and cfg.distributed.strategy != "fsdp":
        raise ConfigError("'distributed.fsdp_cpu_offload' applies to distributed.strategy=fsdp; set the strategy or remove it")
    if cfg.model.mixed_precision == "fp16" and cfg.distributed.strategy == "fsdp":
        raise ConfigError("'model.mixed_precision=fp16' is not supported with distributed.strategy=fsdp: each rank "
                          "would find fp16 overflows in its own shards and skip steps the others take. Use "
                          "model.mixed_precision=bf16 (GPUs since A100), or distributed.strategy=ddp for fp16")


# Keys of optimizer.params each optimizer reads (learning_rate, weight_decay, max_grad_norm: all).
_OPTIMIZER_KEYS = {
    "adamw": {"beta1", "beta2", "epsilon"},
    "adamw8bit": {"beta1", "beta2", "epsilon"},
    "adafactor": set(),
    "sgd": {"momentum"},
}


def _check_optimizer_keys(cfg: OptimizerConfig) -> None:
    """A hyper-parameter the chosen optimizer does not read must stay at its default (never ignored)."""
    defaults = OptimizerParams()
    for key in ("beta1", "beta2", "epsilon", "momentum"):
        if key not in _OPTIMIZER_KEYS[cfg.name] and getattr(cfg.params, key) != getattr(defaults, key):
            raise ConfigError(f"'optimizer.params.{key}' does not apply to optimizer.name={cfg.name}; remove it")
    if cfg.name != "adamw" and cfg.implementation != "auto":
        raise ConfigError(f"'optimizer.implementation' only applies to adamw, not {cfg.name}")
    if cfg.name != "sgd" and cfg.nesterov:
        raise ConfigError("'optimizer.nesterov' only applies to optimizer.name=sgd")


# ----------------------------------------------------------------------------------------------
# Output.
# ----------------------------------------------------------------------------------------------


REDACTED = "<redacted>"


def public_dict(cfg: TrainConfig) -> dict:
    """The resolved config as plain containers, secrets replaced: what config.yaml, checkpoints and the
    wandb run config hold. ``wandb.api_key`` never leaves the process (the run uses it, nothing stores it)."""
    out = OmegaConf.to_container(OmegaConf.structured(cfg))
    if out.get("wandb", {}).get("api_key"):
        out["wandb"]["api_key"] = REDACTED
    return out


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML, secrets redacted (written into the run directory, loadable with config=...)."""
    return OmegaConf.to_yaml(OmegaConf.create(public_dict(cfg)))


def help_text() -> str:
    lines = ["usage: python train.py config=path/to/run.yaml [key.sub=value ...]", "",
             "Precedence: schema defaults < YAML < command line. ??? = required.", ""]
    for path, tp, default, help_, is_section in schema_entries():
        depth = path.count(".")
        if is_section:
            lines.append(f"{'  ' * depth}{path.rsplit('.', 1)[-1]}:  # {help_}")
            continue
        shown = "???" if default == MISSING else repr(default) if isinstance(default, str) else default
        if isinstance(shown, (ListConfig, DictConfig)):
            shown = OmegaConf.to_container(shown)
        lines.append(f"{'  ' * depth}{path.rsplit('.', 1)[-1]}: {shown}  # {help_}")
    return "\n".join(lines)
