"""The components the transformer families (sd3, flux) share: the trained diffusion transformer, the
16-channel VAE with its shift factor, the flow-matching schedulers, FSDP2 shard units, and the config
checks of keys that belong to the UNet families.

Every component comes from ``model.<component>.pretrained`` when set, else from ``model.pretrained`` (a
pipeline root through its standard subfolder, or a folder that is the component). The transformer is built
from scratch when ``model.transformer.params`` is given (seeded: every rank and restart builds the same).
"""

from __future__ import annotations

import logging

import torch

from ...config import ConfigError
from ...config.schema import ModelConfig, ObjectiveConfig, TrainConfig, UNetConfig
from ...loading import check_constructor_params, load_component
from ...speed.precision import frozen_vae_dtype
from ..options import TransformerConfig
from . import quantized_base
from .unet import frozen, load_weights

log = logging.getLogger(__name__)


# model.adapter presets of the MMDiTs (SD3, Flux): the joint attention's image and text projections; + the
# feed-forward layers (Flux's single blocks: their MLP input and fused output); every Linear layer (the
# patch-embedding convolution left out), as diffusers' DreamBooth LoRA scripts choose them
_ATTENTION = r"attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
ADAPTER_PRESETS = {
    "attention": rf".*\.{_ATTENTION}",
    "attention_ffn": rf".*\.({_ATTENTION}|ff(_context)?\.net\.(0\.proj|2)|proj_mlp)|single_transformer_blocks\.\d+\.proj_out",
    "all_linear": r"(?!pos_embed\.).+",
}


def source(cfg: ModelConfig, component: str) -> tuple[str | None, dict]:
    """(where ``component`` is read from, the revision kwargs): its own ``pretrained``, else the pipeline's."""
    own = getattr(cfg, component).pretrained
    return own or cfg.pretrained, dict(revision=cfg.revision) if cfg.revision and not own else {}


def validate_common(cfg: TrainConfig, family: str, trains_clip: bool = False, net_class=None) -> None:
    """Refuse the keys of the UNet families that a transformer family would silently ignore, and
    ``model.transformer.params`` the transformer's class (``net_class()``, imported when there are params)
    does not take. ``trains_clip``: the family trains its CLIP encoders with the transformer and sets their
    length (``model.text_encoder.train`` / ``max_length``: sd3)."""
    m = cfg.model
    refusals = [
        (m.train_target != "unet", f"model.train_target=vae trains a UNet pipeline's autoencoder; {family} trains its "
                                   "transformer (leave model.train_target at unet)"),
        (m.unet != UNetConfig(), f"model.unet applies to the UNet families; {family} trains model.transformer "
                                 "(pretrained, or params for from-scratch training)"),
        (cfg.objective != ObjectiveConfig(), f"the 'objective' section is the UNet families' diffusion loss; {family} "
                                             "trains with flow matching: set the 'flow_matching' section instead"),
        (m.attention == "sliced", f"model.attention=sliced: {family}'s transformer has no sliced attention; use sdpa"),
        (m.xformers or m.attention == "xformers", f"model.attention=xformers: {family}'s joint attention runs with "
                                                  "PyTorch SDPA (flash / memory-efficient kernels): use sdpa"),
        (m.channels_last == "on", f"model.channels_last applies to UNet convolutions; {family}'s transformer takes tokens"),
        (m.text_encoder.type != "clip", f"{family}'s CLIP encoders are read from the pipeline: model.text_encoder.type "
                                        "must be clip"),
        (m.text_encoder.train and not trains_clip, f"model.text_encoder.train: {family} trains the transformer only "
                                                   "(its text encoders stay frozen)"),
        (m.text_encoder.clip_skip not in (0,), f"model.text_encoder.clip_skip: {family} conditions as its pipeline "
                                               "does; leave it at 0"),
        (m.text_encoder.max_length is not None and not trains_clip,
         f"model.text_encoder.max_length: {family}'s CLIP length is the tokenizer's 77; T5's is model.t5.max_length"),
    ]
    for refused, message in refusals:
        if refused:
            raise ConfigError(message)
    if m.transformer.params and net_class is not None:
        check_transformer_params(net_class(), m.transformer.params)
    from . import flow_matching

    flow_matching.validate(cfg.flow_matching)


