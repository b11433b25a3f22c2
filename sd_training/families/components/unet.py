"""The components of a UNet pipeline (Stable Diffusion's layout: VAE, CLIP text encoder and tokenizer,
UNet, noise schedulers), built from the ``model`` config: what the SD and SDXL families (and the
autoencoder stage on top of them) train with. A family with other components (a transformer, a T5
encoder) builds its own in its module, with the same helpers (``loading.load_component``,
``text_encoders``, ``precision``) and :class:`Components` for its fp32 export copies.

Every component comes from ``model.<component>.pretrained`` when set, else from ``model.pretrained``
(a diffusers pipeline: local folder or hub id). A pipeline root is read through its standard
subfolder (``vae/``, ``unet/`` ...); a folder that *is* the component is read directly. The UNet may
instead be built from scratch from ``model.unet.target`` + ``model.unet.params``.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from ...config import ConfigError
from ...config.schema import ModelConfig
from ...loading import check_constructor_params
from ...loading import load_component as _load
from ...speed.precision import frozen_vae_dtype
from . import quantized_base
from .clip import build_text_encoder

log = logging.getLogger(__name__)


class Components:
    """What every family's set of components offers an export: fp32 copies of the frozen ones.

    A subclass (a dataclass of the family's modules) sets ``reload_fp32`` (component name -> a fresh fp32
    copy from its source) and ``_fp32_copies`` (a dict)."""

    reload_fp32: Optional[Callable[[str], torch.nn.Module]] = None
    _fp32_copies: dict

    def full_precision(self, name: str) -> torch.nn.Module:
        """The frozen component ``name`` as an export should save it: the module itself when it is stored
        in fp32, else an fp32 copy reloaded once from its source, on the CPU. Casting the bf16 copy back up
        would save weights rounded to 8 mantissa bits, not the ones the run started from."""
        module = getattr(self, name)
        if all(p.dtype == torch.float32 for p in module.parameters()):
            return module
        if name not in self._fp32_copies:
            if self.reload_fp32 is None:  # built by hand (tests): the closest we have
                import copy

                self._fp32_copies[name] = copy.deepcopy(module).float()
            else:
                log.info("reloading the %s in fp32 from its source for the export (it trains in %s)",
                         name, next(module.parameters()).dtype)
                self._fp32_copies[name] = frozen(self.reload_fp32(name), torch.device("cpu"))
        return self._fp32_copies[name]


@dataclass
class Models(Components):
    tokenizer: Any
    text_encoder: torch.nn.Module  # frozen, eval, no grad (unless model.text_encoder.train)
    vae: torch.nn.Module  # frozen, eval, no grad
    unet: torch.nn.Module  # trained
    noise_scheduler: Any  # DDPMScheduler: adds training noise, defines the target
    inference_scheduler: Any  # the scheduler exported pipelines and sample grids use
    # component name -> a fresh fp32 copy from its source, for exports of half-precision frozen components
    reload_fp32: Optional[Callable[[str], torch.nn.Module]] = None
    _fp32_copies: dict = field(default_factory=dict, repr=False)

    @property
    def latent_scale(self) -> float:
        # The latent scaling factor belongs to the VAE (its config's scaling_factor).
        return float(self.vae.config.scaling_factor)


# Modules outside diffusers whose model classes model.unet.target may name (in addition to diffusers'
# own): extend with SD_TRAINING_UNET_MODULES=pkg.a,pkg.b. Anything else (subprocess.Popen, os.system,
# a function) is refused: a config names a model, it does not run arbitrary callables.
UNET_MODULES_ENV = "SD_TRAINING_UNET_MODULES"


def resolve_unet_class(target: str):
    """``UNet2DConditionModel``, ``diffusers.UNet2DConditionModel`` or ``package.module.Class``.

    The class must be a ``torch.nn.Module`` with diffusers' ``from_config``, from diffusers or from a
    module allowed by ``SD_TRAINING_UNET_MODULES``."""
    import diffusers
    from diffusers.configuration_utils import ConfigMixin

    name = target.split(".", 1)[1] if target.startswith("diffusers.") else target
    if "." not in name:
        cls = getattr(diffusers, name, None)
        if cls is None:
            raise ConfigError(f"'model.unet.target': diffusers has no class '{name}'")
    else:
        module, _, attr = target.rpartition(".")
        allowed = ["diffusers"] + [m.strip() for m in os.environ.get(UNET_MODULES_ENV, "").split(",") if m.strip()]
        if not any(module == m or module.startswith(m + ".") for m in allowed):
            raise ConfigError(
                f"'model.unet.target': '{target}' is outside diffusers; model classes from other modules must be "
                f"allowed explicitly: {UNET_MODULES_ENV}={module} (comma-separated list of modules)"
            )
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"'model.unet.target': cannot import '{target}': {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and issubclass(cls, ConfigMixin)):
        raise ConfigError(f"'model.unet.target': '{target}' is not a model class (a torch.nn.Module with "
                          "diffusers' from_config)")
    return cls


def check_unet_params(target: str, params: dict) -> None:
    """Reject UNet constructor arguments the target class does not take, naming the closest one."""
    check_constructor_params(resolve_unet_class(target), params, "model.unet.params")


def component_sources(cfg: ModelConfig) -> dict:
    """Where each component came from (a folder, a hub id, or built from model.unet.params), and the
    ``provenance.json`` a component folder carries (e.g. the quickstart's VAE says how it was trained)."""
    import json

    out = {}
    for name in ("unet", "vae", "text_encoder"):
        src = "model.unet.params (from scratch)" if name == "unet" and cfg.unet.params else _source(cfg, name)
        entry = {"source": src}
        if src and os.path.isfile(os.path.join(src, "provenance.json")):
            try:
                with open(os.path.join(src, "provenance.json")) as fh:
                    entry["provenance"] = json.load(fh)
            except (OSError, ValueError):
                pass
        out[name] = entry
    return out


def _source(cfg: ModelConfig, component: str) -> str | None:
    own = getattr(cfg, component).pretrained if component != "unet" else cfg.unet.pretrained
    return own or cfg.pretrained


def build_unet(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    gguf = quantized_base.gguf_net(cfg, resolve_unet_class(cfg.unet.target), _source(cfg, "unet"), "unet",
                                   bool(cfg.unet.params))
    if gguf is not None:  # model.adapter.base_gguf: the file is the net (quantised), on the CPU
        return gguf
    if cfg.unet.params:
        cls = resolve_unet_class(cfg.unet.target)
        # Seeded so every rank (and every restart) starts from the same weights before any broadcast.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                return cls(**cfg.unet.params)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"'model.unet.params' do not build {cls.__name__}: {e}") from None
    src = _source(cfg, "unet")
    cls = resolve_unet_class(cfg.unet.target)
    kwargs = dict(revision=cfg.revision) if cfg.revision and src == cfg.pretrained else {}
    if quantized_base.enabled(cfg):  # read in the training precision: half the host memory of fp32
        kwargs["torch_dtype"] = quantized_base.build_dtype(cfg)
    return load_weights(cls.from_pretrained, src, "unet", "model.unet.pretrained", **kwargs)


# diffusers: "Cannot load <file> because conv_in.bias expected shape torch.Size([128]), but got torch.Size([64])";
# torch: "size mismatch for conv_in.bias: copying a param with shape torch.Size([64]) from checkpoint, the shape
# in current model is torch.Size([128])".
_MISMATCH = (
    re.compile(r"because (?P<name>\S+) expected shape (?P<model>.+?), but got (?P<weights>torch\.Size\(\[[^\]]*\]\))"),
    re.compile(r"size mismatch for (?P<name>[^:\s]+): copying a param with shape (?P<weights>torch\.Size\(\[[^\]]*\]\)) "
               r"from checkpoint, the shape in current model is (?P<model>torch\.Size\(\[[^\]]*\]\))"),
)


def load_weights(loader, src: str, subfolder: str, what: str, **kwargs):
    """``loading.load_component``, with weights whose shapes do not fit the model that the component's
    config.json builds (a config of one model size beside the weights of another) reported as a
    ``ConfigError`` naming the component, its folder and the first parameter that differs."""
    try:
        return _load(loader, src, subfolder, what, **kwargs)
    except (ValueError, RuntimeError) as e:
        text = str(e)
        match = next((m for m in (p.search(text) for p in _MISMATCH) if m), None)
        if match is None and "size mismatch" not in text and "expected shape" not in text:
            raise
        folder = os.path.join(src, subfolder) if os.path.isdir(os.path.join(src, subfolder)) else src
        first = (f"the first that differs is {match.group('name')}: {_shape(match.group('weights'))} in the weights, "
                 f"{_shape(match.group('model'))} in the model" if match else text.splitlines()[0])
        raise ConfigError(
            f"'{what}': the {subfolder} weights in {folder} do not fit the model its config.json describes ({first}). "
            "The config.json and the weights belong to different models (another size or version): put the "
            "matching pair together, or point the key at the right folder") from None


def _shape(text: str) -> str:
    """``torch.Size([64, 4])`` -> ``[64, 4]``."""
    m = re.search(r"\[[^\]]*\]", text)
    return m.group(0) if m else text


def set_attention_backend(unet: torch.nn.Module, cfg: ModelConfig, device: torch.device) -> str:
    """Apply ``model.attention`` / ``model.xformers``; returns the backend actually used."""
    if cfg.attention == "sliced" and not cfg.xformers:
        # Attention computed in slices of heads: less peak memory, slower (diffusers' "auto" slice size).
        unet.set_attention_slice("auto")
        return "sliced"
    want = "xformers" if cfg.xformers or cfg.attention == "xformers" else "sdpa"
    if want == "xformers":
        reason = None
        if device.type != "cuda":
            reason = "xformers kernels run on CUDA only"
        elif importlib.util.find_spec("xformers") is None:
            reason = "xformers is not installed (pip install sd-training[xformers])"
        if reason is None:
            try:
                unet.enable_xformers_memory_efficient_attention()
                return "xformers"
            except Exception as e:  # a build mismatch shows up here, not at import
                reason = f"enabling it failed: {e}"
        log.warning("model.attention=xformers requested but %s; using PyTorch SDPA attention instead", reason)
    from diffusers.models.attention_processor import AttnProcessor2_0

    unet.set_attn_processor(AttnProcessor2_0())
    return "sdpa"


def frozen(module: torch.nn.Module, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    module.requires_grad_(False)
    module.eval()
    return module.to(device=device, dtype=dtype)


def uses_channels_last(cfg: ModelConfig, device: torch.device) -> bool:
    """``model.channels_last``: on, off, or auto: on where the UNet trains on CUDA. cuDNN runs its
    convolutions in NHWC; NCHW tensors are transposed around every one of them (8.8% of a compiled SD 1.x
    step's GPU time on an H100). The CPU's convolutions gain nothing from it, so auto leaves it off there."""
    if cfg.channels_last == "auto":
        return device.type == "cuda" and cfg.train_target == "unet"
    return cfg.channels_last in ("on", True)


def to_channels_last(module: torch.nn.Module) -> torch.nn.Module:
    """The 4-d weights (convolutions) of ``module`` in channels-last memory format, in place: a convolution
    whose weight is channels-last gives channels-last outputs, so the layout carries through the net (the
    element-wise ops keep it, and GroupNorm on the CPU and compiled; CUDA's eager GroupNorm may return NCHW,
    which the next convolution takes as it is). Values, names and shapes are unchanged (saves write them
    contiguous)."""
    return module.to(memory_format=torch.channels_last)


def build_models(cfg: ModelConfig, device: torch.device, seed: int = 0, extra_context_dim: int = 0,
                 net_device: torch.device | None = None) -> Models:
    """The components of a UNet pipeline. ``extra_context_dim``: cross-attention width the UNet expects
    beyond the text encoder's hidden size (a family that concatenates a second encoder's states)."""
    import diffusers
    from diffusers import AutoencoderKL, DDPMScheduler

    rev = dict(revision=cfg.revision) if cfg.revision else {}

    def kw(component):  # the revision applies to the pipeline, not to a component's own source
        return rev if getattr(cfg, component).pretrained is None else {}

    # Frozen (eval, no grad, in model.text_encoder.dtype) unless model.text_encoder.train; clip skip built in.
    text_encoder, tokenizer = build_text_encoder(
        cfg.text_encoder, cfg.pretrained, device, tokenizer_src=cfg.tokenizer.pretrained, revision=cfg.revision,
        gradient_checkpointing=cfg.gradient_checkpointing, mixed_precision=cfg.mixed_precision,
    )
    vae = load_weights(AutoencoderKL.from_pretrained, _source(cfg, "vae"), "vae", "model.vae.pretrained", **kw("vae"))
    noise_scheduler = _load(
        DDPMScheduler.from_pretrained, _source(cfg, "noise_scheduler_training"), "scheduler",
        "model.noise_scheduler_training.pretrained", **kw("noise_scheduler_training"),
    )
    # The inference scheduler keeps its own class (PNDM, DDIM, Euler ...), as saved in its config.
    sched_cfg = _load(
        DDPMScheduler.load_config, _source(cfg, "noise_scheduler_inference"), "scheduler",
        "model.noise_scheduler_inference.pretrained", **kw("noise_scheduler_inference"),
    )
    sched_cls = getattr(diffusers, sched_cfg.get("_class_name", "PNDMScheduler"), None)
    if sched_cls is None:
        raise ConfigError(f"'model.noise_scheduler_inference': unknown scheduler class {sched_cfg.get('_class_name')}")
    inference_scheduler = sched_cls.from_config(sched_cfg)

    # A quantised base (model.adapter.base_quantization) stays on the CPU: it moves layer by layer as it is
    # quantised; with model.block_swap the net is built on the host too (the swap moves what it does not own).
    unet = build_unet(cfg, seed).to(quantized_base.build_device(cfg, net_device or device))
    unet.train()
    channels_last = uses_channels_last(cfg, device)
    if channels_last:
        to_channels_last(unet)
    if cfg.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    set_attention_backend(unet, cfg, device)

    width = text_encoder.config.hidden_size + extra_context_dim
    if unet.config.cross_attention_dim != width:
        raise ConfigError(
            f"UNet cross_attention_dim {unet.config.cross_attention_dim} != the text conditioning's width {width}: "
            f"set model.unet.params.cross_attention_dim={width}"
        )
    if unet.config.in_channels != vae.config.latent_channels:
        raise ConfigError(
            f"UNet in_channels {unet.config.in_channels} != VAE latent_channels {vae.config.latent_channels}"
        )
    def reload_fp32(name: str) -> torch.nn.Module:
        if name == "vae":
            return load_weights(AutoencoderKL.from_pretrained, _source(cfg, "vae"), "vae", "model.vae.pretrained", **kw("vae"))
        te, _ = build_text_encoder(
            replace(cfg.text_encoder, dtype="fp32"), cfg.pretrained, torch.device("cpu"),
            tokenizer_src=cfg.tokenizer.pretrained, revision=cfg.revision,
        )
        return te

    return Models(
        reload_fp32=reload_fp32,
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=_layout(frozen(vae, device, frozen_vae_dtype(cfg.vae.dtype, cfg.mixed_precision)), channels_last),
        unet=unet,
        noise_scheduler=noise_scheduler,
        inference_scheduler=inference_scheduler,
    )


def _layout(module: torch.nn.Module, channels_last: bool) -> torch.nn.Module:
    return to_channels_last(module) if channels_last else module
