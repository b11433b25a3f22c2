"""The memory plan's diffusion-transformer parts (``memory_plan`` uses them): the activation estimate of
a transformer micro-batch, parameter counts from a component config built on the meta device, and the
reference rows of known models for the README (``python -m sd_training.memory.plan --table``).

Activations: image tokens (latent pixels / patch^2, or packed 2x2 latents: ``image_tokens``) and text
tokens run through every block together (joint attention), so one sample saves about ``K x S x D``
elements per block (S = image + text tokens, D = heads x head dim). K was measured with autograd's
saved-tensor hooks on diffusers' SD3Transformer2DModel and FluxTransformer2DModel (fp32 on the CPU,
parameters left out, memory-efficient attention assumed: the S x S probabilities of the math kernel left
out): 25.3-25.5 for a joint (two-stream) block with RMS q/k norms, 24.3-24.5 for Flux's double-stream
block and 21.2-21.3 for its single-stream block, at widths 64-128 and 64-256 image tokens, plus 0.3-2.2
outside the blocks. With gradient checkpointing diffusers keeps each block's inputs (S x D) and
recomputes one block at a time during the backward. Counted at the compute dtype's bytes, as the UNet
estimate is: a lower bound of the peak (some saved tensors stay fp32 under autocast; the forward's
temporaries and the backward's gradients are not counted). SD3.5-medium's dual-attention blocks (a second
attention over the image tokens) save more than the estimate says.
"""

from __future__ import annotations

import torch

from .plan import GIB, MemoryRow, memory_plan

JOINT_BLOCK = 25.0  # elements per token x width saved by a joint (two-stream) block
SINGLE_BLOCK = 21.0  # by a single-stream block (Flux)
OUTSIDE = 2.0  # embeddings, final norm and projection
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")  # diffusers' names, in execution order
KEYS = ("num_layers", "attention_head_dim", "num_attention_heads", "joint_attention_dim")


def is_transformer(conf: dict) -> bool:
    """A diffusers diffusion transformer's config (joint attention over image and text tokens)."""
    return all(k in conf for k in KEYS) or "Transformer2DModel" in str(conf.get("_class_name") or "")


def meta_module(conf: dict, class_name: str | None = None) -> torch.nn.Module | None:
    """The module ``conf`` builds (``class_name`` or its ``_class_name``: a diffusers or transformers class),
    on the meta device (no memory); None when it does not build."""
    import diffusers
    import transformers

    name = class_name or conf.get("_class_name")
    cls = getattr(diffusers, str(name), None) or getattr(transformers, str(name), None)
    if cls is None:
        return None
    args = {k: v for k, v in conf.items() if not k.startswith("_")}
    try:
        with torch.device("meta"):
            if hasattr(cls, "config_class") and not hasattr(cls, "from_config"):  # transformers: Config object
                return cls(cls.config_class(**args))
            return cls.from_config(args)
    except Exception:  # noqa: BLE001 -- a config the class refuses is reported when the run builds it
        return None


def blocks(net: torch.nn.Module, level: str = "block") -> list[torch.nn.Module]:
    """The transformer blocks (the shard units of the reference rows), in execution order."""
    return [b for name in BLOCK_LISTS for b in (getattr(net, name, None) or [])]


def image_tokens(conf: dict, latent_h: float, latent_w: float, latent_channels: int) -> float:
    """Image tokens of ``latent_h x latent_w`` latents: the transformer's patches (``patch_size``) of the
    latents as it takes them (``in_channels`` / ``latent_channels`` latent pixels packed per input vector,
    4 for Flux's 2x2 packing)."""
    patch = int(conf.get("patch_size") or 1)
    return latent_h * latent_w * latent_channels / (patch * patch * int(conf.get("in_channels") or latent_channels))


def activation_elements(conf: dict, image: float, text: float, checkpointing: bool) -> float:
    """Elements one sample saves for the backward (see the module doc): ``image`` and ``text`` tokens."""
    width = int(conf["num_attention_heads"]) * int(conf["attention_head_dim"])
    joint, single = int(conf.get("num_layers") or 0), int(conf.get("num_single_layers") or 0)
    per_token = (JOINT_BLOCK * joint + SINGLE_BLOCK * single) if not checkpointing else (
        joint + single + max(JOINT_BLOCK if joint else 0.0, SINGLE_BLOCK if single else 0.0))
    return (image + text) * width * (per_token + OUTSIDE)


# ----------------------------------------------------------------------------------------------
# Reference rows: known models, counted from their configs on the meta device.
# ----------------------------------------------------------------------------------------------

_SD3 = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
            joint_attention_dim=4096, pooled_projection_dim=2048, qk_norm="rms_norm")
