"""FLOPs per image of a diffusion transformer (``flops.count_net_flops``, which the transformer families
call from ``step_flops()``): a meta-device count of tiny SD3Transformer2DModel and FluxTransformer2DModel
configs against an analytic count (2 x weights x the tokens each layer sees, plus 4 x S^2 x width for
each joint attention over S = image + text tokens), training = 3 x forward, and gradient checkpointing's
recomputation of the blocks."""

import pytest
import torch

from sd_training.speed.flops import count_net_flops, encoder_flops, net_forward_flops

LATENT = 8  # latent pixels a side
TEXT = 12  # text tokens

SD3 = dict(sample_size=LATENT, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
           num_attention_heads=4, joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=20,
           pos_embed_max_size=16)
FLUX = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=8,
            num_attention_heads=4, joint_attention_dim=24, pooled_projection_dim=20, guidance_embeds=True,
            axes_dims_rope=(2, 2, 4))


def sd3_inputs(m):
    c = m.config
    return dict(hidden_states=torch.empty(1, c.in_channels, LATENT, LATENT, device="meta"),
                encoder_hidden_states=torch.empty(1, TEXT, c.joint_attention_dim, device="meta"),
                pooled_projections=torch.empty(1, c.pooled_projection_dim, device="meta"),
                timestep=torch.ones(1, device="meta"))


def flux_inputs(m):
    c = m.config
    n = (LATENT // 2) ** 2  # 2x2 packed latents: in_channels = 4 x 16
    return dict(hidden_states=torch.empty(1, n, c.in_channels, device="meta"),
                encoder_hidden_states=torch.empty(1, TEXT, c.joint_attention_dim, device="meta"),
                pooled_projections=torch.empty(1, c.pooled_projection_dim, device="meta"),
                timestep=torch.ones(1, device="meta"), img_ids=torch.zeros(n, 3, device="meta"),
                txt_ids=torch.zeros(TEXT, 3, device="meta"), guidance=torch.ones(1, device="meta"))


def analytic(net, image: int, text: int) -> tuple[int, int]:
    """(forward FLOPs, of which in the blocks) by hand: every Linear / Conv2d sees the tokens of its stream
    (the image's, the text's, both in Flux's single-stream blocks, one vector for the modulations and the
    timestep / pooled embedders), 2 FLOPs per multiply-add; each block's attention: QK^T and AV."""
    both = image + text
    total = blocks = 0
    for name, mod in net.named_modules():
        if not isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d)):
            continue
        if "norm" in name or "time_text_embed" in name:
            tokens = 1
        elif name.startswith("single_transformer_blocks"):
            tokens = both
        elif "context" in name or "add_" in name:
            tokens = text
        else:
            tokens = image
        flops = 2 * mod.weight.numel() * tokens
        total += flops
        blocks += flops if "transformer_blocks" in name else 0
    inner = net.config.num_attention_heads * net.config.attention_head_dim
    n_blocks = net.config.num_layers + net.config.get("num_single_layers", 0)
    attention = n_blocks * 4 * both * both * inner
    return total + attention, blocks + attention


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_transformer_flops_match_the_analytic_count(kind):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    torch.manual_seed(0)
    net = SD3Transformer2DModel(**SD3) if kind == "sd3" else FluxTransformer2DModel(**FLUX)
    inputs = sd3_inputs if kind == "sd3" else flux_inputs
    image = (LATENT // 2) ** 2
    forward, in_blocks = analytic(net, image, TEXT)
    flops = count_net_flops(net, inputs)
    assert flops.unet_forward == pytest.approx(forward, rel=0.01)
    assert flops.model == 3 * flops.unet_forward
    # backward = 2 x forward, but for the first layers' inputs (no gradient wanted there)
    assert 2.9 * forward < flops.hardware < 3.0 * forward
    ckpt = count_net_flops(net, inputs, gradient_checkpointing=True)
    assert ckpt.model == flops.model  # MFU counts the model, not the recomputation
    # diffusers checkpoints each block: its forward runs again in the backward
    assert ckpt.hardware - flops.hardware == pytest.approx(in_blocks, rel=0.01)
    assert count_net_flops(net, inputs, vae_encode=5, text_encode=7).hardware == flops.hardware + 12


def test_attention_grows_with_the_square_of_the_tokens():
    from diffusers import SD3Transformer2DModel

    net = SD3Transformer2DModel(**SD3)

    def inputs_with(text):
        def make(m):
            out = sd3_inputs(m)
            out["encoder_hidden_states"] = torch.empty(1, text, m.config.joint_attention_dim, device="meta")
            return out
        return make

    image, inner = (LATENT // 2) ** 2, 32
    a, b = net_forward_flops(net, inputs_with(TEXT)), net_forward_flops(net, inputs_with(2 * TEXT))
    per_text_token = analytic(net, image, TEXT + 1)[0] - analytic(net, image, TEXT)[0]
    assert per_text_token > 0
    # text tokens through joint attention: the S^2 term changes with them
    attention = 2 * 4 * inner * ((image + 2 * TEXT) ** 2 - (image + TEXT) ** 2)
    assert b - a == pytest.approx(analytic(net, image, 2 * TEXT)[0] - analytic(net, image, TEXT)[0], rel=0.01)
    assert b - a > attention


def test_frozen_t5_encoder_flops():
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=100, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
                      feed_forward_proj="gated-gelu")
    enc = T5EncoderModel(config)
    seq = 16
    # 2 layers of: q, k, v, o (4 d x d) + gated FF (3 d x d_ff) on seq tokens, 2 FLOPs a multiply-add;
    # attention QK^T and AV: 4 seq^2 d
    want = 2 * (2 * seq * (4 * 32 * 32 + 3 * 32 * 64) + 4 * seq * seq * 32)
    assert encoder_flops(enc, seq) == pytest.approx(want, rel=0.01)