def check_transformer_params(cls, params: dict, key: str = "model.transformer.params") -> None:
    """Refuse constructor arguments ``cls`` does not take, naming the closest one."""
    check_constructor_params(cls, params, key)


def build_transformer(cfg: ModelConfig, cls, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The trained transformer (``cls``: SD3Transformer2DModel, FluxTransformer2DModel) on ``device`` in
    fp32, train mode, with gradient checkpointing when asked; from ``model.transformer.params`` (seeded) or
    from ``model.transformer.pretrained`` / ``model.pretrained``'s ``transformer/``."""
    t: TransformerConfig = cfg.transformer
    gguf = quantized_base.gguf_net(cfg, cls, source(cfg, "transformer")[0], "transformer", bool(t.params))
    if gguf is not None:  # model.adapter.base_gguf: the file is the net (quantised), on the CPU
        net = gguf
    elif t.params:
        check_transformer_params(cls, t.params)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                net = cls(**t.params)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"'model.transformer.params' do not build {cls.__name__}: {e}") from None
    else:
        src, kw = source(cfg, "transformer")
        if src is None:
            raise ConfigError("the transformer has no source: set model.pretrained, model.transformer.pretrained or "
                              "model.transformer.params (from scratch)")
        if quantized_base.enabled(cfg):  # read in the training precision: half the host memory of fp32
            kw["torch_dtype"] = quantized_base.build_dtype(cfg)
        net = load_weights(cls.from_pretrained, src, "transformer", "model.transformer.pretrained", **kw)
    # A quantised base (model.adapter.base_quantization) stays on the CPU: it moves layer by layer as it is quantised.
    if gguf is None:
        net.to(device=quantized_base.build_device(cfg, device), dtype=quantized_base.build_dtype(cfg))
        net.requires_grad_(True)
    net.train()
    if cfg.gradient_checkpointing:
        net.enable_gradient_checkpointing()
    return net


