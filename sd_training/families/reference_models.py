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
    # FLUX.2 klein 9B's LLM (a CausalLM: the pipeline runs its head too), FLUX.2 dev's Mistral Small 3.1 (24B)
    "Qwen3-8B": ("Qwen3ForCausalLM", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                          num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                          head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False)),
    # Qwen-Image's (the pipeline runs the text model; the vision tower is loaded with it)
    "Qwen2.5-VL-7B": ("Qwen2_5_VLForConditionalGeneration", dict(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                         rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
                         tie_word_embeddings=False),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]),
        vocab_size=152064, tie_word_embeddings=False)),
    # FLUX.2 dev's text_encoder/ holds Mistral-Small-3.2-24B-Instruct-2506's weights (diffusers'
    # convert_flux2_to_diffusers.py; 3.1's processor): 3.1's shapes. The checkpoint has its own lm_head (24.0B
    # parameters); transformers 5 ties Mistral3's by default, so the config says it does not.
    "Mistral-Small-3.1": ("Mistral3ForConditionalGeneration", dict(
        text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                         num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, tie_word_embeddings=False),
        vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                           num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14),
        spatial_merge_size=2, multimodal_projector_bias=False, projector_hidden_act="gelu",
        tie_word_embeddings=False)),
}
# The 16-channel VAE of SD3, Flux.1 and Z-Image (its config.json, with its diffusers class: no quant convs)
VAE16 = dict(_class_name="AutoencoderKL", in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
             block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
             up_block_types=("UpDecoderBlock2D",) * 4, use_quant_conv=False, use_post_quant_conv=False)


class ReferenceModel(NamedTuple):
    """A published model: its trained module (diffusers class and config), its frozen encoders (names in
    :data:`ENCODERS`, kept in bf16), the text tokens of its pipeline's defaults, and its VAE (fp32)."""

    net_class: str
    config: dict
    encoders: tuple[str, ...]
    text_tokens: int
    vae: dict = VAE16
# FLUX.2's 32-channel VAE (AutoencoderKLFlux2: a batch norm over its 2x2-patchified latents)
VAE_FLUX2 = dict(_class_name="AutoencoderKLFlux2", in_channels=3, out_channels=3, latent_channels=32, layers_per_block=2,
                 block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                 up_block_types=("UpDecoderBlock2D",) * 4)
