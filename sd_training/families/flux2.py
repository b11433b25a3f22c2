"""FLUX.2 (dev and klein): a ``Flux2Transformer2DModel`` trained with flow matching on the latents of
``AutoencoderKLFlux2``, conditioned on hidden states of a decoder-only LLM. What both share is here; the
text encoders and their pipelines are ``flux2_klein.py`` (Qwen3, ``Flux2KleinPipeline``) and ``flux2_dev.py``
(Mistral-3, ``Flux2Pipeline``).

As the FLUX.2 pipelines (and diffusers' ``train_dreambooth_lora_flux2*.py``) see the image:

* latents: the VAE's posterior (mean or sample) in 2x2 patches (``_patchify_latents``: [B, 4C, h/2, w/2]),
  each of the 4C channels normalised with the VAE's batch-norm running statistics,
  ``(z - running_mean) / sqrt(running_var + batch_norm_eps)`` (``_encode_vae_image``). The family keeps
  them unpatchified ([B, C, h, w]: the VAE's channels and 8x grid, as latent shards and the memory plan
  expect), the same numbers in another order; the noise is drawn in that layout, and the loss is the
  per-sample mean over all of them, so the order does not change it;
* the transformer's tokens: the patches packed row by row (``_pack_latents``: [B, h/2 * w/2, 4C]), with
  4-axis position ids (t, row, column, 0) (``_prepare_latent_ids``); the text tokens' ids are (0, 0, 0, l)
  (``_prepare_text_ids``); there is no pooled embedding;
* timestep: sigma (the transformer multiplies by 1000); a guidance-distilled transformer
  (``guidance_embeds``: FLUX.2 dev) gets ``model.guidance_embed``, klein none.

The loss is flow matching around the transformer (``flow_family.FlowFamily``), with the shift that grows with
the image's token count (the scheduler's ``use_dynamic_shifting``, as Flux.1) unless ``flow_matching`` sets
another: diffusers' example trains on the unshifted table, the pipelines sample with an empirical shift.
"""

from __future__ import annotations

import abc
import copy
from typing import Any

import torch

from ..config import ConfigError
from ..config.schema import ModelConfig, TrainConfig
from ..data.latents import POOLED_KEY, TEXT_STATES_KEY, StoredText
from ..loading import load_component
from ..memory import activations
from ..outputs.export import unwrap
from ..speed.precision import frozen_vae_dtype
from .base import PixelGrid, SampleSettings
from .components import llm_text
from .components import vae as vae_encoding
from .components.transformer import source
from .components.unet import frozen, load_weights
from .flow_family import FlowFamily

# FLUX.2's scheduler (scheduler/scheduler_config.json of FLUX.2-dev and klein): Flux.1's, dynamic shifting.
FLUX2_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                       base_image_seq_len=256, max_image_seq_len=4096)
FLUX2_LATENT_CHANNELS = 32  # AutoencoderKLFlux2's (the memory plan's default)
# The tiny pipelines' VAE: 8 latent channels (the real one has 32) x 4 patch positions = the transformer's 32
# input channels; four levels, 8 px per latent as the real one.
TINY_FLUX2_VAE = dict(block_out_channels=(32, 32, 64, 64), layers_per_block=1, latent_channels=8, norm_num_groups=32,
                      sample_size=64, use_quant_conv=True, use_post_quant_conv=True)
# The tiny transformer: 1 double- + 1 single-stream block of 2 heads x 16 (rotary axes 4 x 4 = 16).
TINY_FLUX2_TRANSFORMER = dict(patch_size=1, in_channels=4 * TINY_FLUX2_VAE["latent_channels"], num_layers=1,
                              num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                              timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4))


