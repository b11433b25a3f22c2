"""Tiny random-weight Stable Diffusion (1.x-style and SDXL) pipelines built offline from the real classes.

Used by the quickstart and the tests: every component is the real diffusers / transformers class,
saved with ``save_pretrained`` and loadable with ``StableDiffusionPipeline.from_pretrained`` with no
network. The tokenizer is the real CLIP BPE tokenizer: open_clip ships the BPE merges file inside its
package, and we convert it to the ``vocab.json`` + ``merges.txt`` pair that ``CLIPTokenizer`` reads.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from pathlib import Path

# CLIP's byte-level BPE: 256 byte tokens, the same 256 with the end-of-word marker, the merges,
# then the two special tokens. 49,408 entries in all for the stock merges file.
_BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"
_N_MERGES = 49152 - 256 - 2  # open_clip's SimpleTokenizer keeps this many merge lines


def _bytes_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable-unicode table GPT-2 and CLIP use for byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def clip_bpe_path() -> Path:
    """Path of the CLIP BPE merges file that open_clip ships (found without importing open_clip)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("open_clip_torch is not installed; it ships the CLIP BPE file we build the tokenizer from")
    path = Path(list(spec.submodule_search_locations)[0]) / _BPE_FILE
    if not path.exists():
        raise RuntimeError(f"{path} is missing from the open_clip_torch install")
    return path


def write_clip_tokenizer(out_dir: str | os.PathLike, model_max_length: int = 77, pad_token: str = "<|endoftext|>") -> Path:
    """Write a transformers ``CLIPTokenizer`` folder (vocab.json, merges.txt, configs) to ``out_dir``.

    Its ids equal OpenAI CLIP's and open_clip's ("a photo of a cat" -> 49406 320 1125 539 320 2368 49407).
    ``pad_token``: CLIP pads with the end token; SDXL's second tokenizer (OpenCLIP's) pads with "!" (id 0).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(clip_bpe_path(), "rt", encoding="utf-8") as f:
        merges = f.read().split("\n")[1 : _N_MERGES + 1]
    merges = [tuple(m.split()) for m in merges]
    vocab = list(_bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab.extend("".join(m) for m in merges)
    vocab.extend(["<|startoftext|>", "<|endoftext|>"])
    (out / "vocab.json").write_text(json.dumps({tok: i for i, tok in enumerate(vocab)}, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n", encoding="utf-8")
    special = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": pad_token,
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "CLIPTokenizer", "model_max_length": model_max_length, **special})
    )
    return out


def build_clip_tokenizer(cache_dir: str | os.PathLike | None = None, model_max_length: int = 77,
                         pad_token: str = "<|endoftext|>"):
    """A ``CLIPTokenizer`` built offline; files are written to ``cache_dir`` (a temp dir if None)."""
    import tempfile

    from transformers import CLIPTokenizer

    folder = Path(cache_dir) if cache_dir else Path(tempfile.mkdtemp(prefix="clip_tokenizer_"))
    if not (folder / "vocab.json").exists():
        write_clip_tokenizer(folder, model_max_length, pad_token)
    # Load from the folder: passing vocab/merges paths as keyword arguments silently builds a broken
    # tokenizer in transformers 5 (see shared/notes/environment.md).
    return CLIPTokenizer.from_pretrained(str(folder))


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


# SDXL's layout at toy width: two text encoders whose hidden states are concatenated (64 + 64 = 128
# channels of cross-attention), the second with a projection whose pooled output joins the six size /
# crop ids (8 channels each) in the added embedding: 64 + 6 x 8 = 112.
TINY_TEXT_ENCODER_2 = dict(TINY_TEXT_ENCODER, pad_token_id=0)
TINY_SDXL_UNET = dict(
    TINY_UNET,  # the same sizes; SDXL's block order, linear projections and added conditioning
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=TINY_TEXT_ENCODER["hidden_size"] + TINY_TEXT_ENCODER_2["hidden_size"],
    attention_head_dim=(2, 4, 8),
    transformer_layers_per_block=(1, 1, 1),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=TINY_TEXT_ENCODER_2["projection_dim"] + 6 * 8,
)
# SDXL's scheduler: Euler with "leading" spacing; SD's betas (Euler takes no clip_sample / set_alpha_to_one).
SDXL_SCHEDULER = dict(
    {k: v for k, v in SD_SCHEDULER.items() if k not in ("clip_sample", "set_alpha_to_one")},
    timestep_spacing="leading",
)
SDXL_SCALING_FACTOR = 0.13025
FAMILIES = ("sd", "sdxl")


def make_tiny_pipeline(out_dir: str | os.PathLike, seed: int = 0, scaling_factor: float | None = None,
                       family: str = "sd") -> Path:
    """Save a random-weight ``StableDiffusionPipeline`` (``family="sdxl"``: ``StableDiffusionXLPipeline``)
    to ``out_dir`` and return the path."""
    import torch

    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")
    out = Path(out_dir)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
        torch.manual_seed(seed)
        if family == "sdxl":
            return _build_tiny_sdxl(out, scaling_factor or SDXL_SCALING_FACTOR)
        return _build_tiny(out, out / "_tokenizer_files", scaling_factor or 0.18215)


def _build_tiny_sdxl(out: Path, scaling_factor: float) -> Path:
    import shutil

    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    pipe = StableDiffusionXLPipeline(
        vae=AutoencoderKL(**TINY_VAE, scaling_factor=scaling_factor, force_upcast=False),
        text_encoder=CLIPTextModel(CLIPTextConfig(**TINY_TEXT_ENCODER)),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**TINY_TEXT_ENCODER_2)),
        tokenizer=build_clip_tokenizer(out / "_tokenizer_files"),
        tokenizer_2=build_clip_tokenizer(out / "_tokenizer_2_files", pad_token="!"),
        unet=UNet2DConditionModel(**TINY_SDXL_UNET),
        scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    pipe.save_pretrained(out)
    for tmp in ("_tokenizer_files", "_tokenizer_2_files"):
        shutil.rmtree(out / tmp, ignore_errors=True)
    return out


def _build_tiny(out: Path, tokenizer_dir: Path, scaling_factor: float) -> Path:
    """The components, initialised from torch's RNG (seeded by the caller), saved as a pipeline."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = build_clip_tokenizer(tokenizer_dir)
    text_encoder = CLIPTextModel(CLIPTextConfig(**TINY_TEXT_ENCODER))
    vae = AutoencoderKL(**TINY_VAE, scaling_factor=scaling_factor)
    unet = UNet2DConditionModel(**TINY_UNET)
    scheduler = DDIMScheduler(**SD_SCHEDULER)
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out)
    # The training scheduler is built from scheduler/ (DDPMScheduler.from_pretrained), as diffusers does.
    import shutil

    shutil.rmtree(out / "_tokenizer_files", ignore_errors=True)
    return out
