"""Z-Image: a ``ZImageTransformer2DModel`` (single-stream DiT) trained with flow matching, conditioned on a
Qwen3 LLM's hidden states.

As ``ZImagePipeline`` conditions at inference, so the transformer trains:

* the caption as one user message through the tokenizer's chat template (``enable_thinking=True``), padded to
  ``model.llm.max_length`` tokens (512 by default, as the pipeline pads) and truncated; the text encoder's
  (``Qwen3Model``) ``hidden_states[-2]``; only the real tokens, a list of variable-length states
  (``components.llm_text``: ``ZIMAGE_TEXT``);
* an empty caption (caption dropout) is encoded as the pipeline encodes its empty negative prompt;
* latents ``(z - shift_factor) * scaling_factor`` of the 16-channel VAE (FLUX.1's), one frame each
  ([C, 1, h, w]) in the list the transformer patchifies (2x2 patches);
* the transformer takes ``t = (1000 - timestep) / 1000`` (1 - sigma) and predicts ``x_0 - noise``: the
  velocity with its sign flipped, so its output is negated, as the pipeline and diffusers'
  ``train_dreambooth_lora_z_image.py`` do.

The loss is flow matching (``components.flow_matching``, around the forward in ``flow_family.FlowFamily``) with
the scheduler's static shift (Z-Image-Turbo's 3.0, Z-Image's 6.0). Latent shards store the LLM states in bf16
with the mask as one more channel. Exports and samples are ``ZImagePipeline`` folders; LoRA exports load with its
``load_lora_weights`` (``ZImageLoraLoaderMixin``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..config import ConfigError
from ..config.schema import TrainConfig
from ..data.latent_checks import StoredText
from ..data.latents import TEXT_STATES_KEY
from ..memory import activations
from ..outputs.comfy_lora import ComfyLoraNames, Rule, fused
from ..outputs.export import unwrap
from . import reference_models as references
from .base import PixelGrid
from .components import llm_text
from .components.text import TextEncoding
from .components.transformer import (
    build_transformer,
    component_sources,
    load_schedulers,
    load_vae,
    reload_vae_fp32,
    source,
)
from .components.unet import Components
from .flow_family import FlowFamily, llm_text_refusals
from .tiny import TINY_VAE, save, tokenizer_folder

# ZImagePipeline._encode_prompt. The limit: the transformer's caption positions (RoPE axes_lens[0], 1024 by
# default) hold the caption padded to a multiple of 32 and the image's first position after it.
ZIMAGE_TEXT = llm_text.LLMTextSettings(layers=(-2,), max_length=512, limit=992, enable_thinking=True, masked=True)
SCALING_FACTOR, SHIFT_FACTOR = 0.3611, 0.1159  # Z-Image's VAE is FLUX.1's
# The tiny pipeline's scheduler: Z-Image-Turbo's scheduler_config.json (Z-Image's own ships shift 6.0; a run reads
# its pipeline's)
ZIMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
# The tiny pipeline: 1 refiner + 2 main blocks of 2 heads x 16 channels on the tiny Qwen3's 32-channel states.
TINY_ZIMAGE_TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
                               n_refiner_layers=1, n_heads=2, n_kv_heads=2, qk_norm=True,
                               cap_feat_dim=llm_text.TINY_QWEN3["hidden_size"], axes_dims=[8, 4, 4],
                               axes_lens=[1024, 32, 32])
# Two levels (2x downsampling): a 32 px test image is 16x16 latents, 64 patches, a multiple of the 32 the
# transformer pads the image's tokens to with a learned pad token (attended, not masked). As for 512 and 1024 px
# squares, no pad token stands in for the image: its gradient, summed over 28 of 32 tokens, would dominate the
# tiny runs' checks.
TINY_ZIMAGE_VAE = dict(TINY_VAE, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                       block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                       up_block_types=("UpDecoderBlock2D",) * 2)
# model.adapter presets: the attention projections of every block, + the SwiGLU feed-forward, every Linear
# layer of the blocks (the embedders and the final layer left out)
BLOCKS = r"(noise_refiner|context_refiner|layers)\.\d+\."
ADAPTER_PRESETS = {
    "attention": rf"{BLOCKS}attention\.(to_q|to_k|to_v|to_out\.0)",
    "attention_ffn": rf"{BLOCKS}(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123])",
    "all_linear": rf"{BLOCKS}.+",
}

# model.adapter.export_kohya: the original checkpoint's names (ComfyUI's NextDiT; comfy.utils.z_image_to_diffusers):
# q, k, v fused in attention.qkv, to_out.0 is attention.out; written with lora.down / lora.up, the form whose
# fused qkv _convert_non_diffusers_z_image_lora_to_diffusers splits. The embedder and the final layer have other
# names in diffusers (all_x_embedder.2-1, all_final_layer.2-1) that the converter does not map back: none here.
_BLOCK = r"((?:noise_refiner|context_refiner|layers)\.\d+)\."
ZIMAGE_COMFY = ComfyLoraNames(rules=(
    *fused(_BLOCK + r"attention\.{}", r"\1.attention.qkv", ("to_q", "to_k", "to_v")),
    Rule(_BLOCK + r"attention\.to_out\.0", r"\1.attention.out"),
    Rule(_BLOCK + r"(feed_forward\.w[123]|adaLN_modulation\.0)", r"\1.\2"),
    Rule(r"t_embedder\.mlp\.[02]|cap_embedder\.1", r"\g<0>"),
), style="dot", alpha=True, reader="_convert_non_diffusers_z_image_lora_to_diffusers",
    # LoKr / LoHa: ComfyUI maps diffusers' Z-Image names (its z_image_to_diffusers) and diffusers reads them
    # (_convert_non_diffusers_lokr_to_diffusers, ai-toolkit's layout)
    lycoris_diffusers_names=True)


@dataclass
class ZImageModels(Components):
    tokenizer: Any  # llm_text.PromptTokenizer: the chat template, model.llm.max_length tokens
    text_encoder: torch.nn.Module  # Qwen3Model, frozen
    vae: torch.nn.Module  # frozen, with its shift factor
    transformer: torch.nn.Module  # trained
    noise_scheduler: Any  # FlowMatchEulerDiscreteScheduler: the sigma table
    inference_scheduler: Any
    reload_fp32: Optional[Callable[[str], torch.nn.Module]] = None
    _fp32_copies: dict = field(default_factory=dict, repr=False)


def blocks(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks in execution order: the image's and the caption's refiners, then the main blocks."""
    return [*net.noise_refiner, *net.context_refiner, *net.layers]


