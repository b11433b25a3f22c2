"""What a model family tells the trainer.

The trainer (``loop.py``), checkpointing, the strategies and the export code name no family: they hold
a :class:`Family` and call the methods below: how its components are built from ``model.*``, which module
trains, how a batch becomes a loss (its conditioning included), what the exported diffusers pipeline is,
how samples are made, and its FLOPs per image for MFU; and, with no run (classmethods), its tiny
random-weight pipeline (:meth:`Family.make_tiny_pipeline`) and how its captions are stored in latent shards
(:meth:`Family.text_encoding`).

A family is a small module on one of two bases (``pipeline_family.py`` holds what both share):
``unet_family.UNetFamily`` (SD in ``sd.py``, SDXL in ``sdxl.py``) and ``flow_family.FlowFamily`` (SD3 in
``sd3.py``, Flux in ``flux.py``), composing the components of ``components/`` (objectives, text encoders,
the VAE encode, the nets). ``autoencoder.py`` trains a UNet pipeline's VAE on top of its family. Adding a
family is its module and one line in ``registry.FAMILIES``.
"""

from __future__ import annotations

import abc
import contextlib
from pathlib import Path
from typing import Any, NamedTuple

import torch
from PIL import Image

from ..config.schema import TrainConfig
from ..memory.activations import SampleShape
from ..speed.flops import StepFlops
from .components.placement import off_device
from .components.text import TextEncoding
from .reference_models import ReferenceModel


class LossOut(NamedTuple):
    loss: torch.Tensor  # the micro-batch's mean loss (what is back-propagated)
    per_sample: torch.Tensor  # detached per-sample losses
    timesteps: torch.Tensor | None  # the per-sample timesteps (None: no timesteps, e.g. the autoencoder)
    parts: dict | None  # named loss terms logged as ``<family>/<name>`` (None: none)


class SampleSettings(NamedTuple):
    """What the trainer asks of a sample grid or of eval images; families read what applies."""

    prompts: list[str]
    per_prompt: int
    seed: int
    steps: int
    guidance: float
    resolution: int
    dtype: torch.dtype | None  # autocast dtype of sampling (None: fp32)
    # edit families: each prompt's reference image paths (``experiment.sample_references``, or the eval
    # prompts' ``experiment.eval_reference_file``), one list per prompt; () for text-to-image sampling
    references: tuple = ()


class PixelGrid(NamedTuple):
    """The image sides a trained module takes (``Family.pixel_grid``), checked at load for every size the
    data and the samples can have (``configure.check_resolutions``)."""

    multiple: int  # every side a multiple of this many pixels
    largest: int | None  # the longest side in pixels (None: no limit)
    why: str  # what sets them, for the message


