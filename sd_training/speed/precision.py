"""Precision names of the config (``model.mixed_precision``, ``model.vae.dtype``,
``model.text_encoder.dtype``) and the torch dtypes they mean: the one place that maps them."""

from __future__ import annotations

import torch

# A component's stored dtype: model.vae.dtype, model.text_encoder.dtype (besides "auto").
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# model.mixed_precision -> the autocast dtype of the step ("no": none, fp32).
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(mixed_precision: str) -> torch.dtype | None:
    """The compute dtype under autocast; None for ``no`` (full fp32)."""
    return AUTOCAST.get(mixed_precision)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The step's autocast context: ``dtype`` on ``device``; a no-op for fp32 (``dtype`` None)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def frozen_vae_dtype(requested: str, mixed_precision: str) -> torch.dtype:
    """``auto``: bf16 under bf16 mixed precision, else fp32 (the SD VAE overflows in fp16)."""
    if requested == "auto":
        return torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    return DTYPES[requested]


def frozen_text_dtype(requested: str, mixed_precision: str) -> torch.dtype:
    """``auto``: the compute dtype of the run (bf16, fp16; else fp32). CLIP text towers are safe in fp16,
    unlike the SD VAE; a frozen encoder in the training precision halves its memory and runs on tensor
    cores, and its hidden states are cast to fp32 for the UNet (``objective.encode_text``)."""
    if requested == "auto":
        return AUTOCAST.get(mixed_precision, torch.float32)
    return DTYPES[requested]