def shard_units(net: torch.nn.Module, level: str) -> list[torch.nn.Module]:
    """FSDP2 units: each block (``layer`` and ``block`` alike); embedders and the final layer stay with the root."""
    return blocks(net)


def build_zimage_models(cfg, device: torch.device, seed: int, text_device: torch.device | None = None,
                        net_device: torch.device | None = None) -> ZImageModels:
    """The components from ``model.*``: the LLM frozen (``model.text_encoder.dtype``, on ``text_device``, None:
    ``device``), the VAE frozen
    (``model.vae.dtype``), the transformer from ``model.transformer`` (from scratch with its params)."""
    from diffusers import ZImageTransformer2DModel

    def load_llm(dev, dtype):
        src, kw = source(cfg, "text_encoder")
        if src is None:
            raise ConfigError("Z-Image's text encoder has no source: set model.pretrained or "
                              "model.text_encoder.pretrained")
        return llm_text.load_llm(src, "text_encoder", "model.text_encoder.pretrained", dev, dtype, **kw)

    def reload_fp32(name: str) -> torch.nn.Module:
        return reload_vae_fp32(cfg) if name == "vae" else load_llm(torch.device("cpu"), torch.float32)

    tok_src, tok_kw = source(cfg, "tokenizer")
    if tok_src is None:
        raise ConfigError("Z-Image's tokenizer has no source: set model.pretrained or model.tokenizer.pretrained")
    tokenizer = llm_text.load_tokenizer(tok_src, "tokenizer", "model.tokenizer.pretrained", ZIMAGE_TEXT,
                                        cfg.llm.max_length, **tok_kw)
    noise_scheduler, inference_scheduler = load_schedulers(cfg)
    llm_dtype = llm_text.frozen_dtype(cfg.text_encoder.dtype, cfg.mixed_precision)
    return ZImageModels(
        tokenizer=tokenizer, text_encoder=load_llm(text_device or device, llm_dtype),
        vae=load_vae(cfg, device), transformer=build_transformer(cfg, ZImageTransformer2DModel, net_device or device, seed),
        noise_scheduler=noise_scheduler, inference_scheduler=inference_scheduler, reload_fp32=reload_fp32)


