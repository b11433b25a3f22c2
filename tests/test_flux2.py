"""FLUX.2 (klein and dev) as families: the conditioning equals the pipeline's ``encode_prompt`` (the empty
caption and a caption cut at the configured length included), the latents, patches and position ids are the
pipeline's, one training step equals a step written as diffusers' ``train_dreambooth_lora_flux2*.py`` computes
it, and the refusals. What every family does (bf16 runs, exports, resume, LoRA, 2 ranks, latent shards):
test_family_conformance.py."""

import pytest
import torch
from example_steps import flux2_step
from helpers import args_with, step_equals_example

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families import flux2_latents as flux2
from sd_training.families import registry as families

pytestmark = pytest.mark.usefixtures("one_thread")
NAMES = [n for n in ("flux2_klein", "flux2_dev") if n in families.FAMILIES]
# model.llm.max_length of the tests (the pipelines' default is 512): room for the template (dev's has the
# pipeline's system message) and a short caption, and a long caption is cut
LLM_LEN = {"flux2_klein": 48, "flux2_dev": 160}

flux2_args = args_with({"dataset.params.resolution": 32})


@pytest.fixture(scope="module", params=NAMES)
def name(request):
    return request.param


@pytest.fixture(scope="module")
def length(name):
    return LLM_LEN[name]


@pytest.fixture(scope="module")
def pipeline(name, family_pipeline):
    return family_pipeline(name)


@pytest.fixture(scope="module")
def pipe(pipeline):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(pipeline)


@pytest.fixture(scope="module")
def family(pipeline, length, shapes_shards, tmp_path_factory):
    """The run's family (fp32, posterior mean, cosmap weighting), built from a config as the trainer builds it."""
    tmp = tmp_path_factory.mktemp("flux2_family")
    cfg = load(flux2_args(tmp, pipeline, shapes_shards, model__vae__latent_sampling="mean",
                          flow_matching__weighting="cosmap", model__llm__max_length=length))
    return families.create(cfg, torch.device("cpu"), 0, True)


def test_the_family_is_read_from_the_pipeline(name, pipeline, shapes_shards, tmp_path):
    assert families.detect(load(flux2_args(tmp_path, pipeline, shapes_shards)).model) == name


@pytest.mark.parametrize("override, message", [
    ({"model.t5.max_length": 16}, "model.t5"),
    ({"model.text_encoder_2.pretrained": "/nowhere"}, "one text encoder"),
    ({"model.llm.max_length": 513}, "at most 512"),
    ({"model.text_encoder.train": "true"}, "transformer only"),
    ({"model.train_target": "vae"}, "transformer"),
    ({"dataset.params.resolution": 40}, "multiples of 16"),
])
def test_refusals_name_the_key(pipeline, shapes_shards, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load(flux2_args(tmp_path, pipeline, shapes_shards, **override))


def test_guidance_embed_feeds_dev_and_is_refused_for_klein(name, family, pipeline, shapes_shards, tmp_path):
    """dev's transformer has a guidance embedding (model.guidance_embed, also its samples' guidance); klein's has
    none, so a set value would be unused and is refused naming the key."""
    if family.net.config.guidance_embeds:
        assert torch.equal(family.guidance(2), torch.full((2,), float(family.cfg.model.guidance_embed)))
        from sd_training.families.base import SampleSettings

        settings = SampleSettings(["a"], 1, 0, 2, 7.0, 32, None)
        assert family.sampling(settings).guidance == family.cfg.model.guidance_embed
    else:
        assert family.guidance(2) is None
        with pytest.raises(ConfigError, match="guidance_embed"):
            load(flux2_args(tmp_path, pipeline, shapes_shards, model__guidance_embed=4.0))


def test_conditioning_equals_the_pipelines_encode_prompt(family, pipe, length):
    """The LLM's states equal the pipeline's ``encode_prompt`` at the configured length: a caption, the empty
    caption (caption dropout: the pipeline's own negative prompt, no zeroing) and one cut at the length;
    the text ids are the pipeline's (0, 0, 0, l)."""
    # "[IMG]": FLUX.2 dev's format_input removes it (klein keeps it as text)
    prompts = ["a red circle [IMG] on blue", "", " ".join(["a small green square"] * 20)]
    ids = family.tokenizers[0](prompts).input_ids
    assert ids.shape == (3, length) and (ids[2] >= 0).all() and (ids[0] < 0).any()  # cut; padded
    states, pooled = family.encode_condition({"input_ids": ids}, validation=True)
    with torch.no_grad():
        want, want_ids = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=length)
    assert pooled is None and states.shape == (3, length, family.text_width) == want.shape
    assert torch.equal(states, want.float())
    assert states[1].abs().sum() > 0 and not torch.equal(states[0], states[1])
    assert torch.equal(flux2.text_ids(states), want_ids)