def transformer_blocks(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks in execution order: SD3's ``transformer_blocks``; Flux's double-stream
    ``transformer_blocks`` then its ``single_transformer_blocks``."""
    blocks: list[torch.nn.Module] = []
    for name in ("transformer_blocks", "single_transformer_blocks"):
        blocks.extend(getattr(net, name, None) or [])
    return blocks


def shard_units(net: torch.nn.Module, level: str) -> list[torch.nn.Module]:
    """FSDP2 units: each transformer block (``layer`` and ``block`` alike: a block is the transformer's
    layer); the embeddings and the final norm / projection stay with the root module."""
    return transformer_blocks(net)


def load_vae(cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
    """The frozen AutoencoderKL (``model.vae``) in ``model.vae.dtype`` (auto: bf16 under bf16, else fp32)."""
    from diffusers import AutoencoderKL

    src, kw = source(cfg, "vae")
    if src is None:
        raise ConfigError("the VAE has no source: set model.pretrained or model.vae.pretrained")
    vae = with_shift(load_weights(AutoencoderKL.from_pretrained, src, "vae", "model.vae.pretrained", **kw))
    return frozen(vae, device, frozen_vae_dtype(cfg.vae.dtype, cfg.mixed_precision))


def load_vae_of(vae_class: str, cfg: ModelConfig, device: torch.device | None,
                dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The frozen diffusers VAE of class ``vae_class`` (``AutoencoderKLFlux2``, ``AutoencoderKLQwenImage`` ...) of
    ``model.vae.pretrained`` / the pipeline's ``vae/``, on ``device`` (None: the CPU) in ``dtype`` (None:
    ``model.vae.dtype``: auto is bf16 under bf16, else fp32)."""
    import diffusers

    src, kw = source(cfg, "vae")
    if src is None:
        raise ConfigError("the VAE has no source: set model.pretrained or model.vae.pretrained")
    vae = load_weights(getattr(diffusers, vae_class).from_pretrained, src, "vae", "model.vae.pretrained", **kw)
    dtype = frozen_vae_dtype(cfg.vae.dtype, cfg.mixed_precision) if dtype is None else dtype
    return frozen(vae, device or torch.device("cpu"), dtype)


def with_shift(vae):
    """The VAE with a ``shift_factor`` in its config: a VAE saved without one (an SD-style VAE, the
    quickstart's) trains as shift 0 and is exported with ``shift_factor: 0.0``, because the SD3 and Flux
    pipelines decode ``latents / scaling_factor + shift_factor`` and fail on None."""
    if vae.config.get("shift_factor", None) is None:
        vae.register_to_config(shift_factor=0.0)
    return vae


def reload_vae_fp32(cfg: ModelConfig) -> torch.nn.Module:
    """The VAE in fp32 from its source, on the CPU (for exports of a run that keeps it in bf16)."""
    from diffusers import AutoencoderKL

    src, kw = source(cfg, "vae")
    return with_shift(load_weights(AutoencoderKL.from_pretrained, src, "vae", "model.vae.pretrained", **kw))


def load_schedulers(cfg: ModelConfig):
    """(training scheduler, inference scheduler): the pipeline's ``FlowMatchEulerDiscreteScheduler`` (or
    the class its config names) from ``model.noise_scheduler_training`` / ``_inference`` or ``scheduler/``."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    def one(component: str):
        src, kw = source(cfg, component)
        if src is None:
            raise ConfigError(f"the scheduler has no source: set model.pretrained or model.{component}.pretrained")
        conf = load_component(FlowMatchEulerDiscreteScheduler.load_config, src, "scheduler",
                              f"model.{component}.pretrained", **kw)
        cls = getattr(diffusers, conf.get("_class_name", "FlowMatchEulerDiscreteScheduler"), None)
        if cls is None:
            raise ConfigError(f"'model.{component}': unknown scheduler class {conf.get('_class_name')}")
        return cls.from_config(conf)

    training = one("noise_scheduler_training")
    if not isinstance(training, FlowMatchEulerDiscreteScheduler):
        raise ConfigError(f"the training scheduler is a {type(training).__name__}; flow matching reads the sigma table "
                          "of a FlowMatchEulerDiscreteScheduler (model.noise_scheduler_training.pretrained)")
    return training, one("noise_scheduler_inference")


def component_sources(cfg: ModelConfig, names: tuple[str, ...]) -> dict:
    """Where each component came from (sources.json), the transformer from scratch when params are given."""
    out = {}
    for name in names:
        if name == "transformer" and cfg.transformer.params:
            out[name] = {"source": "model.transformer.params (from scratch)"}
        else:
            out[name] = {"source": source(cfg, name)[0]}
    return out


__all__ = ["source", "validate_common", "check_transformer_params", "build_transformer", "transformer_blocks",
           "shard_units", "load_vae", "reload_vae_fp32", "load_schedulers",
           "component_sources"]


class TrainedLength:
    """A pipeline as sample grids, eval images and ``scripts/generate_examples.py`` call it: calls that do
    not say ``max_sequence_length`` pad T5 to the trained length (the pipelines' own defaults are 256 for
    SD3 and 512 for Flux); everything else is the pipeline's."""

    def __init__(self, pipe, max_length: int):
        self.__dict__["_pipe"], self.__dict__["_max_length"] = pipe, max_length

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def __call__(self, *args, **kwargs):
        kwargs.setdefault("max_sequence_length", self._max_length)
        return self._pipe(*args, **kwargs)