def check_models(m: ZImageModels) -> None:
    """The components fit together (a transformer of another size, a 4-channel VAE ...)."""
    c, width = unwrap(m.transformer).config, m.text_encoder.config.hidden_size * len(ZIMAGE_TEXT.layers)
    problems = [
        (c.in_channels != m.vae.config.latent_channels,
         f"in_channels {c.in_channels} != the VAE's latent_channels {m.vae.config.latent_channels}"),
        (c.cap_feat_dim != width, f"cap_feat_dim {c.cap_feat_dim} != the text encoder's hidden_size {width}"),
    ]
    for bad, message in problems:
        if bad:
            raise ConfigError(f"the Z-Image transformer does not fit the pipeline's other components: {message} "
                              "(model.transformer.params or model.transformer.pretrained)")


class ZImage(FlowFamily):
    name = text_tag = "zimage"
    display_name = "Z-Image"
    pipeline_classes = ("ZImagePipeline",)
    card_tags = ("z-image", "z-image-diffusers")
    net_class = "ZImageTransformer2DModel"
    shard_units = staticmethod(shard_units)
    adapter_presets = ADAPTER_PRESETS
    comfy_lora_names = ZIMAGE_COMFY
    forward_names = ("x", "t")

    def build_models(self) -> ZImageModels:
        models = build_zimage_models(self.cfg.model, self.device, self.seed, self.text_device, self.net_device)
        check_models(models)
        return models

    @classmethod
    def refusals(cls, cfg: TrainConfig) -> list[tuple[bool, str]]:
        return llm_text_refusals(cfg, cls.display_name)

    @classmethod
    def text_limits(cls, cfg: TrainConfig) -> dict[str, tuple[int, str]]:
        return {"model.llm.max_length": (ZIMAGE_TEXT.limit, "ZImageTransformer2DModel's caption positions "
                                                            "(RoPE axes_lens[0] 1024, captions padded to 32)")}

    @classmethod
    def pixel_grid(cls, net_conf: dict, vae_factor: int) -> PixelGrid:
        patch = int((net_conf.get("all_patch_size") or (2,))[0])
        return PixelGrid(vae_factor * patch, None, f"{patch}x{patch} patches of the VAE's {vae_factor} px per latent")

    @classmethod
    def text_tokens(cls, cfg: TrainConfig) -> int:
        """The LLM's tokens per caption at most (the real ones are fewer): the memory plan's text side."""
        return int(cfg.model.llm.max_length or ZIMAGE_TEXT.max_length)

    @property
    def max_sequence_length(self) -> int:
        return self.models.tokenizer.max_length

    @property
    def tokenizers(self):
        return (self.models.tokenizer,)

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.models.vae, self.models.text_encoder]

    # -- the step ---------------------------------------------------------------------------------
    def condition(self, batch: dict, validation: bool = False) -> tuple[list[torch.Tensor], None]:
        """(each sample's real caption tokens [L_i, D] float32, no pooled): stored in latent shards (the
        mask their last channel), else encoded by the frozen LLM."""
        if TEXT_STATES_KEY in batch:
            stored = batch[TEXT_STATES_KEY].to(self.device, non_blocking=True).float()
            states, mask = llm_text.split_mask(stored, True)
        else:
            tok = self.models.tokenizer
            states, _, mask = llm_text.encode_llm(self.models.text_encoder, batch["input_ids"], tok.pad_token_id,
                                                  ZIMAGE_TEXT)
        return llm_text.real_tokens(states, mask), None

    def encode_condition(self, batch: dict, validation: bool):
        return self.condition({k: v for k, v in batch.items() if k != TEXT_STATES_KEY}, validation)

    def transformer_inputs(self, latents: torch.Tensor, states, pooled) -> dict:
        return dict(cap_feats=states)

    def pack(self, latents: torch.Tensor) -> list[torch.Tensor]:
        return list(latents.unsqueeze(2).unbind(0))  # one frame per sample, as the pipeline passes them

    def unpack(self, out, latents_shape: torch.Size) -> torch.Tensor:
        return -torch.stack(list(out)).squeeze(2)  # Z-Image predicts x_0 - noise: the velocity negated

    def transformer_timestep(self, timesteps: torch.Tensor) -> torch.Tensor:
        return (1000 - timesteps) / 1000

    def compile_units(self, net: torch.nn.Module) -> list[torch.nn.Module]:
        return blocks(net)

    def stored_text(self) -> StoredText:
        width = llm_text.stored_width(self.models.text_encoder.config.hidden_size, ZIMAGE_TEXT)
        return StoredText(self.max_sequence_length, width, 1, self.text_tag)

    def flops_inputs(self, config, h: int, w: int) -> dict:
        n = self.max_sequence_length
        return dict(x=[torch.empty(config.in_channels, 1, h, w, device="meta")], t=torch.ones(1, device="meta"),
                    cap_feats=[torch.empty(n, config.cap_feat_dim, device="meta")])

    def text_encoder_runs(self) -> list[tuple[torch.nn.Module, int, int]]:
        return [(self.models.text_encoder, self.max_sequence_length, 1)]

    def component_sources(self) -> dict:
        return component_sources(self.cfg.model, ("transformer", "vae", "text_encoder"))

    # -- artifacts --------------------------------------------------------------------------------
    def pipeline(self, transformer: torch.nn.Module, for_export: bool = False):
        """A ZImagePipeline of the run's components with ``transformer``; ``for_export``: the frozen parts in
        fp32 as loaded."""
        from diffusers import ZImagePipeline

        m = self.models
        parts = {n: m.full_precision(n) if for_export else getattr(m, n) for n in ("vae", "text_encoder")}
        return ZImagePipeline(scheduler=copy.deepcopy(m.inference_scheduler), tokenizer=m.tokenizer.tokenizer,
                              transformer=unwrap(transformer), **parts)

    # -- with no run ------------------------------------------------------------------------------
    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """A ``ZImagePipeline``: the tiny Qwen tokenizer and Qwen3Model, a 16-channel VAE with a shift factor, a
        tiny transformer, Z-Image's scheduler."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

        scratch = tokenizer_folder(out, "tokenizer")
        tokenizer = llm_text.build_qwen_tokenizer(scratch)
        pipe = ZImagePipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER),
            vae=AutoencoderKL(**TINY_ZIMAGE_VAE, scaling_factor=scaling_factor or SCALING_FACTOR,
                              shift_factor=SHIFT_FACTOR, force_upcast=False),
            text_encoder=llm_text.tiny_qwen3(len(tokenizer)), tokenizer=tokenizer,
            transformer=ZImageTransformer2DModel(**TINY_ZIMAGE_TRANSFORMER))
        return save(pipe, out, scratch)

    @classmethod
    def text_encoding(cls, pipeline: str, device: torch.device, clip_skip: int = 0,
                      max_length: int | None = None) -> TextEncoding:
        """The LLM's real-token states with their mask (``max_length`` tokens, None: 512), bf16 in shards."""
        if clip_skip:
            raise ValueError("Z-Image conditions on its LLM's hidden_states[-2]: clip skip does not apply")
        length = llm_text.check_length(max_length, ZIMAGE_TEXT, "--max-length", "ZImagePipeline")
        tokenizer = llm_text.load_tokenizer(pipeline, "tokenizer", "the pipeline's tokenizer/", ZIMAGE_TEXT, length)
        encoder = llm_text.load_llm(pipeline, "text_encoder", "the pipeline's text_encoder/", device)
        return llm_text.text_encoding(cls.text_tag, tokenizer, encoder, ZIMAGE_TEXT)

    # memory and FLOP estimates ----------------------------------------------------------------------
    @classmethod
    def sample_activation_elements(cls, conf: dict, sample: activations.SampleShape, checkpointing: bool) -> float:
        """Its blocks as single-stream blocks over the image patches and the caption (``memory.activations``)."""
        c = {**cls.net_defaults(), **conf}
        heads = int(c["n_heads"])
        shaped = dict(patch_size=int(c["all_patch_size"][0]), in_channels=int(c["in_channels"]),
                      num_attention_heads=heads, attention_head_dim=int(c["dim"]) // heads, num_layers=0,
                      num_single_layers=int(c["n_layers"]) + 2 * int(c["n_refiner_layers"]))
        return activations.transformer_sample_elements(shaped, sample, checkpointing, latent_channels=16)

    @classmethod
    def reference_models(cls) -> dict[str, references.ReferenceModel]:
        """Z-Image (6B: its transformer's config.json) with Qwen3-4B, 512 tokens."""
        z = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
                 n_heads=30, n_kv_heads=30, qk_norm=True, cap_feat_dim=2560, axes_dims=[32, 48, 48],
                 axes_lens=[1536, 512, 512])
        return {"Z-Image": references.ReferenceModel(cls.net_class, z, ("Qwen3-4B",), ZIMAGE_TEXT.max_length)}


__all__ = ["ZIMAGE_TEXT", "ZImage", "ZImageModels", "build_zimage_models", "blocks"]
