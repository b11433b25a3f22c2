"""FLOPs counted on the meta device: exact for conv / matmul / attention, cheap for the SD 1.x UNet."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from sd_training.families.components import unet_flops
from sd_training.families.sd import StableDiffusion
from sd_training.families.tiny import TINY_TEXT_ENCODER, TINY_UNET, TINY_VAE
from sd_training.speed import flops

SD1_UNET = dict(  # Stable Diffusion 1.x (the diffusers defaults, with SD's cross-attention width)
    sample_size=64, block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
)


def _by_op(fn) -> dict[str, int]:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}


def test_conv_layer_matches_hand_count():
    cin, cout, k, h, w = 8, 16, 3, 12, 10
    with torch.device("meta"):
        conv = torch.nn.Conv2d(cin, cout, k, padding=1)
        x = torch.empty(1, cin, h, w)
    assert flops.count_flops(lambda: conv(x)) == 2 * cin * cout * k * k * h * w


def test_attention_on_meta_matches_the_sdpa_formula():
    # On CPU the fused SDPA kernel has no FlopCounterMode formula (counts 0); on meta it is two bmm.
    b, heads, s, kv, d = 2, 4, 64, 77, 16
    q = torch.empty(b, heads, s, d, device="meta")
    k = torch.empty(b, heads, kv, d, device="meta")
    n = flops.count_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k))
    assert n == 4 * b * heads * s * kv * d


def test_tiny_unet_scales_with_latent_area():
    unet = unet_flops.meta_unet(TINY_UNET).eval()

    def run(size):
        args, kwargs = StableDiffusion.flop_inputs(unet, size, 77, 1)
        with torch.no_grad():
            return _by_op(lambda: unet(*args, **kwargs))

    small, big = run(16), run(32)
    # Every convolution is spatial: exactly 4x for twice the side.
    assert big["aten.convolution"] == 4 * small["aten.convolution"]
    # Self-attention grows with the square of the tokens, so the whole count grows a bit more than 4x.
    total_small, total_big = sum(small.values()), sum(big.values())
    assert 4 * total_small < total_big < 5 * total_small
    assert unet_flops.unet_forward_flops(TINY_UNET, 32) == total_big


def test_per_image_counts_do_not_depend_on_batch():
    unet = unet_flops.meta_unet(TINY_UNET).eval()
    counts = []
    for batch in (1, 3):
        args, kwargs = StableDiffusion.flop_inputs(unet, 8, 77, batch)
        with torch.no_grad():
            counts.append(flops.count_flops(lambda: unet(*args, **kwargs)) / batch)
    assert counts[0] == counts[1]


def test_training_counts_follow_the_conventions():
    fwd = unet_flops.unet_forward_flops(TINY_UNET, 16)
    assert unet_flops.model_flops_per_image(TINY_UNET, 16) == 3 * fwd
    train = unet_flops.unet_train_flops(TINY_UNET, 16)
    # Backward ~2x forward (conv_in's input gradient is not needed, so slightly less).
    assert 2.9 * fwd < train <= 3 * fwd
    recompute = unet_flops.unet_train_flops(TINY_UNET, 16, gradient_checkpointing=True)
    assert train < recompute <= train + fwd


def test_frozen_encoders_and_step_flops(tiny_pipeline):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    vae = AutoencoderKL.from_pretrained(tiny_pipeline, subfolder="vae")
    te = CLIPTextModel.from_pretrained(tiny_pipeline, subfolder="text_encoder")
    v = unet_flops.vae_encode_flops(vae, 64)
    assert v == unet_flops.vae_encode_flops(dict(TINY_VAE), 64)
    assert 4 * v < unet_flops.vae_encode_flops(vae, 128) < 5 * v  # convolutions, plus the mid-block's attention
    t = unet_flops.text_encode_flops(te, 77)
    assert t == unet_flops.text_encode_flops(CLIPTextConfig(**TINY_TEXT_ENCODER), 77) > 0

    class _Models:  # the fields count_step_flops reads from sd_training.families.components.unet.Models
        def __init__(self):
            from diffusers import UNet2DConditionModel

            self.unet = UNet2DConditionModel.from_pretrained(tiny_pipeline, subfolder="unet")
            self.vae, self.text_encoder = vae, te
            self.tokenizer = type("Tok", (), {"model_max_length": 77})()

    m = _Models()
    step = unet_flops.count_step_flops(m, 64)
    assert step.model == unet_flops.model_flops_per_image(m.unet, 8)
    assert step.hardware == step.unet_train + v + t
    assert step.hardware == unet_flops.hardware_flops_per_image(m.unet, 8, vae=vae, resolution=64, text_encoder=te)
    latents = unet_flops.count_step_flops(m, 64, encode_images=False)
    assert latents.vae_encode == 0 and latents.hardware == step.hardware - v
    # The real modules were not touched: still on CPU with their weights.
    assert next(m.unet.parameters()).device.type == "cpu"


def test_sd1_unet_at_512px_is_counted_fast():
    import time

    t0 = time.perf_counter()
    fwd = unet_flops.unet_forward_flops(SD1_UNET, 64)
    assert time.perf_counter() - t0 < 20  # meta device: no compute, no memory
    # 0.803 TFLOPs: 0.677 in conv + linear (= 339 GMACs, the figure usually quoted) + 0.126 in attention.
    assert 0.75e12 < fwd < 0.85e12


def test_peak_flops_table_and_mfu():
    assert flops.peak_flops("cpu", torch.bfloat16) is None
    assert flops.peak_flops("cpu", torch.float32, override=1e12) == 1e12
    assert flops.peak_flops_by_name("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert flops.peak_flops_by_name("NVIDIA A100-SXM4-40GB", "fp16") == 312e12
    assert flops.peak_flops_by_name("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert flops.peak_flops_by_name("NVIDIA H100 PCIe", "bf16") == 756e12
    assert flops.peak_flops_by_name("NVIDIA H200", "bf16") == 989e12
    assert flops.peak_flops_by_name("NVIDIA L4", "bf16") is None
    assert flops.peak_flops_by_name("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        assert flops.peak_flops_by_name("NVIDIA A100-SXM4-80GB", "no") == 19.5e12
        torch.backends.cudnn.allow_tf32 = True  # PyTorch's default: fp32 convolutions run on TF32 cores
        assert flops.peak_flops_by_name("NVIDIA A100-SXM4-80GB", torch.float32) == 156e12
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old
    with pytest.raises(ValueError):
        flops.precision_key("int8")
    assert flops.mfu(100.0, 2.4e12, 989e12) == pytest.approx(100 * 2.4e12 / 989e12)
    assert flops.mfu(100.0, 2.4e12, None) is None


def test_the_family_lays_out_the_unets_inputs():
    """SDXL's UNet takes added conditioning (pooled text, 6 size ids): its family's inputs add them, and a
    config is counted only with the class that builds it."""
    from sd_training.families.sdxl import TINY_SDXL_UNET, StableDiffusionXL

    with pytest.raises(ValueError, match="class"):
        flops.meta_copy(dict(TINY_UNET))
    unet = unet_flops.meta_unet(TINY_SDXL_UNET).eval()
    _args, kwargs = StableDiffusionXL.flop_inputs(unet, 8, 77, 2)
    assert {k: tuple(v.shape) for k, v in kwargs["added_cond_kwargs"].items()} == {
        "text_embeds": (2, TINY_SDXL_UNET["projection_class_embeddings_input_dim"] - 6 * 8), "time_ids": (2, 6)}
    assert StableDiffusion.flop_inputs(unet, 8, 77, 2)[1] == {}
    fwd = unet_flops.unet_forward_flops(TINY_SDXL_UNET, 8, inputs=StableDiffusionXL.flop_inputs)
    assert fwd > unet_flops.unet_forward_flops(TINY_UNET, 8) > 0  # SDXL's layout is wider (128-channel context)