# name -> (transformer class, its config, frozen encoders, text tokens of the pipeline's defaults)
REFERENCE: dict[str, tuple[str, dict, tuple[str, ...], int]] = {
    "SD3.5-medium": ("SD3Transformer2DModel", {**_SD3, "num_layers": 24, "num_attention_heads": 24,
                                                "caption_projection_dim": 1536, "pos_embed_max_size": 384,
                                                "dual_attention_layers": tuple(range(13))},
                     ("CLIP-L", "CLIP-G", "T5-XXL"), 77 + 256),
    "SD3.5-large": ("SD3Transformer2DModel", {**_SD3, "num_layers": 38, "num_attention_heads": 38,
                                               "caption_projection_dim": 2432, "pos_embed_max_size": 192},
                    ("CLIP-L", "CLIP-G", "T5-XXL"), 77 + 256),
    "Flux.1-dev": ("FluxTransformer2DModel", dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                                                   attention_head_dim=128, num_attention_heads=24,
                                                   joint_attention_dim=4096, pooled_projection_dim=768,
                                                   guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
                   ("CLIP-L", "T5-XXL"), 512),
}
ENCODERS: dict[str, tuple[str, dict]] = {
    "CLIP-L": ("CLIPTextModelWithProjection", dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                                   num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu")),
    "CLIP-G": ("CLIPTextModelWithProjection", dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                                   num_attention_heads=20, projection_dim=1280, hidden_act="gelu")),
    "T5-XXL": ("T5EncoderModel", dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                                      num_heads=64, feed_forward_proj="gated-gelu")),
}
VAE16 = dict(_class_name="AutoencoderKL", in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
             block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
             up_block_types=("UpDecoderBlock2D",) * 4)


def reference_activations(name: str, resolution: int = 1024, batch: int = 1, checkpointing: bool = True) -> float:
    """Bytes of ``batch`` samples' activations of reference model ``name`` in bf16 (a rough lower estimate)."""
    _cls, conf, _encoders, text = REFERENCE[name]
    latent = resolution / 8
    return batch * 2 * activation_elements(conf, image_tokens(conf, latent, latent, 16), text, checkpointing)


def reference_rows(name: str, world_size: int = 8, resolution: int = 1024, batch: int = 1, optimizer: str = "adamw",
                   ema: bool = True, checkpointing: bool = True) -> tuple[int, list[MemoryRow]]:
    """(trained parameters, one row per strategy) of reference model ``name`` per GPU: bf16 mixed
    precision (fp32 master weights, bf16 gathered units), the frozen encoders in bf16 and the VAE in fp32
    on every GPU, ``batch`` samples of ``resolution`` px (text tokens: the pipeline's defaults)."""
    cls, conf, encoders, _text = REFERENCE[name]
    net = meta_module(conf, cls)
    frozen = [meta_module(ENCODERS[e][1], ENCODERS[e][0]).to(torch.bfloat16) for e in encoders]
    frozen.append(meta_module(VAE16))
    acts = reference_activations(name, resolution, batch, checkpointing)
    rows = memory_plan(net, frozen, optimizer, world_size, ema, False, 2, blocks, "block", activations=acts)
    return sum(p.numel() for p in net.parameters()), rows


def reference_table(world_size: int = 8, resolution: int = 1024) -> str:
    """A markdown table of the reference rows (GiB per GPU) for the README."""
    head = ("| model (trained params) | strategy | weights | grads | AdamW | EMA | gathered | frozen encoders + VAE "
            "| activations (ckpt / none) | total (ckpt) | fits 80 GB |")
    lines = [f"Per GPU, {world_size} GPUs, {resolution} px, batch 1, bf16, AdamW, EMA on the GPU; frozen T5-XXL, "
             "CLIPs in bf16, VAE in fp32; activations a rough lower estimate with / without gradient checkpointing.",
             "", head, "|" + "---|" * (head.count("|") - 1)]
    for name in REFERENCE:
        n, rows = reference_rows(name, world_size, resolution)
        full = reference_activations(name, resolution, checkpointing=False) / GIB
        for row in rows:
            lines.append(f"| {name} ({n / 1e9:.2f}B) | {row.strategy} | {row.weights:.1f} | {row.gradients:.1f} | "
                         f"{row.optimizer:.1f} | {row.ema:.1f} | {row.gathered:.2f} | {row.frozen:.1f} | "
                         f"{row.activations:.1f} / {full:.1f} | {row.total:.1f} | "
                         f"{'yes' if row.total < 0.9 * 80e9 / GIB else 'no'} |")
    return "\n".join(lines)


def encoder_params() -> dict[str, int]:
    """Parameters of the reference frozen encoders (counted on meta)."""
    return {e: sum(p.numel() for p in meta_module(conf, cls).parameters()) for e, (cls, conf) in ENCODERS.items()}

