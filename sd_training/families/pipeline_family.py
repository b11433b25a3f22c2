"""What every family that trains the denoiser of a diffusers text-to-image pipeline shares, whichever its
net and objective: building its components, latents (stored in shards or VAE-encoded online), the
validation batch, the latent-shard checks, exports, sample grids and eval images of its pipeline.

Its two bases say the rest: ``unet_family.UNetFamily`` (a UNet, the eps/v diffusion objective: SD 1.x/2.x,
SDXL) and ``flow_family.FlowFamily`` (a diffusion transformer trained with flow matching: SD3, Flux).
A family declares ``build_models`` (its components: ``self.models``, whose ``net_name`` attribute is the
trained net), ``pipeline`` (its diffusers pipeline class with the run's components), ``stored_text`` and its
conditioning; the bases do the rest.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path

import torch
from PIL import Image

from ..config.dataset import is_latent_type
from ..config.rules import text_encoder_placement, vae_placement
from ..config.schema import TrainConfig
from ..data.latent_checks import StoredText, check_latents_match
from ..data.transforms import unit_range
from ..evaluation.generate import generate_images
from ..outputs import sample_references
from ..outputs.export import eval_mode, export_pipeline, inference_autocast, sample_grid, unwrap
from .base import Family, SampleSettings
from .components.clip import text_encoder_param_groups
from .components.ddpm import reference_seeds
from .components.placement import brought_in, park, place_text_encoders


def is_latent_data(cfg: TrainConfig) -> bool:
    """The run reads latent shards (the VAE, and with stored text the encoders, do not run in the step)."""
    return is_latent_type(cfg.dataset.type)


def reference_inputs(settings: SampleSettings, reference_call) -> tuple[list | None, list | None]:
    """(each prompt's reference images at the sample size, each prompt's pipeline keyword arguments from them:
    ``reference_call``); (None, None) for text-to-image sampling (no ``settings.references``)."""
    if not settings.references:
        return None, None
    shown = [sample_references.load(paths, settings.resolution) for paths in settings.references]
    return shown, [reference_call(images) for images in shown]


def pipeline_grid(pipe, settings: SampleSettings, device: torch.device,
                  reference_call=None) -> Image.Image | None:
    """The sample grid of the pipeline (None: no prompts or no images per prompt); with references (an edit
    family), each row shows the prompt's references, then its images."""
    if not settings.prompts or settings.per_prompt < 1:
        return None
    shown, calls = reference_inputs(settings, reference_call)
    return sample_grid(pipe, settings.prompts, settings.per_prompt, settings.seed, settings.steps, settings.guidance,
                       settings.resolution, device, settings.dtype, calls=calls, shown=shown)


def pipeline_eval_images(pipe, settings: SampleSettings, n: int, out: Path, rank: int, world_size: int,
                         device: torch.device, reference_call=None) -> list[Path]:
    """Eval images of the pipeline: image i uses prompt i (cycling), its references if any, and seed
    ``seed + i``; rank r makes images r, r+W, r+2W, ... (the loop and file convention of
    ``python -m sd_training.evaluation``)."""
    pipe.set_progress_bar_config(disable=True)
    _, calls = reference_inputs(settings, reference_call)
    with eval_mode(pipe), inference_autocast(device, settings.dtype):
        return generate_images(pipe, settings.prompts, n, out, settings.seed, settings.steps, settings.guidance,
                               settings.resolution, rank, world_size, batch_size=8, progress=False, calls=calls)


