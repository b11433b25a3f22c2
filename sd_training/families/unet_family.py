"""The base of the UNet families (SD 1.x/2.x in ``sd.py``, SDXL in ``sdxl.py``): a UNet trained with the
eps/v diffusion objective (``components.ddpm``, the ``objective`` config section).

It holds what does not depend on the text encoders: the schedulers set to the objective's prediction type,
online VAE encoding (in the VAE's dtype; an fp16 VAE that overflows is kept in fp32 from then on), the
UNet's channels-last inputs, the loss, validation timesteps, the UNet's compile and FSDP2 units, LoRA
presets, FLOPs and exports with another VAE (the autoencoder stage). A family adds its text encoders:
``build_models``, ``condition`` (the UNet's cross-attention states and added conditioning), the
trained/frozen encoders, ``pipeline`` and ``stored_text``.
"""

from __future__ import annotations

import abc
import logging
from pathlib import Path

import torch

from ..config.schema import TrainConfig
from ..outputs.export import export_pipeline
from ..memory import activations
from ..speed.flops import StepFlops
from .base import LossOut
from .components import vae as vae_encoding
from .components.ddpm import configure_schedulers, diffusion_loss, scheduler_tensors_to
from .components.unet import component_sources, uses_channels_last
from .components.unet_flops import count_step_flops, unet_inputs
from .pipeline_family import PipelineFamily, is_latent_data

log = logging.getLogger(__name__)


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


def swap_units(net: torch.nn.Module) -> list[torch.nn.Module]:
    """``model.block_swap``: the UNet's parts that gradient checkpointing recomputes whole, in execution
    order: the down and up blocks' ResNets and the transformer blocks inside their attentions, the mid
    block's attentions' transformer blocks and its ResNets after the first (diffusers calls the first, and
    the attentions' norms and projections, outside the checkpoint: they stay on the device)."""
    def parts(name: str, block) -> list:
        return list(getattr(block, name, None) or [])

    def level(block) -> list[torch.nn.Module]:  # a down or up block: resnet i, then attention i
        attentions = parts("attentions", block)
        return [unit for i, resnet in enumerate(parts("resnets", block))
                for unit in [resnet, *(parts("transformer_blocks", attentions[i]) if i < len(attentions) else [])]]

    units = [u for block in parts("down_blocks", net) for u in level(block)]
    mid = getattr(net, "mid_block", None)
    if mid is not None:  # resnet 0 (outside the checkpoint), then attention i, resnet i + 1
        for attention, resnet in zip(parts("attentions", mid), parts("resnets", mid)[1:]):
            units.extend([*parts("transformer_blocks", attention), resnet])
    return units + [u for block in parts("up_blocks", net) for u in level(block)]


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


def clip_positions(src: str | None, name: str) -> int | None:
    """``max_position_embeddings`` of the text encoder ``name`` of a local pipeline root or component folder
    ``src``; None when it cannot be read without loading anything."""
    import json
    import os

    for folder in ((os.path.join(src, name), src) if src else ()):
        try:
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
                value = json.load(fh).get("max_position_embeddings")
            return int(value) if isinstance(value, int) and value > 0 else None
        except (OSError, ValueError, AttributeError):
            continue
    return None


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


# model.adapter presets of the UNets: their attention projections; + the feed-forward layers; every Linear
# and Conv2d layer but the first and the last convolution (kohya's LoCon set)
UNET_ATTENTION = r".*\.attn[12]\.(to_q|to_k|to_v|to_out\.0)"
UNET_ADAPTER_PRESETS = {
    "attention": UNET_ATTENTION,
    "attention_ffn": r".*\.(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))",
    "all_linear": r"(?!conv_in$|conv_out$).+",
}


