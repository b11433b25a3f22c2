"""Stable Diffusion 1.x / 2.x: one CLIP text encoder, a UNet conditioned on its hidden states.

Also the base of SDXL (``sdxl.py``), which changes the components, the conditioning and the pipeline
class, and keeps everything else: online VAE encoding, the diffusion loss, validation batches,
exports, sample grids and eval images.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from PIL import Image

from ..config.dataset import is_latent_type
from ..config.schema import TrainConfig
from ..data.latents import TEXT_STATES_KEY, StoredText, check_latents_match
from ..data.transforms import unit_range
from ..evaluation.generate import generate_images
from ..outputs.export import eval_mode, export_pipeline, inference_autocast, sample_grid, unwrap
from ..speed.flops import StepFlops
from ..loading import load_component
from .components.ddpm import configure_schedulers, diffusion_loss, encode_images, encode_text, scheduler_tensors_to
from .components.clip import (
    apply_clip_skip,
    build_clip_tokenizer,
    clip_skip_of,
    text_encoder_for_pipeline,
    text_encoder_param_groups,
)
from ..memory import activations
from .base import Family, LossOut, SampleSettings, TextEncoding
from .tiny import SD_SCHEDULER, TINY_TEXT_ENCODER, TINY_UNET, TINY_VAE, save, tokenizer_folder
from .components.unet import build_models, component_sources, uses_channels_last
from .components.unet_flops import count_step_flops, unet_inputs

log = logging.getLogger(__name__)

SCALING_FACTOR = 0.18215  # SD 1.x/2.x's VAE


def is_latent_data(cfg: TrainConfig) -> bool:
    return is_latent_type(cfg.dataset.type)


def diffusers_blocks(net: torch.nn.Module) -> list[torch.nn.Module]:
    """Each down/up block and the mid block of a diffusers UNet (or autoencoder half)."""
    blocks = []
    for name in ("down_blocks", "up_blocks"):
        blocks.extend(getattr(net, name, []) or [])
    if getattr(net, "mid_block", None) is not None:
        blocks.append(net.mid_block)
    return blocks


def compile_units(net: torch.nn.Module) -> list[torch.nn.Module]:
    """``model.compile`` (compile_scope=blocks): the UNet's repeated layers, each compiled on its own: every
    ResNet block and every attention block (its norm, projections and transformer blocks: the eager norm
    and projections around the transformer blocks alone cost copies). Blocks of one class share a graph per
    shape (a ResNet block's channels differ across levels, so ResNets take several); conv_in, the
    up/downsamplers and conv_out stay eager."""
    units = []
    for block in diffusers_blocks(net):
        units.extend(getattr(block, "resnets", None) or [])
        units.extend(getattr(block, "attentions", None) or [])
    return units


def shard_units(net: torch.nn.Module, level: str) -> list[torch.nn.Module]:
    """The modules FSDP2 shards separately, innermost first. ``block``: each down/mid/up block (an SD UNet's
    largest is about 30% of the weights, all gathered at once). ``layer``: each resnet and transformer
    block inside them too (the blocks keep only their up/downsamplers), so at most one layer's weights
    are gathered beyond the shards, and the next layer's all-gather overlaps this one's compute."""
    units = []
    for block in diffusers_blocks(net):
        if level == "layer":
            for name in ("resnets", "attentions"):
                units.extend(getattr(block, name, None) or [])
        units.append(block)
    return units


def refuse_transformer_keys(cfg: TrainConfig, family: str) -> None:
    """The keys of the transformer families (flow matching, the transformer, T5) set on a UNet family's run
    would be ignored silently: a ``ConfigError`` names the first one."""
    from ..config import ConfigError
    from .options import FamilyModelFields, FamilySections

    sections = FamilySections()
    model = FamilyModelFields()
    keys = [("flow_matching", cfg.flow_matching, sections.flow_matching)]
    keys += [(f"model.{k}", getattr(cfg.model, k), getattr(model, k))
             for k in ("transformer", "t5", "text_encoder_3", "tokenizer_3", "guidance_embed")]
    for key, value, default in keys:
        if value != default:
            raise ConfigError(f"'{key}' applies to the transformer families (sd3, flux); the {family} family trains a "
                              "UNet with the 'objective' section: remove it, or set model.family / model.pretrained "
                              "to a transformer pipeline")


def make_pipeline(models, unet: torch.nn.Module, vae: torch.nn.Module | None = None, for_export: bool = False):
    """A StableDiffusionPipeline of the run's components with ``unet`` (and ``vae``, when the VAE is trained).

    ``for_export``: the frozen VAE and text encoder in fp32 as loaded from their sources (a bf16 run
    keeps them in bf16 for speed; an export must not round them)."""
    from diffusers import StableDiffusionPipeline

    if vae is None:
        vae = models.full_precision("vae") if for_export else models.vae
    text_encoder = unwrap(models.text_encoder)
    if for_export and not any(p.requires_grad for p in text_encoder.parameters()):
        text_encoder = models.full_precision("text_encoder")
    return StableDiffusionPipeline(
        vae=unwrap(vae),
        text_encoder=text_encoder_for_pipeline(text_encoder),
        tokenizer=models.tokenizer,
        unet=unwrap(unet),
        scheduler=models.inference_scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def pipeline_grid(pipe, settings: SampleSettings, device: torch.device) -> Image.Image | None:
    """The sample grid of a text-to-image pipeline (None: no prompts or no images per prompt)."""
    if not settings.prompts or settings.per_prompt < 1:
        return None
    return sample_grid(pipe, settings.prompts, settings.per_prompt, settings.seed, settings.steps, settings.guidance,
                       settings.resolution, device, settings.dtype)


def pipeline_eval_images(pipe, settings: SampleSettings, n: int, out: Path, rank: int, world_size: int,
                         device: torch.device) -> list[Path]:
    """Eval images of a text-to-image pipeline: image i uses prompt i (cycling) and seed ``seed + i``; rank r
    makes images r, r+W, r+2W, ... (the loop and file convention of ``python -m sd_training.evaluation``)."""
    pipe.set_progress_bar_config(disable=True)
    with eval_mode(pipe), inference_autocast(device, settings.dtype):
        return generate_images(pipe, settings.prompts, n, out, settings.seed, settings.steps, settings.guidance,
                               settings.resolution, rank, world_size, batch_size=8, progress=False)


# model.adapter presets of the UNets: their attention projections; + the feed-forward layers; every Linear
# and Conv2d layer but the first and the last convolution (kohya's LoCon set)
UNET_ATTENTION = r".*\.attn[12]\.(to_q|to_k|to_v|to_out\.0)"
UNET_ADAPTER_PRESETS = {
    "attention": UNET_ATTENTION,
    "attention_ffn": r".*\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))",
    "all_linear": r"(?!conv_in$|conv_out$).+",
}


class StableDiffusion(Family):
    name = "sd"
    pipeline_classes = ("StableDiffusionPipeline",)
    card_tags = ("stable-diffusion", "stable-diffusion-diffusers")
    adapter_presets = UNET_ADAPTER_PRESETS
    kohya_lora_prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te1_"}

    def __init__(self, cfg: TrainConfig, device: torch.device, seed: int, is_main: bool):
        super().__init__(cfg, device, seed, is_main)
        self.models = self.build_models()
        # Prediction type and zero terminal SNR go to both schedulers: exports sample as they trained.
        self.models.noise_scheduler, self.models.inference_scheduler = configure_schedulers(
            self.models.noise_scheduler, self.models.inference_scheduler, cfg.objective
        )
        scheduler_tensors_to(self.models.noise_scheduler, device)
        self.net = unwrap(self.models.unet)
        self.loss_module = self.net

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        refuse_transformer_keys(cfg, cls.name)

    def build_models(self):
        return build_models(self.cfg.model, self.device, seed=self.seed)

    shard_units = staticmethod(shard_units)
    # Measured (SD 1.x UNet, 512 px, batch 32, bf16): by blocks + channels-last 115 img/s on an H200 (eager 94
    # there), the whole UNet 116 on an H100 (eager 85): by blocks lost more than it saved in warm-up (about 140 s
    # fresh, 14 s from the cache), and the cache artifacts shorten the whole graph's warm-up as well.
    compile_scope_auto = "whole"

    def compile_units(self, net: torch.nn.Module) -> list[torch.nn.Module]:
        return compile_units(net)

    @property
    def num_timesteps(self) -> int:
        return int(self.models.noise_scheduler.config.num_train_timesteps)

    def sample_dtype(self, autocast_dtype: torch.dtype | None) -> torch.dtype | None:
        """Samples and eval images run under autocast in the training precision, or in the frozen VAE's
        dtype when only the VAE is stored in half precision (model.vae.dtype=bf16 with fp32 training)."""
        if autocast_dtype is not None:
            return autocast_dtype
        return self.models.vae.dtype if self.models.vae.dtype != torch.float32 else None

    @property
    def tokenizers(self):
        """What the data loader tokenizes captions with."""
        return self.models.tokenizer

    # -- what trains besides the UNet -------------------------------------------------------------
    def trained_encoders(self) -> dict[str, torch.nn.Module]:
        return {"text_encoder": self.models.text_encoder} if self.cfg.model.text_encoder.train else {}

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [x for x in (self.models.vae, self.models.text_encoder) if not any(p.requires_grad for p in x.parameters())]

    def adapter_text_encoders(self) -> dict[str, torch.nn.Module]:
        return {"text_encoder": self.models.text_encoder}

    def extra_param_groups(self, peak_lr: float, lr_scale: float) -> list[dict]:
        o = self.cfg.optimizer
        return text_encoder_param_groups(self.models.text_encoder, self.cfg.model.text_encoder, peak_lr,
                                         o.params.weight_decay, o.no_decay_norm_and_bias, lr_scale)

    # -- the step ---------------------------------------------------------------------------------
    def condition(self, batch: dict, validation: bool) -> tuple[torch.Tensor, dict | None]:
        """The UNet's conditioning of a batch on the device: cross-attention states, added kwargs."""
        if TEXT_STATES_KEY in batch:  # precomputed text-encoder outputs (latent shards)
            return batch[TEXT_STATES_KEY].to(self.device, non_blocking=True).float(), None
        encoder = self.models.text_encoder if validation else self._encoders.get("text_encoder", self.models.text_encoder)
        return encode_text(encoder, batch["input_ids"].to(self.device, non_blocking=True)), None

    def latents(self, batch: dict) -> torch.Tensor:
        if "latents" in batch:
            latents = batch["latents"].to(self.device, non_blocking=True).float()
        else:
            pixels = unit_range(batch["pixel_values"].to(self.device, non_blocking=True))
            latents = self.encode(pixels, sample_seeds=batch.get("sample_seeds"))
        if uses_channels_last(self.cfg.model, self.device):  # as the UNet's weights (model.channels_last)
            latents = latents.contiguous(memory_format=torch.channels_last)
        return latents

    def loss(self, model, batch, autocast, fixed=None, validation=False) -> LossOut:
        """The diffusion loss; a batch's ``sample_seeds`` seed each sample's posterior sample, noise and
        timestep (given ``fixed`` noise and timesteps are used as they are)."""
        latents = self.latents(batch)
        with autocast:
            hidden, added = self.condition(batch, validation)
            loss, per_sample, timesteps = diffusion_loss(
                model, self.models.noise_scheduler, latents, hidden, self.cfg.objective,
                added_cond_kwargs=added, sample_seeds=batch.get("sample_seeds"), loss_weight=batch.get("loss_weight"),
                **(fixed or {}),
            )
        return LossOut(loss, per_sample, timesteps, None)

    def encode(self, pixels: torch.Tensor, mean: bool | None = None, sample_seeds=None) -> torch.Tensor:
        """VAE-encode in the VAE's own dtype, outside autocast (autocast would recast an fp32 VAE).
        ``sample_seeds``: the posterior sample of image i from its own seed (else the global RNG)."""
        vae = self.models.vae
        mean = self.cfg.model.vae.latent_sampling == "mean" if mean is None else mean
        with torch.autocast(self.device.type, enabled=False):
            latents = encode_images(vae, pixels, self.models.latent_scale, mean=mean, sample_seeds=sample_seeds)
            if vae.dtype == torch.float16 and not bool(torch.isfinite(latents).all()):
                # The SD VAE overflows in fp16 on some images (seed 000's NaNs): keep it in fp32 from now on.
                log.warning("the fp16 VAE overflowed (non-finite latents): keeping the VAE in fp32 from now on")
                vae.to(torch.float32)
                latents = encode_images(vae, pixels, self.models.latent_scale, mean=mean, sample_seeds=sample_seeds)
        return latents.float()

    def validation_batch(self, batch, generator, index) -> dict:
        b = {k: x for k, x in batch.items() if isinstance(x, torch.Tensor)}
        n = len(b["input_ids"])
        T = self.models.noise_scheduler.config.num_train_timesteps
        b["timesteps"] = torch.linspace(0, T - 1, n).round().long()
        if "latents" not in b:
            # The posterior mean, not a sample: the same latents at every validation and restart.
            b["latents"] = self.encode(unit_range(b.pop("pixel_values").to(self.device)), mean=True).cpu()
        b["noise"] = torch.randn(b["latents"].shape, generator=generator)
        return b

    def check_data(self, loader) -> None:
        if is_latent_data(self.cfg):
            # Shards made with another VAE, scaling factor or text encoder would train silently wrong.
            check_latents_match(loader, self.models.vae, self.stored_text())

    def stored_text(self) -> StoredText:
        m = self.models
        return StoredText(int(m.tokenizer.model_max_length), int(m.text_encoder.config.hidden_size),
                          clip_skip_of(m.text_encoder), self.text_storage_tag())

    def component_sources(self) -> dict:
        return component_sources(self.cfg.model)

    def step_flops(self) -> StepFlops:
        # Counted once, on the meta device (no compute): model FLOPs = 3 x UNet forward per image;
        # hardware FLOPs add the frozen encoders and the recomputation of gradient checkpointing.
        return count_step_flops(self.models, self.cfg.dataset.params.resolution, self.cfg.model.gradient_checkpointing,
                                encode_images=not is_latent_data(self.cfg), inputs=self.flop_inputs)

    # -- artifacts --------------------------------------------------------------------------------
    def pipeline(self, unet: torch.nn.Module, for_export: bool = False, vae: torch.nn.Module | None = None):
        return make_pipeline(self.models, unet, vae, for_export=for_export)

    def inference_pipeline(self, net: torch.nn.Module):
        return self.pipeline(net)

    def export(self, net, out: Path) -> dict:
        export_pipeline(self.pipeline(net, for_export=True), out)
        return {}

    def export_with_vae(self, unet, vae, out: Path) -> None:
        """The pipeline with another VAE (the autoencoder stage's)."""
        export_pipeline(self.pipeline(unet, for_export=True, vae=vae), out)

    def sample_image(self, net, settings: SampleSettings) -> Image.Image | None:
        return pipeline_grid(self.pipeline(net), settings, self.device)

    def eval_images(self, net, settings: SampleSettings, n: int, out: Path, rank: int, world_size: int) -> list[Path]:
        return pipeline_eval_images(self.pipeline(net), settings, n, out, rank, world_size, self.device)

    # -- with no run ------------------------------------------------------------------------------
    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """A ``StableDiffusionPipeline`` in the 1.x layout (``families.tiny``'s sizes), DDIM for inference;
        the training scheduler is built from ``scheduler/`` (DDPMScheduler.from_pretrained), as diffusers does."""
        from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel

        scratch = tokenizer_folder(out, "tokenizer")
        tokenizer = build_clip_tokenizer(scratch)
        text_encoder = CLIPTextModel(CLIPTextConfig(**TINY_TEXT_ENCODER))
        vae = AutoencoderKL(**TINY_VAE, scaling_factor=scaling_factor or SCALING_FACTOR)
        unet = UNet2DConditionModel(**TINY_UNET)
        pipe = StableDiffusionPipeline(
            vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=DDIMScheduler(**SD_SCHEDULER),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )
        return save(pipe, out, scratch)

    @classmethod
    def text_storage_tag(cls) -> str | None:
        # None: the layout of shards written before latents_info.json named one (they keep loading).
        return None

    @classmethod
    def load_text_encoder(cls, pipeline: str, device: torch.device, max_length: int | None = None):
        """The pipeline folder's CLIP tokenizer and text encoder (frozen, on ``device``), the tokenizer cut
        to ``max_length`` tokens (None: the encoder's positions) as ``model.text_encoder.max_length`` would."""
        from transformers import CLIPTextModel, CLIPTokenizer

        tokenizer = load_component(CLIPTokenizer.from_pretrained, pipeline, "tokenizer", "the pipeline's tokenizer/")
        text_encoder = load_component(CLIPTextModel.from_pretrained, pipeline, "text_encoder", "the pipeline's text_encoder/")
        limit = text_encoder.config.max_position_embeddings
        if max_length is not None:
            if max_length > limit:
                raise ValueError(f"max_length {max_length} exceeds the text encoder's {limit} positions")
            tokenizer.model_max_length = max_length
        elif tokenizer.model_max_length > limit:  # a tokenizer saved without it reports a huge sentinel
            tokenizer.model_max_length = limit
        return tokenizer, text_encoder.to(device).eval().requires_grad_(False)

    @classmethod
    def text_encoding(cls, pipeline: str, device: torch.device, clip_skip: int = 0,
                      max_length: int | None = None) -> TextEncoding:
        """The text encoder's last hidden state (clip skip applied), as :meth:`condition` computes it."""
        tokenizer, text_encoder = cls.load_text_encoder(pipeline, device, max_length)
        apply_clip_skip(text_encoder, clip_skip)
        return TextEncoding(cls.text_storage_tag(), [tokenizer], [text_encoder],
                            lambda encoders, ids: (encode_text(encoders[0], ids[0]), None))

    # memory and FLOP estimates -------------------------------------------------------------------
    net_class = "UNet2DConditionModel"
    # (meta UNet, latent (h, w), text tokens, batch) -> its forward's (args, kwargs) on meta: what step_flops counts
    flop_inputs = staticmethod(unet_inputs)

    @classmethod
    def planned_net_class(cls, cfg: TrainConfig) -> str | None:
        """diffusers' UNet, unless ``model.unet.target`` names another class (not estimated)."""
        return cls.net_class if str(cfg.model.unet.target).rsplit(".", 1)[-1] == cls.net_class else None

    @classmethod
    def sample_activation_elements(cls, conf: dict, sample: activations.SampleShape, checkpointing: bool) -> float:
        return activations.convolutional(activations.unet_activation_elements(conf, sample.latent), checkpointing)
