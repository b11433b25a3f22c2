"""Published models, as shapes only (no torch, no weights): what a family's ``reference_models()`` names
for the memory table of docs/memory.md (``python -m sd_training.memory.plan --table``, which builds them on the
meta device), and the frozen components several families share (the text encoders, the 16-channel VAE).
"""

from __future__ import annotations

from typing import NamedTuple

# Frozen text encoders: name -> (transformers class, its config)
ENCODERS: dict[str, tuple[str, dict]] = {
    "CLIP-L": ("CLIPTextModelWithProjection", dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                                   num_attention_heads=12, projection_dim=768,
                                                   hidden_act="quick_gelu")),
    "CLIP-G": ("CLIPTextModelWithProjection", dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                                   num_attention_heads=20, projection_dim=1280, hidden_act="gelu")),
    "T5-XXL": ("T5EncoderModel", dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                                      num_heads=64, feed_forward_proj="gated-gelu")),
    # Z-Image's (and FLUX.2 klein 4B's) LLM
    "Qwen3-4B": ("Qwen3Model", dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                    max_position_embeddings=40960, tie_word_embeddings=True)),
}
# The 16-channel VAE of SD3 and Flux.1 (its config.json, with its diffusers class)
VAE16 = dict(_class_name="AutoencoderKL", in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
             block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
             up_block_types=("UpDecoderBlock2D",) * 4)


class ReferenceModel(NamedTuple):
    """A published model: its trained module (diffusers class and config), its frozen encoders (names in
    :data:`ENCODERS`, kept in bf16), the text tokens of its pipeline's defaults, and its VAE (fp32)."""

    net_class: str
    config: dict
    encoders: tuple[str, ...]
    text_tokens: int
    vae: dict = VAE16
