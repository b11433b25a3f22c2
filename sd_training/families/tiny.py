"""Tiny random-weight pipelines built offline from the real classes: the quickstart's and the tests'.

Every family builds its own (``Family.make_tiny_pipeline``): every component is the real diffusers /
transformers class, saved with ``save_pretrained`` and loadable with the family's pipeline class's
``from_pretrained`` with no network. The tokenizers are the real CLIP BPE tokenizer
(``text_encoders.build_clip_tokenizer``). Here: the component sizes the families share, and
``registry.make_tiny_pipeline``, which asks the registry for the family.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .components.clip import build_clip_tokenizer

# The sizes below train at ~0.2 s/step for batch 8 at 64x64 on 2 CPU cores.
TINY_UNET = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(64, 128, 256),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=64,
    attention_head_dim=8,
    norm_num_groups=32,
)
# Four levels -> downsampling factor 8, as in Stable Diffusion: 64 px images give 8x8 latents.
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(32, 32, 64, 64),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=64,
)
TINY_TEXT_ENCODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=77,
    vocab_size=49408,
    projection_dim=64,
    bos_token_id=49406,
    eos_token_id=49407,
    pad_token_id=49407,
)
# What Stable Diffusion 1.x/2.x ship, with the two settings diffusers warns about set.
SD_SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
    prediction_type="epsilon",
)


def tokenizer_folder(out: Path, name: str) -> Path:
    """A scratch folder inside the pipeline folder for a tokenizer's files (removed by :func:`save`)."""
    return out / f"_{name}_files"


def save(pipe, out: Path, *scratch: Path) -> Path:
    """``pipe.save_pretrained(out)``, then remove the ``scratch`` folders (:func:`tokenizer_folder`)."""
    pipe.save_pretrained(out)
    for tmp in scratch:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


__all__ = ["SD_SCHEDULER", "TINY_TEXT_ENCODER", "TINY_UNET", "TINY_VAE", "build_clip_tokenizer"]
