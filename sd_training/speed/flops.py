"""FLOPs per training image, peak FLOP/s per device, and model FLOPs utilisation (MFU).

Counting is done once at start-up by running the models on the **meta device** under
``torch.utils.flop_counter.FlopCounterMode``: a copy of each module is built from its config with no
storage, so counting the SD 1.x UNet at 512 px takes well under a second and no memory. What is counted
is what FlopCounterMode counts: matmuls (``mm``/``addmm``/``bmm``/``baddbmm``), convolutions and
attention, 2 FLOPs per multiply-add. Normalisations, activations, softmax and element-wise ops are not
counted (by convention; they are a few percent and memory-bound).

Nothing here knows a model: the family's ``step_flops()`` hands over its trained module and one image's
meta inputs as it calls the module (``count_net_flops``; the UNet families through
``families.components.unet_flops``), and its frozen encoders.

Why meta and not a real forward on a tiny input: on CPU, PyTorch's fused SDPA kernel
(``_scaled_dot_product_flash_attention_for_cpu``) has no FlopCounterMode formula, so a CPU forward
counts 0 FLOPs for attention. On meta, SDPA decomposes into two ``bmm`` whose count equals the
formula FlopCounterMode uses for the CUDA flash / efficient / cuDNN kernels (4 * b * h * s_q * s_kv * d).

Conventions (as in PaLM's appendix B and torchtitan):

* **Model FLOPs** per image = 3 x one forward of the trained module (forward + backward, the backward
  being twice the forward). It depends only on the architecture and resolution, not on the
  implementation; MFU uses it.
* **Hardware FLOPs** per image = the trained module's forward + backward as PyTorch actually runs it
  (traced on meta, so it includes the recomputation of gradient checkpointing, which in diffusers covers
  the resnet/attention blocks: ~0.74 of a forward for SD 1.x, not a whole forward), plus one forward of
  the frozen VAE encoder (unless latents are precomputed) and of the frozen text encoders. HFU uses it.
* Peaks are **dense** tensor-core peaks (NVIDIA's datasheets quote 2:4-sparsity figures, twice these).
  MFU = images/s per device x FLOPs per image / peak FLOP/s per device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..outputs.export import unwrap

log = logging.getLogger(__name__)

TERA = 1e12

# Dense peak TFLOP/s per device (no sparsity), by precision. Matched against torch.cuda.get_device_name()
# in this order, so the more specific names come first. fp32 is the non-tensor-core (CUDA core) rate.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0}),  # SXM
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0}),  # SXM5 ("H100 80GB HBM3")
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),  # SXM4 and PCIe alike
]


# ----------------------------------------------------------------------------------------------
# Counting on the meta device.
# ----------------------------------------------------------------------------------------------


def meta_copy(module_or_config: Any, cls=None) -> torch.nn.Module:
    """An uninitialised copy on the meta device, built from ``module.config`` (its own class), or from a
    config and the class ``cls`` that takes it (the family's component class)."""
    if isinstance(module_or_config, torch.nn.Module):
        cls, config = type(module_or_config), module_or_config.config
    elif cls is None:
        raise ValueError("counting FLOPs of a config needs the class that builds it (cls=)")
    else:
        config = module_or_config
    with torch.device("meta"):
        if isinstance(config, Mapping):  # diffusers: the config is a (frozen) dict
            return cls.from_config(dict(config))
        return cls(config)  # transformers: PreTrainedModel(PretrainedConfig)


def count_flops(fn) -> int:
    """FLOPs FlopCounterMode counts while ``fn()`` runs (on meta tensors: no compute)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


def height_width(size: int | tuple[int, int]) -> tuple[int, int]:
    """(h, w) of a square side or an (h, w) pair."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def vae_encode_flops(vae, resolution: int | tuple[int, int], cls=None) -> int:
    """FLOPs of a diffusers autoencoder's encoder (with its quant conv) for one image of ``resolution``
    pixels: ``vae`` a module, or a config with the class ``cls`` that builds it."""
    m = meta_copy(vae, cls).eval()
    h, w = height_width(resolution)
    x = torch.empty(1, m.config.in_channels, h, w, device="meta")
    with torch.no_grad():
        return count_flops(lambda: m.encode(x).latent_dist.mode())


@dataclass(frozen=True)
class StepFlops:
    """FLOPs per training image, counted once (see the module docstring for the conventions)."""

    unet_forward: int  # one forward of the trained module (a UNet, a transformer: the name is historical)
    unet_train: int  # its forward + backward as run (incl. gradient-checkpointing recomputation)
    vae_encode: int  # frozen VAE encoder forward (0 when the batch carries precomputed latents)
    text_encode: int  # frozen text encoder forward

    @property
    def model(self) -> int:
        """Model FLOPs per image: 3 x the trained module's forward (what MFU counts)."""
        return 3 * self.unet_forward

    @property
    def hardware(self) -> int:
        """Hardware FLOPs per image: everything the device computes for it (what HFU counts)."""
        return self.unet_train + self.vae_encode + self.text_encode


def latent_size_of(vae, resolution: int | tuple[int, int]) -> tuple[int, int]:
    """Latent pixels for ``resolution`` image pixels: the VAE halves them once per extra level."""
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    h, w = height_width(resolution)
    return h // factor, w // factor


# ----------------------------------------------------------------------------------------------
# Any trained module (a diffusion transformer): the family says what one image's inputs are.
# ----------------------------------------------------------------------------------------------

MetaInputs = Callable[[torch.nn.Module], dict]  # the meta copy -> forward kwargs of ONE image, on meta


def _meta_net(net, gradient_checkpointing: bool = False) -> torch.nn.Module:
    m = meta_copy(unwrap(net))
    if gradient_checkpointing:
        m.enable_gradient_checkpointing()
    return m


def _first(out) -> torch.Tensor:
    out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
    return out[0] if isinstance(out, list) else out  # a net that returns a list of per-image outputs: the one image


def net_forward_flops(net, inputs: MetaInputs) -> int:
    """FLOPs of one forward of ``net`` (a diffusers model: its class and config are copied to the meta
    device) on one image: ``inputs(meta_module)`` gives the forward's keyword arguments, meta tensors
    with batch 1 (image tokens, text tokens, pooled embeddings, ids: as the family calls its model)."""
    m = _meta_net(net).eval()
    kwargs = inputs(m)
    with torch.no_grad():
        return count_flops(lambda: m(**kwargs, return_dict=False))


def net_train_flops(net, inputs: MetaInputs, gradient_checkpointing: bool = False) -> int:
    """FLOPs of ``net``'s forward + backward for one image as autograd runs it (with the recomputation of
    gradient checkpointing, which diffusers' transformers apply per block)."""
    m = _meta_net(net, gradient_checkpointing).train()
    kwargs = inputs(m)
    return count_flops(lambda: _first(m(**kwargs, return_dict=False)).sum().backward())


def count_net_flops(net, inputs: MetaInputs, gradient_checkpointing: bool = False, vae_encode: int = 0,
                    text_encode: int = 0) -> StepFlops:
    """:class:`StepFlops` of a trained module with any forward (what a family's ``step_flops()`` returns):
    model FLOPs = 3 x one forward (MFU), hardware FLOPs = forward + backward as run (recomputation
    included) + the frozen VAE encode and text encoders' FLOPs given (``vae_encode=0`` for latent shards;
    ``text_encode``: e.g. :func:`encoder_flops` of each frozen encoder, 0 for stored text states).
    Image and text tokens go through joint attention as the family's ``inputs`` lay them out."""
    return StepFlops(unet_forward=net_forward_flops(net, inputs),
                     unet_train=net_train_flops(net, inputs, gradient_checkpointing),
                     vae_encode=vae_encode, text_encode=text_encode)


def encoder_flops(encoder, seq_len: int) -> int:
    """FLOPs of a frozen transformers text encoder (CLIP, CLIP with projection, T5 encoder) for one
    caption of ``seq_len`` tokens, counted on a meta copy of its class and config."""
    m = meta_copy(encoder).eval()
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    with torch.no_grad():
        return count_flops(lambda: m(input_ids=ids, return_dict=False))


# ----------------------------------------------------------------------------------------------
# Peaks and utilisation.
# ----------------------------------------------------------------------------------------------


def precision_key(dtype) -> str:
    """'bf16' | 'fp16' | 'tf32' | 'fp32' for a torch dtype or a name ('bf16', 'fp16', 'no', 'fp32', 'tf32').

    Plain fp32 counts against the TF32 tensor-core peak when PyTorch lets convolutions or matmuls use
    TF32 (cuDNN convolutions do by default), else against the CUDA-core fp32 peak.
    """
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    key = names.get(dtype, dtype)
    key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "no": "fp32"}.get(key, key)
    if key not in ("bf16", "fp16", "tf32", "fp32"):
        raise ValueError(f"unknown precision {dtype!r}: one of bf16, fp16, tf32, fp32 (or a torch dtype)")
    if key == "fp32" and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32):
        key = "tf32"
    return key