class UNetFamily(PipelineFamily):
    """A UNet pipeline family (see the module). ``self.models`` is a ``components.unet.Models``."""

    adapter_presets = UNET_ADAPTER_PRESETS
    shard_units = staticmethod(shard_units)
    # Measured (SD 1.x UNet, 512 px, batch 32, bf16): by blocks + channels-last 115 img/s on an H200 (eager 94
    # there), the whole UNet 116 on an H100 (eager 85): by blocks lost more than it saved in warm-up (about 140 s
    # fresh, 14 s from the cache), and the cache artifacts shorten the whole graph's warm-up as well.
    compile_scope_auto = "whole"

    def __init__(self, cfg: TrainConfig, device: torch.device, seed: int, is_main: bool):
        super().__init__(cfg, device, seed, is_main)
        # Prediction type and zero terminal SNR go to both schedulers: exports sample as they trained.
        self.models.noise_scheduler, self.models.inference_scheduler = configure_schedulers(
            self.models.noise_scheduler, self.models.inference_scheduler, cfg.objective
        )
        scheduler_tensors_to(self.models.noise_scheduler, device)

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        refuse_transformer_keys(cfg, cls.name)

    @classmethod
    def text_limits(cls, cfg: TrainConfig) -> dict[str, tuple[int, str]]:
        """``model.text_encoder.max_length``: at most the CLIP encoders' position embeddings, read from their
        config.json (a local pipeline; else the build checks it, as for an OpenCLIP encoder)."""
        m = cfg.model
        if m.text_encoder.type != "clip":
            return {}
        positions = [clip_positions(getattr(m, name).pretrained or m.pretrained, name)
                     for name in cls.text_encoder_names]
        known = [p for p in positions if p]
        if not known:
            return {}
        return {"model.text_encoder.max_length": (min(known), "the text encoder's position embeddings, "
                                                  "max_position_embeddings in its config.json")}

    def compile_units(self, net: torch.nn.Module) -> list[torch.nn.Module]:
        return compile_units(net)

    def swap_units(self, net: torch.nn.Module) -> list[torch.nn.Module]:
        return swap_units(net)

    @property
    def tokenizers(self):
        """What the data loader tokenizes captions with."""
        return self.models.tokenizer

    def component_sources(self) -> dict:
        return component_sources(self.cfg.model)

    # -- the step ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def condition(self, batch: dict, validation: bool) -> tuple[torch.Tensor, dict | None]:
        """The UNet's conditioning of a batch on the device: cross-attention states, added kwargs (None:
        none). ``validation``: the encoders as modules, else as the trainer wrapped them."""

    def latents(self, batch: dict) -> torch.Tensor:
        latents = super().latents(batch)
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
        """VAE-encode in the VAE's own dtype, outside autocast (autocast would recast an fp32 VAE), scaled in
        that dtype (``components.vae``'s UNet convention). ``sample_seeds``: the posterior sample of image i
        from its own seed (else the global RNG)."""
        vae = self.models.vae
        mean = self.cfg.model.vae.latent_sampling == "mean" if mean is None else mean
        latents = vae_encoding.encode(vae, pixels, self.models.latent_scale, mean=mean, sample_seeds=sample_seeds)
        if vae.dtype == torch.float16 and not bool(torch.isfinite(latents).all()):
            # The SD VAE overflows in fp16 on some images (seed 000's NaNs): keep it in fp32 from now on.
            log.warning("the fp16 VAE overflowed (non-finite latents): keeping the VAE in fp32 from now on")
            vae.to(torch.float32)
            latents = vae_encoding.encode(vae, pixels, self.models.latent_scale, mean=mean, sample_seeds=sample_seeds)
        return latents.float()

    def validation_timesteps(self, n: int) -> torch.Tensor:
        T = self.models.noise_scheduler.config.num_train_timesteps
        return torch.linspace(0, T - 1, n).round().long()

    def step_flops(self) -> StepFlops:
        # Counted once, on the meta device (no compute): model FLOPs = 3 x UNet forward per image;
        # hardware FLOPs add the frozen encoders and the recomputation of gradient checkpointing.
        return count_step_flops(self.models, self.cfg.dataset.params.resolution, self.cfg.model.gradient_checkpointing,
                                encode_images=not is_latent_data(self.cfg), inputs=self.flop_inputs)

    # -- artifacts --------------------------------------------------------------------------------
    def export_with_vae(self, unet, vae, out: Path) -> None:
        """The pipeline with another VAE (the autoencoder stage's)."""
        export_pipeline(self.pipeline(unet, for_export=True, vae=vae), out)

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