# -- latents: the pipelines' own static helpers, so the layout is theirs by construction -------------------
def _pipe():
    from diffusers import Flux2Pipeline

    return Flux2Pipeline


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, 4C, h/2, w/2] (``Flux2Pipeline._patchify_latents``)."""
    return _pipe()._patchify_latents(latents)


def unpatchify(patches: torch.Tensor) -> torch.Tensor:
    """[B, 4C, h/2, w/2] -> [B, C, h, w] (``Flux2Pipeline._unpatchify_latents``)."""
    return _pipe()._unpatchify_latents(patches)


def bn_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) [1, 4C, 1, 1] float32 of the VAE's batch norm over the patchified latents: what the pipeline
    normalises latents with (``sqrt(running_var + batch_norm_eps)``)."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).float()
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).float() + vae.config.batch_norm_eps)
    return mean, std


def normalize(vae, latents: torch.Tensor, std_only: bool = False) -> torch.Tensor:
    """The VAE's latents [B, C, h, w] (float32) in the transformer's units, unpatchified; ``std_only``: a
    posterior std (divided by the batch norm's std, not shifted)."""
    mean, std = bn_stats(vae)
    patches = patchify(latents.float())
    out = patches / std.to(patches.device) if std_only else (patches - mean.to(patches.device)) / std.to(patches.device)
    return unpatchify(out)


class NormalizedPosterior:
    """The VAE's posterior in the transformer's units (:func:`normalize`): what ``components.vae.encode`` reads."""

    def __init__(self, vae, dist):
        self.vae, self.dist = vae, dist

    @property
    def mean(self) -> torch.Tensor:
        return normalize(self.vae, self.dist.mean)

    @property
    def std(self) -> torch.Tensor:
        return normalize(self.vae, self.dist.std, std_only=True)

    def sample(self, generator=None) -> torch.Tensor:
        return normalize(self.vae, self.dist.sample(generator=generator))


class NormalizedVAE(torch.nn.Module):
    """``AutoencoderKLFlux2`` as the one VAE encode (``components.vae``), latent shards
    (``scripts/precompute_latents.py``) and their checks see it: ``encode(pixels).latent_dist`` is already in
    the transformer's units, so its ``scaling_factor`` is 1 and its ``shift_factor`` 0 (the normalisation
    is per channel, by the batch norm's statistics, which the VAE's fingerprint covers)."""

    def __init__(self, vae):
        from diffusers.configuration_utils import FrozenDict

        super().__init__()
        self.vae = vae
        self.config = FrozenDict({**vae.config, "scaling_factor": 1.0, "shift_factor": 0.0})

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    def encode(self, pixels: torch.Tensor):
        from types import SimpleNamespace

        return SimpleNamespace(latent_dist=NormalizedPosterior(self.vae, self.vae.encode(pixels).latent_dist))


def tokens(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> the transformer's tokens [B, h/2 * w/2, 4C] (patchify, ``_pack_latents``)."""
    return _pipe()._pack_latents(patchify(latents))


def untokens(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The transformer's output [B, h/2 * w/2, 4C] -> [B, C, h, w] (the inverse of :func:`tokens`)."""
    b, c, h, w = shape
    return unpatchify(out.permute(0, 2, 1).reshape(b, 4 * c, h // 2, w // 2))


def image_ids(latents: torch.Tensor) -> torch.Tensor:
    """(t, row, column, layer) ids [B, h/2 * w/2, 4] of the patches (``_prepare_latent_ids``)."""
    b, c, h, w = latents.shape
    return _pipe()._prepare_latent_ids(latents.new_empty(b, 4 * c, h // 2, w // 2, device="meta")).to(latents.device)


def text_ids(states: torch.Tensor) -> torch.Tensor:
    """(0, 0, 0, l) ids [B, L, 4] of the text tokens (``_prepare_text_ids``)."""
    return _pipe()._prepare_text_ids(states).to(states.device)


# -- components ----------------------------------------------------------------------------------------------
def load_flux2_vae(cfg: ModelConfig, device: torch.device | None, dtype: torch.dtype) -> torch.nn.Module:
    """The frozen ``AutoencoderKLFlux2`` of ``model.vae.pretrained`` / the pipeline's ``vae/``."""
    from diffusers import AutoencoderKLFlux2

    src, kw = source(cfg, "vae")
    if src is None:
        raise ConfigError("the VAE has no source: set model.pretrained or model.vae.pretrained")
    vae = load_weights(AutoencoderKLFlux2.from_pretrained, src, "vae", "model.vae.pretrained", **kw)
    return frozen(vae, device or torch.device("cpu"), dtype)


def frozen_flux2_vae(cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
    return load_flux2_vae(cfg, device, frozen_vae_dtype(cfg.vae.dtype, cfg.mixed_precision))


def check_models(transformer, vae, text_width: int, what: str) -> None:
    """The components fit together (a transformer of another size, another VAE ...)."""
    c = unwrap(transformer).config
    problems = [
        (c.in_channels != 4 * vae.config.latent_channels,
         f"in_channels {c.in_channels} != 4 x the VAE's latent_channels {vae.config.latent_channels} (2x2 patches)"),
        (c.joint_attention_dim != text_width,
         f"joint_attention_dim {c.joint_attention_dim} != the {what} states' width {text_width}"),
    ]
    for bad, message in problems:
        if bad:
            raise ConfigError(f"the FLUX.2 transformer does not fit the pipeline's other components: {message} "
                              "(model.transformer.params or model.transformer.pretrained)")


class Flux2Family(FlowFamily):
    """What FLUX.2 dev and klein share (see the module); a subclass names its text encoder and pipeline."""

    text_settings: llm_text.LLMTextSettings  # how the pipeline's encode_prompt runs its LLM

    net_class = "Flux2Transformer2DModel"
    card_tags = ("flux2", "flux2-diffusers")
    # LoRA presets by Flux2's layer names: the joint attention's projections (the double blocks' image and text
    # sides, the single blocks' fused qkv+mlp input and output); + the double blocks' feed-forwards; every
    # Linear. diffusers' example trains to_q/k/v/out.0 + the single blocks' to_qkv_mlp_proj and to_out.
    _ATTENTION = (r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|"
                  r"to_add_out)|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)")
    adapter_presets = {
        "attention": _ATTENTION,
        "attention_ffn": rf"{_ATTENTION}|transformer_blocks\.\d+\.ff(_context)?\.(linear_in|linear_out)",
        "all_linear": r".+",
    }

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        m, d = cfg.model, cfg.dataset.params
        refusals = [
            (m.text_encoder_2.pretrained is not None or m.tokenizer_2.pretrained is not None
             or m.text_encoder_3.pretrained is not None or m.tokenizer_3.pretrained is not None,
             f"{cls.display_name} has one text encoder (model.text_encoder / model.tokenizer): model.text_encoder_2/3 "
             "and tokenizer_2/3 are other families'"),
            (m.t5 != type(m.t5)(), f"model.t5 is SD3's and Flux.1's T5; {cls.display_name}'s text encoder is an LLM "
                                   "whose length is model.llm.max_length"),
            (m.text_encoder.max_length is not None,
             f"model.text_encoder.max_length: {cls.display_name}'s LLM length is model.llm.max_length"),
            (d.resolution % 16 or (d.aspect_buckets and d.bucket_step % 16),
             f"{cls.display_name} patches the 8x-downsampled latents 2x2: dataset.params.resolution ({d.resolution}) "
             f"and, with aspect buckets, dataset.params.bucket_step ({d.bucket_step}) must be multiples of 16"),
        ]
        for refused, message in refusals:
            if refused:
                raise ConfigError(message)
        super().validate(cfg)

    @classmethod
    def text_limits(cls, cfg: TrainConfig) -> dict[str, tuple[int, str]]:
        return {"model.llm.max_length": (cls.text_settings.limit,
                                         f"{cls.pipeline_classes[0]}'s tokenizer_max_length")}

    @classmethod
    def text_length(cls, cfg: TrainConfig) -> int:
        """LLM tokens per caption, template included: ``model.llm.max_length``, else the pipeline's 512."""
        return int(cfg.model.llm.max_length or cls.text_settings.max_length)

    @classmethod
    def text_tokens(cls, cfg: TrainConfig) -> int:
        return cls.text_length(cfg)

    @classmethod
    def pixel_grid(cls, net_conf: dict, vae_factor: int) -> PixelGrid:
        return PixelGrid(vae_factor * 2, None, f"2x2 patches of the VAE's {vae_factor} px per latent")

    @classmethod
    def takes_guidance_embed(cls, net_conf: dict | None) -> bool | None:
        """FLUX.2 dev's transformer has a guidance embedding (``guidance_embeds``); klein's has none."""
        return None if net_conf is None else bool(net_conf.get("guidance_embeds", True))

    @classmethod
    def sample_activation_elements(cls, conf: dict, sample, checkpointing: bool) -> float:
        return activations.transformer_sample_elements(conf, sample, checkpointing,
                                                       latent_channels=FLUX2_LATENT_CHANNELS)

    # -- the text ------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def text_width(self) -> int:
        """Channels of the text states (the LLM's hidden size x the layers taken)."""

    def stored_condition(self, batch: dict) -> tuple[torch.Tensor, None]:
        """The LLM states latent shards store (no pooled embedding)."""
        if POOLED_KEY in batch:
            raise ValueError(f"the batch has a stored pooled text embedding ({POOLED_KEY}): these latent shards were "
                             f"not made for {self.display_name} (scripts/precompute_latents.py with its pipeline)")
        return batch[TEXT_STATES_KEY].to(self.device, non_blocking=True).float(), None

    @classmethod
    def latent_vae(cls, pipeline: str, what: str, dtype: torch.dtype) -> torch.nn.Module:
        """The VAE latent shards are made with: the normalising view of ``AutoencoderKLFlux2``."""
        from diffusers import AutoencoderKLFlux2

        return NormalizedVAE(load_component(AutoencoderKLFlux2.from_pretrained, pipeline, "vae", what, torch_dtype=dtype))

    def stored_text(self) -> StoredText:
        return StoredText(self.max_sequence_length, self.text_width, 1, self.text_tag)

    # -- latents and the transformer's forward -------------------------------------------------------------
    def encode(self, pixels: torch.Tensor, mean: bool | None = None, sample_seeds=None) -> torch.Tensor:
        """The one VAE encode, of the posterior normalised as the pipeline does (:class:`NormalizedVAE`)."""
        mean = self.cfg.model.vae.latent_sampling == "mean" if mean is None else mean
        return vae_encoding.encode(NormalizedVAE(self.models.vae), pixels, 1.0, 0.0, mean=mean, sample_seeds=sample_seeds)

    def guidance(self, batch_size: int) -> torch.Tensor | None:
        if not self.net.config.guidance_embeds:
            return None
        return torch.full((batch_size,), float(self.cfg.model.guidance_embed), device=self.device, dtype=torch.float32)

    def transformer_inputs(self, latents: torch.Tensor, states: torch.Tensor, pooled: torch.Tensor | None) -> dict:
        return dict(encoder_hidden_states=states, txt_ids=text_ids(states), img_ids=image_ids(latents),
                    guidance=self.guidance(len(latents)))

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return tokens(latents)

    def unpack(self, out: torch.Tensor, latents_shape: torch.Size) -> torch.Tensor:
        return untokens(out, latents_shape)

    def transformer_timestep(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps / 1000  # sigma: the transformer multiplies by 1000

    def image_seq_len(self, latents: torch.Tensor) -> int:
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)

    def validation_timesteps(self, n: int) -> torch.Tensor:
        """Spread over (0, 1000) (the resolution shift's table depends on the image size)."""
        return torch.arange(1, n + 1, dtype=torch.float32) * (self.num_timesteps / (n + 1))

    def flops_inputs(self, config, h: int, w: int) -> dict:
        n, length = (h // 2) * (w // 2), self.max_sequence_length
        return dict(hidden_states=torch.empty(1, n, config.in_channels, device="meta"),
                    encoder_hidden_states=torch.empty(1, length, config.joint_attention_dim, device="meta"),
                    timestep=torch.ones(1, device="meta"), img_ids=torch.zeros(n, 4, device="meta"),
                    txt_ids=torch.zeros(length, 4, device="meta"),
                    guidance=torch.ones(1, device="meta") if config.guidance_embeds else None)

    # -- artifacts ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def pipeline_class(self) -> type:
        """The diffusers pipeline class."""

    def pipeline_config(self) -> dict:
        """Extra arguments of the pipeline's constructor (klein: ``is_distilled``)."""
        return {}

    def pipeline(self, transformer: torch.nn.Module, for_export: bool = False):
        """The family's pipeline with ``transformer``; ``for_export``: the frozen parts in fp32 as loaded."""
        m = self.models
        parts: dict[str, Any] = {n: m.full_precision(n) if for_export else getattr(m, n) for n in ("vae", "text_encoder")}
        tokenizer = getattr(m.tokenizer, "tokenizer", m.tokenizer)  # the pipeline's own, not the template wrapper
        return self.pipeline_class()(scheduler=copy.deepcopy(m.inference_scheduler), tokenizer=tokenizer,
                                     transformer=unwrap(transformer), **parts, **self.pipeline_config())

    def sampling(self, settings: SampleSettings) -> SampleSettings:
        """A guidance-distilled transformer samples with the guidance it trained with (the pipeline's
        guidance_scale is the embedding's input); klein with the trainer's classifier-free guidance."""
        if self.net.config.guidance_embeds:
            return settings._replace(guidance=float(self.cfg.model.guidance_embed))
        return settings

    def component_sources(self) -> dict:
        from .components.transformer import component_sources

        return component_sources(self.cfg.model, ("transformer", "vae", "text_encoder"))