def test_latents_patches_and_ids_are_the_pipelines(family, pipe):
    """The family's latents, patchified, are ``_encode_vae_image``'s (the posterior mode, batch-norm
    normalised); its tokens are ``_pack_latents``'s, its image ids ``prepare_latents``' and the output's
    unpacking ``_unpack_latents_with_ids``'."""
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode(pixels, mean=True)
    assert latents.shape == (2, pipe.vae.config.latent_channels, 4, 4)
    with torch.no_grad():
        want = pipe._encode_vae_image(pixels, None)
    assert torch.equal(flux2.patchify(latents), want)
    tokens = flux2.tokens(latents)
    assert torch.equal(tokens, type(pipe)._pack_latents(flux2.patchify(latents)))
    packed, want_ids = pipe.prepare_latents(2, pipe.vae.config.latent_channels, 32, 32, torch.float32, "cpu", None)
    assert tokens.shape == packed.shape and torch.equal(flux2.image_ids(latents), want_ids)
    unpacked = type(pipe)._unpack_latents_with_ids(tokens, want_ids)
    assert torch.equal(flux2.untokens(tokens, latents.shape), flux2.unpatchify(unpacked))
    assert torch.equal(flux2.untokens(tokens, latents.shape), latents)


def test_blocks_are_the_fsdp_and_compile_units_and_lora_targets_exist(family):
    net = family.net
    blocks = [*net.transformer_blocks, *net.single_transformer_blocks]
    assert family.shard_units(net, "block") == blocks and family.compile_units(net) == blocks
    import re

    names = [n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)]
    for preset, pattern in family.adapter_presets.items():
        hit = [n for n in names if re.fullmatch(pattern, n)]
        assert hit, preset
    attention = [n for n in names if re.fullmatch(family.adapter_presets["attention"], n)]
    # diffusers' example's default targets: to_q/k/v/out.0 and the single blocks' fused projections
    assert {"single_transformer_blocks.0.attn.to_qkv_mlp_proj", "single_transformer_blocks.0.attn.to_out",
            "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_out.0"} <= set(attention)


def test_one_step_equals_diffusers_training_example(family, pipe, length):
    """Loss and gradients of one step equal the example's (``example_steps.flux2_step``) for the same batch, u and
    noise (the noise patchified for the example), with its unshifted sigma table and cosmap weighting: within 1e-5
    relative (float32; only summation order differs)."""
    captions = ["a red circle", "", "a blue square on green", "a yellow triangle"]
    pixels = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    batch = {"pixel_values": pixels, "input_ids": family.tokenizers[0](captions).input_ids,
             "sample_seeds": torch.arange(10, 14)}
    net = family.net

    def example(u, noise):
        return flux2_step(pipe, net, pixels, captions, u, flux2.patchify(noise), family.cfg.model.guidance_embed,
                          length, weighting_scheme="cosmap")

    with step_equals_example(family, batch, (pipe.vae.config.latent_channels, 4, 4), example):
        if net.config.guidance_embeds:  # dev: the guidance path trains
            assert net.time_guidance_embed.guidance_embedder.linear_1.weight.grad.abs().sum() > 0


def test_step_flops_count_the_transformer_over_image_and_text_tokens(family, length):
    """MFU's FLOPs: 3 x one forward over the image patches and the LLM's tokens; the VAE and the LLM are
    hardware FLOPs. More text tokens cost more (joint attention)."""
    flops = family.step_flops()
    assert flops.model == 3 * flops.unet_forward > 0 and flops.vae_encode > 0 and flops.text_encode > 0
    tok = family.models.tokenizer
    tok.max_length = 2 * length
    try:
        assert family.step_flops().unet_forward > flops.unet_forward
    finally:
        tok.max_length = length