class PipelineFamily(Family):
    """A family whose run trains the denoiser of a text-to-image pipeline (see the module)."""

    pipeline_classes: tuple[str, ...] = ()  # the model_index.json _class_name values (registry.detect)
    # ``text_family`` in latents_info.json: which family's text conditioning latent shards hold (None: the
    # single-CLIP layout of shards written before latents_info.json named one)
    text_tag: str | None = None
    # The text encoders that may train with the net (``model.text_encoder.train``) or carry a LoRA
    # (``model.adapter.text_encoders``), by the names of ``self.models`` and of the pipeline's components
    text_encoder_names: tuple[str, ...] = ()
    # Every text encoder of the pipeline, by component name (``loaded_text_components``)
    text_components: tuple[str, ...] = ("text_encoder",)

    @classmethod
    def loaded_text_components(cls, cfg: TrainConfig) -> tuple[str, ...]:
        return cls.text_components

    def __init__(self, cfg: TrainConfig, device: torch.device, seed: int, is_main: bool):
        super().__init__(cfg, device, seed, is_main)
        # model.text_encoder_placement: where the frozen text encoders live, and where a family loads them
        # (``text_device``: host memory unless on the device; ``placement.place`` puts them there in any case)
        self.text_placement = text_encoder_placement(cfg)
        self.text_device = self.device if self.text_placement == "device" else torch.device("cpu")
        # model.block_swap: the net is built in host memory; the swap keeps its swapped blocks there and moves the
        # rest to the device (speed.block_swap), so the whole net never sits on the device at load
        self.net_device = torch.device("cpu") if getattr(cfg.model, "block_swap", 0) else self.device
        self.models = self.build_models()
        place_text_encoders(self.frozen_text_encoders(), self.text_placement, self.device)
        if vae_placement(cfg) == "offload":  # model.vae.placement: latent shards, the steps never run it
            park(self.models.vae)
        self.net = unwrap(getattr(self.models, self.net_name))
        self.loss_module = self.net

    @abc.abstractmethod
    def build_models(self):
        """The run's components from ``model.*`` (a ``components.unet.Components`` dataclass)."""

    @abc.abstractmethod
    def pipeline(self, net: torch.nn.Module, for_export: bool = False):
        """The family's diffusers pipeline with ``net`` and the run's other components; ``for_export``: the
        frozen ones in fp32 as loaded from their sources (a bf16 run keeps them in bf16 for speed)."""

    # The text reads the reference images (Qwen-Image-Edit): latent shards store it per sample, read with them
    # (``text_encoding(..., references=, sizes=)``, scripts/precompute_latents.py --references N --text-embeddings)
    text_reads_references = False

    @abc.abstractmethod
    def stored_text(self) -> StoredText:
        """What this run expects of text conditioning stored in latent shards."""

    # -- the text encoders that train, and the frozen ones ----------------------------------------
    @property
    def step_encodes_text_on_device(self) -> bool:
        """The steps run the text encoders on the device: captions encoded online (no stored text states) by
        encoders not kept on the CPU. Their FLOPs then count in a step's hardware FLOPs."""
        stored = is_latent_data(self.cfg) and bool(self.cfg.dataset.params.text_embeddings)
        return not stored and self.text_placement != "cpu"

    def frozen_text_encoders(self) -> dict[str, torch.nn.Module]:
        """The components named ``text_encoder*`` that do not train with the net (``model.text_encoder.train``):
        what ``model.text_encoder_placement`` places."""
        trained = self.trained_encoders()
        return {f.name: module for f in dataclasses.fields(self.models)
                if f.name.startswith("text_encoder") and f.name not in trained
                and isinstance(module := getattr(self.models, f.name), torch.nn.Module)}

    def adapter_text_encoders(self) -> dict[str, torch.nn.Module]:
        return {name: getattr(self.models, name) for name in self.text_encoder_names}

    def trained_encoders(self) -> dict[str, torch.nn.Module]:
        return self.adapter_text_encoders() if self.cfg.model.text_encoder.train else {}

    def extra_param_groups(self, peak_lr: float, lr_scale: float) -> list[dict]:
        """The trained encoders' groups, one set per encoder named by it (``model.text_encoder.learning_rate``,
        else the net's peak LR)."""
        o, groups = self.cfg.optimizer, []
        for name, encoder in self.trained_encoders().items():
            groups += [dict(g, name=name) for g in text_encoder_param_groups(
                encoder, self.cfg.model.text_encoder, peak_lr, o.params.weight_decay, o.no_decay_norm_and_bias, lr_scale)]
        return groups

    @property
    def num_timesteps(self) -> int:
        return int(self.models.noise_scheduler.config.num_train_timesteps)

    def sample_dtype(self, autocast_dtype: torch.dtype | None) -> torch.dtype | None:
        """Samples and eval images run under autocast in the training precision, or in the frozen VAE's
        dtype when only the VAE is stored in half precision (model.vae.dtype=bf16 with fp32 training)."""
        if autocast_dtype is not None:
            return autocast_dtype
        return self.models.vae.dtype if self.models.vae.dtype != torch.float32 else None

    # -- latents ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def encode(self, pixels: torch.Tensor, mean: bool | None = None, sample_seeds=None) -> torch.Tensor:
        """Pixels in [-1, 1] -> float32 latents in the net's units (``components.vae.encode``); ``mean`` None:
        ``model.vae.latent_sampling``."""

    def latents(self, batch: dict) -> torch.Tensor:
        """The batch's latents on the device (float32): stored in latent shards, else VAE-encoded, each
        sample's posterior sample from its seed."""
        if "latents" in batch:
            return batch["latents"].to(self.device, non_blocking=True).float()
        pixels = unit_range(batch["pixel_values"].to(self.device, non_blocking=True))
        return self.encode(pixels, sample_seeds=batch.get("sample_seeds"))

    def reference_latents(self, batch: dict) -> list[torch.Tensor]:
        """The batch's reference images as latents on the device (float32), one [B, C, h, w] tensor per
        reference (edit training, ``dataset.params.references``; [] without references): stored in latent
        shards (``reference_latents`` [B, R, C, h, w]), else VAE-encoded from ``reference_values`` (uint8
        [B, R, 3, H, W]) as the targets are, each reference's posterior sample from its own seeds."""
        if "reference_latents" in batch:
            stored = batch["reference_latents"].to(self.device, non_blocking=True).float()
            return list(stored.unbind(1))
        if "reference_values" not in batch:
            return []
        pixels = unit_range(batch["reference_values"].to(self.device, non_blocking=True))
        seeds = batch.get("sample_seeds")
        out = []
        for k in range(pixels.shape[1]):
            ref_seeds = None if seeds is None else reference_seeds(seeds, k)
            out.append(self.encode(pixels[:, k], sample_seeds=ref_seeds))
        return out

    @abc.abstractmethod
    def validation_timesteps(self, n: int) -> torch.Tensor:
        """The fixed timesteps of a held-out batch of ``n`` samples, spread over the training range."""

    def validation_batch(self, batch, generator, index) -> dict:
        """Fixed latents (the posterior mean: the same at every validation and restart), noise and timesteps."""
        b = {k: x for k, x in batch.items() if isinstance(x, torch.Tensor)}
        if "latents" not in b:
            with brought_in(self.frozen_modules(), self.device):  # a parked VAE (model.vae.placement)
                b["latents"] = self.encode(unit_range(b.pop("pixel_values").to(self.device)), mean=True).cpu()
        if "reference_values" in b:  # edit training: the references' posterior means, fixed like the targets'
            refs = unit_range(b.pop("reference_values").to(self.device))
            with brought_in(self.frozen_modules(), self.device):
                b["reference_latents"] = torch.stack(
                    [self.encode(refs[:, k], mean=True).cpu() for k in range(refs.shape[1])], dim=1)
        b["timesteps"] = self.validation_timesteps(len(b["latents"]))
        b["noise"] = torch.randn(b["latents"].shape, generator=generator)
        return b

    def check_data(self, loader) -> None:
        if is_latent_data(self.cfg):
            # Shards made with another VAE, scaling factor or text encoder would train silently wrong.
            check_latents_match(loader, self.models.vae, self.stored_text())

    # -- artifacts --------------------------------------------------------------------------------
    def inference_pipeline(self, net: torch.nn.Module):
        return self.pipeline(net)

    def sampling(self, settings: SampleSettings) -> SampleSettings:
        """The settings sample grids and eval images use (a family may fix some, e.g. its guidance)."""
        return settings

    def export(self, net, out: Path) -> dict:
        export_pipeline(self.pipeline(net, for_export=True), out)
        return {}

    def sample_image(self, net, settings: SampleSettings) -> Image.Image | None:
        with brought_in(self.frozen_modules(), self.device):  # a parked VAE (model.vae.placement)
            return pipeline_grid(self.inference_pipeline(net), self.sampling(settings), self.device,
                                 self.reference_call)

    def eval_images(self, net, settings: SampleSettings, n: int, out: Path, rank: int, world_size: int) -> list[Path]:
        with brought_in(self.frozen_modules(), self.device):
            return pipeline_eval_images(self.inference_pipeline(net), self.sampling(settings), n, out, rank,
                                        world_size, self.device, self.reference_call)