class Family(abc.ABC):
    """One model family, built for one run. Subclasses set the class attributes and implement the abstract
    methods (a family missing one cannot be instantiated)."""

    name = ""  # the model.family value
    net_name = "unet"  # the trained module's name in checkpoints, init_from and logs
    samples_tag = "samples"  # wandb key of the sample grid
    makes_eval_images = True  # experiment.num_eval_images applies
    metric_prefix = ""  # prefix of the named loss terms in the logs
    card_tags: tuple[str, ...] = ()  # Hub tags of the exports' model cards (sd_training.outputs.model_card), as diffusers' own
    # FSDP2: (module, distributed.fsdp_unit) -> the submodules sharded separately, innermost first
    shard_units = None
    # The trained module's diffusers class name: what the memory plan at config load builds from-scratch
    # ``model.<net_name>.params`` as, and the class a config.json must name (None: not planned at load)
    net_class: str | None = None
    # model.adapter (sd_training.adapters): preset name -> a full-match regular expression over the net's layer
    # names (only Linear / Conv2d layers are adapted); {}: the family takes explicit targets only
    adapter_presets: dict[str, str] = {}
    # model.adapter.export_kohya: component -> the key prefix diffusers' convert_state_dict_to_kohya gives it
    # ({}: the family's LoRA has no kohya names)
    kohya_lora_prefixes: dict[str, str] = {}
    # model.adapter.export_kohya where ComfyUI loads the net by the ORIGINAL checkpoint's layer names: the rules
    # from the net's diffusers layer names to them (sd_training.outputs.comfy_lora.ComfyLoraNames; None: none)
    comfy_lora_names = None
    # the same for the text encoders of :meth:`adapter_text_encoders` (CLIP's layer names)
    # Reference images per sample the family conditions on (edit training, ``dataset.params.references``): the
    # fewest and the most; (0, 0): a text-to-image family. Checked at load (``configure.check_family_limits``).
    reference_images: tuple[int, int] = (0, 0)
    text_adapter_presets = {
        "attention": r".*self_attn\.(q_proj|k_proj|v_proj|out_proj)",
        "all_linear": r".*(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.fc[12])",
    }

    def __init__(self, cfg: TrainConfig, device: torch.device, seed: int, is_main: bool):
        self.cfg, self.device, self.seed, self.is_main = cfg, device, seed, is_main
        self.models: Any = None
        self.net: torch.nn.Module | None = None  # the trained module (bare: no DDP / FSDP / compile wrapper)
        self.loss_module: torch.nn.Module | None = None  # what the strategy wraps and the loss calls
        self._encoders: dict[str, torch.nn.Module] = {}  # trained encoders as the loss calls them (maybe DDP)
        self.adapters = None  # sd_training.adapters.Adapters when model.adapter trains adapters (set by build)
        self.compile_cache = None  # sd_training.speed.compile_cache.CompileCache under model.compile (set by build)

    @property
    def num_timesteps(self) -> int | None:
        """The training scheduler's timesteps (the loss is logged per quartile); None: no timesteps."""
        return None

    def sample_dtype(self, autocast_dtype: torch.dtype | None) -> torch.dtype | None:
        """The autocast dtype samples and eval images run in (None: fp32)."""
        return autocast_dtype

    # -- config -----------------------------------------------------------------------------------
    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        """Config checks of this family (raise ``ConfigError`` naming the key and what to use instead)."""

    @classmethod
    def text_tokens(cls, cfg: TrainConfig) -> int | None:
        """Text tokens one sample's conditioning holds (what a transformer's joint attention sees beside the
        image tokens: the memory plan's activation estimate); None: CLIP's 77."""
        return None

    @classmethod
    def text_limits(cls, cfg: TrainConfig) -> dict[str, tuple[int, str]]:
        """Text-length keys this family reads -> (the most tokens it takes, what sets that limit), checked at
        load for every family alike (``configure.check_text_lengths``); {}: none beyond the schema's."""
        return {}

    @classmethod
    def pixel_grid(cls, net_conf: dict, vae_factor: int) -> PixelGrid | None:
        """The image sides the trained module ``net_conf`` (its config.json or ``model.<net_name>.params``)
        takes behind a VAE of ``vae_factor`` pixels per latent; None: any multiple of the VAE's factor (the
        dataset rules check that)."""
        return None

    @classmethod
    def takes_guidance_embed(cls, net_conf: dict | None) -> bool | None:
        """Whether the trained module ``net_conf`` has a guidance embedding that ``model.guidance_embed``
        feeds (None: cannot tell without its config); a set value where it has none is refused at load."""
        return False

    # -- what trains besides the net --------------------------------------------------------------
    def trained_encoders(self) -> dict[str, torch.nn.Module]:
        """Modules trained with the net (a text encoder), by checkpoint name; {} when frozen."""
        return {}

    def frozen_modules(self) -> list[torch.nn.Module]:
        """The components that do not train (VAE, text encoders): for the memory plan."""
        return []

    @classmethod
    def loaded_text_components(cls, cfg: TrainConfig) -> tuple[str, ...]:
        """The pipeline's text-encoder components this run loads (the memory plan at config load counts them
        from their folders)."""
        return ()

    def frozen_on_device(self) -> list[torch.nn.Module]:
        """:meth:`frozen_modules` that stay on the device between steps: not those kept in host memory
        (``model.text_encoder_placement``, ``components.placement``). What the memory plan counts."""
        return [m for m in self.frozen_modules() if not off_device(m)]

    def use_wrapped_encoders(self, wrapped: dict[str, torch.nn.Module]) -> None:
        """The trainer's (DDP-)wrapped copies of :meth:`trained_encoders`, for the training forward."""
        self._encoders = dict(wrapped)

    def extra_param_groups(self, peak_lr: float, lr_scale: float) -> list[dict]:
        return []

    def adapter_text_encoders(self) -> dict[str, torch.nn.Module]:
        """The text encoders that may carry a LoRA (``model.adapter.text_encoders.train``), by the names the
        family's pipeline class gives them (its ``save_lora_weights`` arguments) and :meth:`condition` looks
        up in the wrapped encoders; they must run with gradients when they hold trainable parameters."""
        return {}

    # -- the step ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def loss(self, model: torch.nn.Module, batch: dict, autocast: contextlib.AbstractContextManager,
             fixed: dict | None = None, validation: bool = False) -> LossOut:
        """Forward of one micro-batch through ``model`` (the wrapped loss module). ``fixed``: given noise
        and timesteps (validation). The trainer back-propagates ``loss``.

        A training batch carries ``sample_seeds`` (an int64 CPU tensor, one seed per sample, independent
        of the world size): every random draw of sample i (posterior sample, noise, timestep, ...) must
        come from generators seeded from ``sample_seeds[i]`` (``objective.sample_generators``), never from
        the global RNG, so a sample's loss is the same on any number of ranks and micro-batches. A batch
        without them (an older loader, a test) draws from the global RNG."""

    @abc.abstractmethod
    def validation_batch(self, batch: dict, generator: torch.Generator, index: int) -> dict:
        """A held-out batch made deterministic once (fixed latents, noise, timesteps), kept on the CPU."""

    def check_data(self, loader) -> None:
        """Refuse data made for other models (latent shards of another VAE or text encoder)."""

    def component_sources(self) -> dict:
        """Where each component came from, for the run folder's sources.json."""
        return {}

    # model.compile_scope=auto: "blocks" (compile_units one by one) or "whole" (the wrapped loss module).
    compile_scope_auto = "blocks"

    def compile_units(self, net: torch.nn.Module) -> list[torch.nn.Module] | None:
        """``model.compile``: the submodules of ``net`` compiled one by one, in place (``module.compile()``:
        small graphs, one reused by every block of the same shape; FSDP2 units stay what they are); None:
        the whole wrapped loss module is compiled (``torch.compile``)."""
        return None

    def swap_units(self, net: torch.nn.Module) -> list[torch.nn.Module] | None:
        """``model.block_swap``: the blocks of ``net`` that may live in host memory, in execution order, each
        recomputed whole by gradient checkpointing (its backward then brings it in again); None: the family
        has none. Default: the compile units (a transformer's blocks are both)."""
        return self.compile_units(net)

    def step_flops(self) -> StepFlops | None:
        """FLOPs per training image (for MFU); None where MFU is not defined."""
        return None

    # -- artifacts --------------------------------------------------------------------------------
    @abc.abstractmethod
    def export(self, net: torch.nn.Module, out: Path) -> dict:
        """Write the diffusers pipeline with ``net`` to ``out`` (atomically); returns metrics to log."""

    @abc.abstractmethod
    def sample_image(self, net: torch.nn.Module, settings: SampleSettings) -> Image.Image | None:
        """The sample grid (or reconstructions) of ``net`` at this step; None: nothing to show."""

    def inference_pipeline(self, net: torch.nn.Module):
        """The diffusers pipeline that generates images with ``net`` (the run's other components beside it),
        for ``scripts/generate_examples.py --checkpoint``; None: this family makes no text-to-image pipeline."""
        return None

    @classmethod
    def reference_call(cls, images: list[Image.Image]) -> dict:
        """The pipeline's keyword arguments for one prompt's reference images (edit families, already at the
        sample size: ``outputs.sample_references``); a text-to-image family takes none. A classmethod: scripts
        and tests call a loaded pipeline with it, without a run."""
        raise NotImplementedError(f"the {cls.name} family takes no reference images")

    def eval_images(self, net: torch.nn.Module, settings: SampleSettings, n: int, out: Path, rank: int,
                    world_size: int) -> list[Path]:
        """Images ``rank``, ``rank + world_size``, ... of ``n`` eval images from ``settings.prompts``.
        Called only when ``makes_eval_images``; a family without eval images makes none."""
        return []

    # -- with no run: tiny pipelines, latent shards -------------------------------------------------
    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """Save a tiny random-weight pipeline of this family to ``out`` and return it; weights from torch's
        RNG (``registry.make_tiny_pipeline`` seeds it); ``scaling_factor``: the VAE's (None: the
        family's usual one)."""
        raise NotImplementedError(f"the {cls.name or cls.__name__} family has no tiny pipeline")

    @classmethod
    def text_encoding(cls, pipeline: str, device: torch.device, clip_skip: int = 0,
                      max_length: int | None = None) -> TextEncoding:
        """The frozen text encoders of the pipeline folder ``pipeline`` on ``device``, as latent shards store
        their output. ``clip_skip`` / ``max_length``: as ``model.text_encoder`` would set them (0 / None:
        the pipeline's own); a family raises ``ValueError`` for settings it cannot apply."""
        raise NotImplementedError(f"the {cls.name or cls.__name__} family stores no text embeddings")

    @classmethod
    def latent_vae(cls, pipeline: str, what: str, dtype: torch.dtype) -> torch.nn.Module:
        """The VAE latent shards are made with (``scripts/precompute_latents.py``; ``what`` names the
        argument in errors): a diffusers autoencoder whose ``encode(pixels).latent_dist`` gives latents in the
        denoiser's units as ``(latent - config.shift_factor) * config.scaling_factor`` (an ``AutoencoderKL``
        here; a family whose VAE normalises otherwise returns a view that does)."""
        from diffusers import AutoencoderKL

        from ..loading import load_component

        return load_component(AutoencoderKL.from_pretrained, pipeline, "vae", what, torch_dtype=dtype)

    # memory and FLOP estimates -------------------------------------------------------------------
    # What sd_training.memory asks the family before anything is built (the plan at config load,
    # scripts/plan_memory.py, the README's table); ``net_class`` names the trained module's class.
    @classmethod
    def planned_net_class(cls, cfg: TrainConfig) -> str | None:
        """The diffusers class of the run's trained module that :meth:`sample_activation_elements` knows (a
        config.json naming another class is not planned at load); None: no plan at config load."""
        return cls.net_class

    @classmethod
    def net_defaults(cls) -> dict:
        """The trained class's constructor defaults, under ``model.<net_name>.params`` when a from-scratch
        config leaves them out ({}: none to add)."""
        return {}

    @classmethod
    def sample_activation_elements(cls, conf: dict, sample: SampleShape, checkpointing: bool) -> float:
        """Elements one ``sample``'s forward saves for the backward in the trained module ``conf`` builds (its
        config.json or ``model.<net_name>.params``): a rough lower estimate (``memory.activations``); 0: none."""
        return 0.0

    @classmethod
    def reference_models(cls) -> dict[str, ReferenceModel]:
        """Published models of this family that the README's memory table plans, by name."""
        return {}
