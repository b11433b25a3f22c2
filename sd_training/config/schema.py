"""The config schema: every section as a plain dataclass, each field ``f(default, help, choices=...,
ranges)``. The ground floor: imports nothing of sd_training outside ``config/`` (and no torch).

The sections here are the ones every run reads. A part that owns more keys (a family's second text
encoder, the autoencoder stage's losses, adapters) declares them in a dataclass of its own and hands it to
:func:`register_fields`; the schema the loader checks and builds (:func:`train_config_class`) is these
sections plus every registered one. ``sd_training.families.options`` registers the families' fields when
``sd_training`` is imported, so every entry point sees the whole schema.

Section and key names follow open-diffusion's template config so an existing config runs once its
``???`` are filled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Dict, List, Optional, get_args, get_origin, get_type_hints

from omegaconf import MISSING

from .dataset import DatasetConfig
from .fields import ComponentConfig, f

# Precision names (sd_training.speed.precision maps them to torch dtypes).
PRECISIONS = ("no", "bf16", "fp16")  # model.mixed_precision: the step's compute precision
WEIGHT_DTYPES = ("fp32", "bf16", "fp16")  # a frozen component's stored weights (besides auto)
TEXT_PLACEMENTS = ("auto", "device", "cpu", "offload")  # model.text_encoder_placement
STRATEGIES = ("ddp", "fsdp", "hsdp")  # distributed.strategy
SHARDED_STRATEGIES = ("fsdp", "hsdp")  # FSDP2: sharded parameters (DTensors), DCP checkpoints
SCHEDULERS = ("Constant", "ConstantWithWarmup", "CosineWithWarmup", "LinearWithWarmup")
OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "sgd", "prodigy", "lion", "adamw_schedulefree", "came")


@dataclass
class ObjectiveConfig:
    """The ``objective`` section (the diffusion loss); checked by ``sd_training.families.components.ddpm``."""

    prediction_type: Optional[str] = f(
        None, "what the UNet predicts (None: the training scheduler's own prediction_type)",
        choices=("epsilon", "v_prediction", "sample"),
    )
    loss_weighting: str = f("none", "per-sample loss weight (min_snr: min(SNR, snr_gamma) in x0 units)", choices=("none", "min_snr"))
    snr_gamma: float = f(5.0, "min_snr: the SNR cap gamma (dimensionless; 5 in Hang et al.)")
    noise_offset: float = f(0.0, "std of the per-channel constant (zero-frequency) noise added to the unit noise (0: off)")
    pyramid_noise_discount: float = f(0.0, "multi-resolution noise: weight ratio between successive coarser levels, in [0, 1) (0: off)")
    input_perturbation: float = f(0.0, "std of extra noise added to the UNet input only, in units of the noise (0: off)")
    zero_terminal_snr: bool = f(False, "rescale betas to SNR 0 at the last timestep (Lin et al.); needs v_prediction or sample")
    timestep_sampling: str = f("uniform", "distribution of training timesteps", choices=("uniform", "logit_normal"))
    logit_mean: float = f(0.0, "logit_normal: mean of the normal in logit(t / num_train_timesteps) units", ge=None)
    logit_std: float = f(1.0, "logit_normal: std of the normal in logit(t / num_train_timesteps) units", gt=0)


@dataclass
class TextEncoderConfig:
    """``model.text_encoder``; checked and built by ``sd_training.families.components.clip``."""

    pretrained: Optional[str] = f(
        None, "type clip: pipeline root or text_encoder folder, local path or hub id (None: model.pretrained)"
    )
    type: str = f("clip", "clip: a transformers CLIPTextModel folder (SD 1.x, SD 2.x); open_clip: open_clip_model + open_clip_weights",
                  choices=("clip", "open_clip"))
    open_clip_model: Optional[str] = f(None, "type open_clip: architecture name, e.g. ViT-H-14, or local-dir:FOLDER with open_clip_config.json")
    open_clip_weights: Optional[str] = f(None, "type open_clip: local path of the checkpoint file (.bin / .pt / .safetensors)")
    clip_skip: int = f(0, "layers counted back from the last: 0 or 1 = last, 2 = penultimate (kohya/EveryDream); baked into exports")
    max_length: Optional[int] = f(None, "tokens per caption, start and end tokens included (None: the tokenizer's model_max_length, 77)", ge=1)
    train: bool = f(False, "train the text encoder with the UNet (False: frozen, eval mode, no gradients)")
    learning_rate: Optional[float] = f(None, "train: peak learning rate of the text encoder, same schedule (None: optimizer.params.learning_rate)")
    dtype: str = f("auto", "frozen text encoder weights (auto: the training precision: bf16 under bf16, fp16 under fp16, else fp32; train: fp32 or auto)",
                   choices=("auto", *WEIGHT_DTYPES))


@dataclass
class WandbConfig:
    mode: str = f("auto", "auto: online when wandb has credentials, else offline", choices=("auto", "online", "offline", "disabled"))
    project: str = f("${experiment.project}", "wandb project")
    entity: Optional[str] = f(None, "wandb team or user (None: wandb's default entity)")
    api_key: Optional[str] = f(None, "discouraged: prefer the WANDB_API_KEY environment variable or `wandb login`")
    tags: List[str] = f([], "tags attached to the wandb run")


@dataclass
class SystemConfig:
    gradient_accumulation: int = f(1, "micro-batches per optimizer step (leave at 1 with global_batch_size)", ge=1)
    global_batch_size: int = f(0, "images per optimizer step over all ranks; when set, the accumulation is derived from it, the batch size and the rank count, so a resume on another rank count keeps it (0: batch_size x gradient_accumulation x ranks)")
    batch_size: int = f(32, "images per device per micro-batch", ge=1)
    workers: int = f(6, "data-loading worker processes per device (SLURM: cpus-per-task)")
    dist_backend: str = f("${distributed.dist_backend}", "alias of distributed.dist_backend (must agree with it)")
    dist_url: str = f("${distributed.dist_url}", "alias of distributed.dist_url (must agree with it)")
    device: str = f("auto", "auto: cuda when available, else cpu", choices=("auto", "cpu", "cuda"))
    seed: int = f(0, "global seed; each rank derives its own from it", ge=None)
    tf32: bool = f(True, "CUDA: fp32 matmuls and convolutions use TF32 tensor cores (Ampere and newer; the frozen fp32 parts, fp32 training); False: full fp32")
    stop_timeout_s: float = f(120.0, "seconds a run has after SIGTERM/SIGINT to finish its step, save and exit; past it, or 10 s after the signal with the main thread stuck in one call (a collective whose peer died), it exits with code 75 without saving (the newest complete checkpoint stands)", gt=0)


@dataclass
class DistributedConfig:
    dist_backend: str = f("auto", "auto: nccl on CUDA, gloo on CPU", choices=("auto", "nccl", "gloo"))
    dist_url: str = f("env://", "process-group init method; env:// reads MASTER_ADDR/MASTER_PORT")
    timeout_minutes: float = f(30.0, "minutes a collective may wait before the job fails", gt=0)
    strategy: str = f("ddp", "ddp: replicated UNet; fsdp: FSDP2 fully_shard per UNet block over all ranks, sharded checkpoints; hsdp: FSDP2 on a 2-D mesh: sharded inside groups of distributed.hsdp_shard_size ranks (one node), replicated across them (gradients all-reduced between nodes)", choices=STRATEGIES)
    hsdp_shard_size: int = f(0, "hsdp: ranks per shard group; must divide the rank count (0: the ranks of one node, torchrun's LOCAL_WORLD_SIZE or SLURM's tasks per node)", ge=0)
    peer_timeout_s: float = f(300.0, "seconds a rank may send no heartbeat (died or stopped without the launcher noticing) before every other rank exits with code 75 for a requeue; saves, exports and waits in collectives keep beating (0: off)", ge=0)
    bucket_cap_mb: float = f(25.0, "ddp: gradient bucket size in MB (larger: fewer, bigger all-reduces)", gt=0)
    static_graph: bool = f(False, "ddp: the graph is the same every step (no unused parameters): lets DDP overlap more")
    grad_reduce_dtype: str = f("fp32", "dtype gradients are reduced in (bf16: half the traffic; ddp: a compression hook, fsdp and hsdp: reduce_dtype)", choices=("fp32", "bf16"))
    fsdp_unit: str = f("layer", "fsdp, hsdp: shard units: layer: each resnet and transformer block; block: each down/mid/up block", choices=("layer", "block"))
    fsdp_cpu_offload: bool = f(False, "fsdp, hsdp: keep the weight, gradient, optimizer and EMA shards in pinned CPU memory (CPUOffloadPolicy; the optimizer steps on the CPU): fits larger models in less GPU memory, slower")
    reshard_after_forward: bool = f(True, "fsdp, hsdp: free the gathered parameters after the forward (less memory; False: no re-gather in backward)")
    flag_sync_every: int = f(10, "optimizer steps between the host checks: the ranks agree on a stop signal or a timed save, the non-finite counters are read (1: every step)", ge=1)


@dataclass
class ExperimentConfig:
    log_dir: str = f("runs", "directory that holds run directories")
    name: str = f(MISSING, "run name: the run directory is log_dir/name")
    project: str = f("sd-training", "project name (the wandb project by default)")
    num_examples_to_see: int = f(MISSING, "images to train on, all devices together", ge=1)
    save_every: int = f(2000, "optimizer steps between exported pipelines (and at the end)", ge=1)
    save_only_most_recent: bool = f(True, "keep only the newest exported pipeline (pipelines/current)")
    checkpoint_every: Optional[int] = f(None, "optimizer steps between resume checkpoints (None: save_every)", ge=1)
    save_every_minutes: Optional[float] = f(None, "also write a resume checkpoint after this many minutes since the last one", gt=0)
    checkpoint_async: bool = f(True, "write resume checkpoints in a background thread: the step waits only for a copy to host memory (FSDP's sharded state is written synchronously)")
    keep_last_checkpoints: int = f(2, "complete resume checkpoints kept (older ones are deleted)")
    checkpoint_verify: str = f("full", "what a checkpoint's COMPLETE marker records and a resume checks: full (every file's size and CRC32, ~0.4 s per GB, hashed by the rank that wrote it, in the background writer when asynchronous) or sizes (no checksum: cut or missing files are still found)", choices=("full", "sizes"))
    keep_checkpoint_every: Optional[int] = f(None, "optimizer steps: checkpoints at multiples of this are kept forever", ge=1)
    resume: bool = f(True, "continue from the newest complete checkpoint in the run directory, if any")
    start_fresh: bool = f(False, "a run directory that holds checkpoints: move its contents aside (<name>.old-<time>) and start over")
    allow_config_change: bool = f(False, "resume although keys that change the training differ from the checkpoint's config")
    max_nonfinite_steps: int = f(10, "consecutive optimizer steps with a non-finite loss or gradient before the run saves and stops", ge=1)
    max_zero_weight_steps: int = f(100, "consecutive optimizer steps with an exactly zero gradient (every sample's loss weight 0, e.g. all-black masks) before the run stops with a data error; such steps are skipped (no update, no weight decay) and warned about (0: never stop)", ge=0)
    export_weights: str = f("auto", "pipelines exported (auto: raw, plus ema with model.use_ema)", choices=("auto", "raw", "ema", "both"))
    sample_from: str = f("auto", "weights of the sample grids (auto: ema with model.use_ema, else raw)", choices=("auto", "raw", "ema", "both"))
    requeue: bool = f(True, "on SIGUSR1/SIGTERM under SLURM: save, then `scontrol requeue` the job")
    log_every: int = f(10, "optimizer steps between metric lines", ge=1)
    record_sample_keys: bool = f(False, "write the keys of every step's samples to sample_keys/rank_<N>.jsonl (which data each step trained on; compare runs and layouts)")
    progress_bar: str = f("auto", "live progress bar (auto: on an interactive terminal, not under SLURM batch; yes/no/true/false mean on/off)", choices=("auto", "on", "off"))
    tensorboard: bool = f(False, "also write tensorboard event files to <run>/tensorboard")
    report: bool = f(True, "rank 0 rewrites <run>/report.html at every export: a self-contained page (summary, loss by timestep quartile, validation loss, lr, images/s per device, MFU, data wait, mixture shares, gradient norm, skipped steps; the sample grids over time), its plots also as PNGs in <run>/report/. Needs matplotlib (pip install 'sd-training[plots]'; without it: one warning, no report); a failure to draw is a warning, training goes on")
    peak_tflops: Optional[float] = f(None, "peak dense TFLOP/s of one device for MFU (None: the A100/H100/H200 table; CPU: no MFU)", gt=0)
    sample_prompts: List[str] = f(
        ["a photo of a cat", "a red circle on a blue background", "a painting of a lighthouse at sunset"],
        "prompts of the sample grid written with each exported pipeline",
    )
    sample_per_prompt: int = f(4, "images per prompt in the sample grid (seeds sample_seed, sample_seed+1, ...)")
    sample_references: List[Any] = f([], "edit families (Flux Kontext, Qwen-Image-Edit, FLUX.2 references): one entry per sample_prompts entry, its reference image path or a list of paths, resized to the sample size (cover, center crop); the grid shows each prompt's references, then its images. An edit family that samples needs them")
    eval_caption_file: Optional[str] = f(None, "prompt file (.txt one per line, or .csv with a caption column) for eval images")
    eval_reference_file: Optional[str] = f(None, "edit families: one line per eval_caption_file prompt, its reference image path(s) tab-separated, relative to this file's folder; needed for their eval images")
    num_eval_images: int = f(0, "images generated from eval_caption_file at each export, split across ranks (0: none)")
    sample_seed: int = f(0, "first generator seed of the sample grid (fixed, so grids compare across steps)", ge=None)
    sample_steps: int = f(25, "denoising steps per sample", ge=1)
    sample_guidance_scale: float = f(7.5, "classifier-free guidance scale of the samples")
    sample_resolution: Optional[int] = f(None, "pixels of the samples, a multiple of 8, at most 8192 (None: dataset.params.resolution)", ge=8, le=8192)
    model_card_template: Optional[str] = f(None, "Jinja2 template file of the model card (README.md) written into every export, with the variables of the shipped one (None: sd_training/outputs/templates/model_card.md); rendered at start-up, so an error names the file and line before training")
    model_card_license: Optional[str] = f(None, "license id in the exports' model cards, e.g. apache-2.0 or creativeml-openrail-m (None: the base pipeline's, read from its README.md card when it has one; else none)")


@dataclass
class OptimizerParams:
    learning_rate: float = f(1e-4, "peak learning rate (prodigy: the multiplier of the step size it estimates, 1.0; below 0.1 is refused)")
    beta1: float = f(0.9, "first-moment decay (adamw, adamw8bit, prodigy, adamw_schedulefree: its interpolation; lion: the update's; came)", le=1)
    beta2: float = f(0.999, "second-moment decay (adamw, adamw8bit, prodigy, adamw_schedulefree, came; lion: its momentum's, 0.99 in the paper)", le=1)
    beta3: Optional[float] = f(None, "came: the residual's decay (None: 0.9999); prodigy: the decay of its step-size estimate (None: sqrt(beta2))", le=1)
    weight_decay: float = f(0.01, "weight decay, decoupled (adamw, adamw8bit, prodigy, lion, came; adamw_schedulefree: at the interpolated point, as its authors do)")
    epsilon: float = f(1e-8, "denominator epsilon (adamw, adamw8bit, prodigy, adamw_schedulefree)", gt=0)
    momentum: float = f(0.0, "SGD momentum")
    d_coef: float = f(1.0, "prodigy: multiplies its estimated step size d (below 1: smaller steps, e.g. 0.5 against overfitting; above 1: larger)", gt=0)
    use_bias_correction: bool = f(False, "prodigy: Adam's bias correction of the moments (its authors advise it for diffusion fine-tunes)")
    safeguard_warmup: bool = f(False, "prodigy: keep the LR warmup out of the step-size estimate (its authors advise it with lr_scheduler warmup)")
    max_grad_norm: Optional[float] = f(1.0, "clip the gradient norm to this after accumulation (None: no clipping)")


@dataclass
class OptimizerConfig:
    name: str = f("adamw", "the optimizer (adamw8bit: bitsandbytes; prodigy, lion, adamw_schedulefree, came: pytorch-optimizer). prodigy: learning_rate 1.0 (it estimates the step size; ddp or one process); lion: an LR 3-10x below AdamW's, weight decay 3-10x above; adamw_schedulefree: a constant LR after warmup (no decay), exports its averaged weights; came: ddp or one process", choices=OPTIMIZERS)
    params: OptimizerParams = f(OptimizerParams, "optimizer hyper-parameters")
    implementation: str = f("auto", "adamw kernels (auto: fused on CUDA, for_loop on CPU)", choices=("auto", "fused", "foreach", "for_loop"))
    nesterov: bool = f(False, "sgd: Nesterov momentum")
    scale_lr: bool = f(False, "multiply the peak LR by (global batch)^0.55 (EveryDream2's rule; the result is logged)")
    no_decay_norm_and_bias: bool = f(True, "no weight decay on normalisation weights and biases")
    in_backward: bool = f(False, "update each parameter in the backward pass as soon as its gradient is complete, then free that gradient (kohya's fused backward pass): the gradients of the whole net never exist at once. One process or fsdp (not ddp on several ranks), no gradient accumulation, no clipping (max_grad_norm: null), not with fp16")


@dataclass
class LRSchedulerParams:
    learning_rate: float = f("${optimizer.params.learning_rate}", "peak learning rate (must agree with the optimizer's)")
    warmup_length: int = f(500, "optimizer steps of linear warmup from 0")
    decay_length: Optional[int] = f(None, "Cosine/LinearWithWarmup: optimizer steps of decay after warmup (None: to the end)", ge=1)
    min_lr_ratio: float = f(0.0, "Cosine/LinearWithWarmup: the final learning rate as a fraction of the peak", le=1)


@dataclass
class LRSchedulerConfig:
    scheduler: str = f("ConstantWithWarmup", "the learning-rate schedule", choices=SCHEDULERS)
    params: LRSchedulerParams = f(LRSchedulerParams, "schedule parameters, counted in optimizer steps")


@dataclass
class VAEConfig:
    pretrained: Optional[str] = f(None, "pipeline root or vae folder (None: from model.pretrained)")
    dtype: str = f("auto", "frozen VAE weights (auto: bf16 under bf16, else fp32; fp16: upcast to fp32 on overflow)", choices=("auto", *WEIGHT_DTYPES))
    latent_sampling: str = f("sample", "latents of online encoding (sample: of the posterior, as SD trains; mean: its mean)", choices=("sample", "mean"))
    placement: str = f("auto", "where the frozen VAE lives between uses. device: on the training device; offload: in host "
                       "memory, moved onto the device for sample grids, eval images and the validation batches' "
                       "encode, and back (the steps must not need it: latent shards); auto: offload when the batches "
                       "are latent shards, else device", choices=("auto", "device", "offload"))


@dataclass
class UNetConfig:
    pretrained: Optional[str] = f(None, "pipeline root or unet folder to start from (None: model.pretrained, else from scratch)")
    target: str = f("UNet2DConditionModel", "diffusers UNet class used for from-scratch training")
    params: Dict[str, Any] = f({}, "constructor arguments of target for from-scratch training")


@dataclass
class EMAConfig:
    decay: float = f(0.9999, "EMA decay per update", le=1)
    update_every: int = f(1, "optimizer steps between EMA updates", ge=1)
    start_step: int = f(0, "optimizer steps during which the EMA copies the weights instead of averaging")
    warmup: bool = f(False, "ramp the decay as min(decay, (1 + n) / (10 + n)) over the first n updates")
    device: str = f("auto", "auto: the UNet's device; cpu (seed 000): saves accelerator memory, use a larger update_every", choices=("auto", "cpu"))
    strength_target: Optional[float] = f(None, "EveryDream2: derive decay so decay^(updates in the run) = this (overrides decay; logged)", le=1)
    path: Optional[str] = f(None, "pipeline root or unet folder holding EMA weights to start from (None: copy of the UNet)")


@dataclass
class CommonModelFields:
    """The ``model`` section's fields every family reads."""

    pretrained: Optional[str] = f(None, "diffusers pipeline: local folder or hub id (the default for every component)")
    family: str = f("auto", "auto (from the pipeline's model_index.json) or a family name (sd_training.families.registry)")
    revision: Optional[str] = f(None, "hub revision of the pretrained pipeline")
    vae: VAEConfig = f(VAEConfig, "the frozen autoencoder")
    text_encoder: TextEncoderConfig = f(TextEncoderConfig, "the text encoder (frozen unless train)")
    tokenizer: ComponentConfig = f(ComponentConfig, "the tokenizer")
    text_encoder_placement: str = f(
        "auto", "where the frozen text encoders (all of the family's) live. device: on the training device for the "
        "whole run; cpu: in host memory, and they run there (their inputs and outputs moved); offload: in host "
        "memory, moved onto the device for each use (a sample grid, eval images, a batch encoded online) and back; "
        "auto: offload when the batches carry stored text states (dataset.params.text_embeddings), else device",
        choices=TEXT_PLACEMENTS)
    noise_scheduler_training: ComponentConfig = f(ComponentConfig, "scheduler config for training noise (built as DDPMScheduler)")
    noise_scheduler_inference: ComponentConfig = f(ComponentConfig, "scheduler of exported pipelines and samples (its own class)")
    unet: UNetConfig = f(UNetConfig, "the trained UNet")
    train_target: str = f("unet", "what trains: unet: the diffusion model; vae: the pipeline's autoencoder (its own section)", choices=("unet", "vae"))
    use_ema: bool = f(False, "keep an exponential moving average of the UNet weights; exported as pipelines/*_ema")
    ema: EMAConfig = f(EMAConfig, "EMA settings")
    mixed_precision: str = f("no", "compute precision (fp16 uses a gradient scaler)", choices=PRECISIONS)
    gradient_checkpointing: bool = f(False, "recompute activations in backward (~40% slower, much less memory)")
    xformers: bool = f(False, "use xformers memory-efficient attention (falls back to SDPA, with a warning, where unavailable)")
    attention: str = f("sdpa", "attention backend (model.xformers=True means xformers)", choices=("sdpa", "xformers", "sliced"))
    channels_last: str = f("auto", "UNet (and frozen VAE) weights and inputs in channels-last memory format: cuDNN's "
                           "convolutions then need no NCHW<->NHWC transposes (auto: on for the UNet families on CUDA; "
                           "true/false mean on/off)", choices=("auto", "on", "off"))
    compile: bool = f(False, "torch.compile the UNet (minutes of compilation; saved weights never carry its prefix)")
    compile_scope: str = f("auto", "model.compile: blocks: the family's repeated blocks one by one (UNets: each ResNet "
                           "and attention block; transformers: each transformer block; a shorter warm-up, graphs "
                           "reused by blocks of one shape); whole: the whole loss module as one graph (fewest graph "
                           "breaks); auto: the family's choice (UNets: whole; transformers: blocks)",
                           choices=("auto", "blocks", "whole"))
    compile_mode: str = f("default", "model.compile: torch.compile's mode. reduce-overhead adds CUDA graphs (one launch "
                          "per graph instead of one per kernel; CUDA only: on the CPU it compiles as default; more "
                          "memory), max-autotune also searches kernel configurations (a longer warm-up), "
                          "max-autotune-no-cudagraphs the search alone",
                          choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    fp8: bool = f(False, "train the Linear layers of the net's repeated blocks (the transformer blocks) in float8 with "
                  "torchao (sd_training.speed.fp8; FP8 GPUs: H100, L40S, RTX 4090; pays with model.compile)")
    block_swap: int = f(0, "blocks of the trained net kept in host memory and streamed through the device, each "
                        "copied in ahead of its forward and of its backward (sd_training.speed.block_swap; 0: "
                        "none). Needs model.gradient_checkpointing; a full fine-tune needs optimizer.in_backward",
                        ge=0)
    compile_cache: Optional[str] = f(None, "model.compile: folder of the compiler's cache artifacts (torch >= 2.7 "
                                     "mega-cache), loaded before compiling and saved once the first step compiled, so "
                                     "a requeued job skips most of the warm-up (None: <run folder>/compile_cache)")
    init_from: Optional[str] = f(None, "stage 2: start the UNet from another run's dir, checkpoint (step_N) or exported pipeline")
    init_weights: str = f("ema", "with init_from (ema: when present, else raw)", choices=("ema", "raw"))


@dataclass
class ModelConfig(CommonModelFields):
    """The ``model`` section: the shared fields; the loader's class adds the registered owners' fields
    (:func:`model_config_class`)."""


@dataclass
class QuickstartConfig:
    tiny_pipeline: Optional[str] = f(None, "folder: build a tiny random-weight pipeline here when absent (point model.pretrained at it)")
    tiny_family: Optional[str] = f(None, "the family of the tiny pipeline built in tiny_pipeline: a name in families.registry (None: its default)")
    shapes_dataset: Optional[str] = f(None, "folder: write generated-shapes WebDataset shards here when absent")
    shapes_samples: int = f(2000, "images in the generated-shapes dataset", ge=1)
    shapes_per_shard: int = f(250, "images per generated shard", ge=1)
    shapes_size: int = f(64, "pixels (square) of the generated images", ge=1)
    shapes_radius: List[float] = f([0.25, 0.4], "range of a shape's half-size, as a fraction of the image side")
    shapes_offset: float = f(0.1, "largest shift of a shape's centre from the image centre, as a fraction of the side")
    word_dataset: Optional[str] = f(None, "folder: write images of a made-up word here when absent (quickstart.word_*: "
                                    "'a dax on a red background'; configs/quickstart_lora.yaml teaches it with a LoRA)")
    word: str = f("dax", "the made-up word (one CLIP token is best: it starts untrained in the quickstart's text encoder)")
    word_shape: str = f("triangle", "the shape the word names", choices=("circle", "square", "triangle", "diamond"))
    word_colour: str = f("purple", "the colour the word names (one of the shapes' 8 colours, none of word_backgrounds)")
    word_backgrounds: List[str] = f(["red", "blue", "yellow", "orange", "black"], "backgrounds of the word's images "
                                    "(the other colours stay held out: prompts a test can check)")
    word_samples: int = f(500, "images of the word (in word_dataset, 2 shards)", ge=2)


@dataclass
class ValidationConfig:
    path: Optional[str] = f(None, "held-out shards (same format as dataset.params.path); None: no validation")
    num_batches: int = f(4, "batches per rank, read once and kept: every validation scores the same images", ge=1)
    every: Optional[int] = f(None, "optimizer steps between validations (None: experiment.save_every); also at step 0", ge=1)
    seed: int = f(1234, "seed of the fixed noise and timesteps, so the loss compares across steps and restarts", ge=None)


@dataclass
class EvaluationConfig:
    ref_stats: Optional[str] = f(None, ".npz FID reference statistics: read if present, else written from ref_images")
    ref_images: Optional[str] = f(None, "FID reference set: image folder or WebDataset shards (held-out data)")
    ref_max_images: Optional[int] = f(None, "images of the reference set used (None: all)", ge=1)
    clip_model: Optional[str] = f(None, "open_clip model name for CLIP score (e.g. ViT-L-14), or local-dir:PATH")
    clip_pretrained: Optional[str] = f(None, "local weights file of clip_model (nothing is downloaded)")
    clip_config: Optional[str] = f(None, "open_clip model config .json defining clip_model, when open_clip does not bundle it")
    asynchronous: bool = f(True, "score in a background process so training does not wait (results logged with their step)")
    threads: Optional[int] = f(None, "CPU threads of the background evaluation (None: torch's default)", ge=1)
    device: str = f("cpu", "device of Inception / CLIP: cpu, cuda (cuda:N) or auto (a torch device name, not checked here)")


@dataclass
class CommonSections:
    """The top-level sections every run reads."""

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
    quickstart: QuickstartConfig = f(QuickstartConfig, "generated model and data for runs with no downloads (configs/quickstart.yaml)")


@dataclass
class TrainConfig(CommonSections):
    """The whole config's shared sections; the loader's class adds the registered owners' sections and
    ``model`` fields (:func:`train_config_class`). A loaded config is an instance of a subclass of this."""


# ----------------------------------------------------------------------------------------------
# Owners' fields: registered by the part that reads them, composed into the loader's classes.
# ----------------------------------------------------------------------------------------------

_MODEL_FIELDS: list[type] = []  # dataclasses whose fields join the ``model`` section, in registration order
_SECTIONS: list[type] = []  # dataclasses whose fields are top-level sections
_COMPOSED: dict[tuple, tuple[type, type]] = {}
# Names the composed classes are reachable by in this module (pickling, e.g. a config sent to a spawned
# worker, stores a class by module and name; the module's ``__getattr__`` below builds them on demand).
COMPOSED_MODEL = "ComposedModelConfig"
COMPOSED_TRAIN = "ComposedTrainConfig"


def register_fields(*, model: type | None = None, sections: type | None = None) -> None:
    """Add an owner's keys to the schema: ``model``, a dataclass whose fields join the ``model`` section;
    ``sections``, a dataclass whose fields are top-level sections. Registering the same class twice is a
    no-op; a key that is already in the schema is a ``ValueError`` (two owners of one key)."""
    for cls, into, base in ((model, _MODEL_FIELDS, ModelConfig), (sections, _SECTIONS, TrainConfig)):
        if cls is None or cls in into:
            continue
        if not is_dataclass(cls):
            raise TypeError(f"register_fields takes dataclasses, got {cls!r}")
        taken = {f.name for f in fields(base)} | {f.name for c in into for f in fields(c)}
        clash = sorted(taken & {f.name for f in fields(cls)})
        if clash:
            raise ValueError(f"{cls.__qualname__} declares {', '.join(clash)}, already in the schema")
        into.append(cls)


def _compose() -> tuple[type, type]:
    """(model class, whole-config class) of the shared sections plus every registered owner's fields,
    built once per set of registrations. Later registrations' fields come after earlier ones', all after
    the shared fields (the order of ``--help`` and of a run's config.yaml)."""
    key = (tuple(_MODEL_FIELDS), tuple(_SECTIONS))
    if key not in _COMPOSED:
        model_cls = dataclasses.make_dataclass(COMPOSED_MODEL, [], bases=(*reversed(_MODEL_FIELDS), ModelConfig))
        shared_model = next(f for f in fields(TrainConfig) if f.name == "model")
        model_field = dataclasses.field(default_factory=model_cls, metadata=shared_model.metadata)
        train_cls = dataclasses.make_dataclass(COMPOSED_TRAIN, [("model", model_cls, model_field)],
                                               bases=(*reversed(_SECTIONS), TrainConfig))
        for cls, doc in ((model_cls, ModelConfig.__doc__), (train_cls, TrainConfig.__doc__)):
            cls.__module__, cls.__doc__ = __name__, doc
        _COMPOSED[key] = (model_cls, train_cls)
    return _COMPOSED[key]


def model_config_class() -> type:
    """The ``model`` section's class: :class:`ModelConfig` plus the registered owners' model fields."""
    return _compose()[0]


def train_config_class() -> type:
    """The class a loaded config is an instance of: :class:`TrainConfig` plus every registered owner's
    sections and model fields."""
    return _compose()[1]


def __getattr__(name: str):
    if name == COMPOSED_MODEL:
        return model_config_class()
    if name == COMPOSED_TRAIN:
        return train_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")



# ----------------------------------------------------------------------------------------------
# Schema walking: the valid key paths, free-form dict fields, help text.
# ----------------------------------------------------------------------------------------------


def is_free_dict(tp) -> bool:
    return tp is dict or get_origin(tp) in (dict, Dict)


def unwrap_optional(tp):
    args = [a for a in get_args(tp) if a is not type(None)]
    return args[0] if get_origin(tp) is not None and len(args) == 1 and type(None) in get_args(tp) else tp


def schema_entries(cls=None, prefix: str = ""):
    """Yield (path, type, default, field metadata, is_section) for every field of the schema (None: the
    whole config, registered owners' fields included), depth first."""
    cls = train_config_class() if cls is None else cls
    hints = get_type_hints(cls)
    instance = cls()
    for fld in fields(cls):
        path = f"{prefix}{fld.name}"
        tp = unwrap_optional(hints[fld.name])
        if is_dataclass(tp):
            yield path, tp, None, fld.metadata, True
            yield from schema_entries(tp, path + ".")
        else:
            yield path, tp, getattr(instance, fld.name), fld.metadata, False