def peak_flops(device: torch.device | str, dtype, override: float | None = None) -> float | None:
    """Dense peak FLOP/s of one ``device`` at ``dtype`` (see ``precision_key``), or None when unknown.

    ``override`` (FLOP/s, e.g. 312e12) wins over the table: use it for GPUs the table lacks or for a
    CPU. Without it a CPU (or any device not in ``PEAK_TFLOPS``) gives None: MFU is not reported.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak FLOP/s override must be positive, got {override}")
        return float(override)
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return peak_flops_by_name(name, dtype)


def peak_flops_by_name(name: str, dtype) -> float | None:
    """Table look-up by CUDA device name ('NVIDIA A100-SXM4-80GB', 'NVIDIA H100 80GB HBM3', ...)."""
    key = precision_key(dtype)
    for pattern, peaks in PEAK_TFLOPS:
        if pattern.lower() in name.lower():
            return peaks[key] * TERA
    log.warning("no peak FLOP/s known for device '%s': MFU is not reported (set the peak to override)", name)
    return None


def mfu(images_per_sec_per_device: float, flops_per_image: float, peak: float | None) -> float | None:
    """Utilisation in [0, 1]: achieved FLOP/s per device over the dense ``peak`` (None when no peak).

    With ``StepFlops.model`` this is MFU; with ``StepFlops.hardware`` it is hardware FLOPs utilisation.
    """
    if not peak:
        return None
    return images_per_sec_per_device * flops_per_image / peak
