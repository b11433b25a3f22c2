"""Qwen-Image as a family (families/qwen_image.py): the conditioning equals QwenImagePipeline.encode_prompt (the
empty caption and one cut at the configured length included), the latents, tokens and image shapes are the
pipeline's, one training step equals a step written as diffusers' train_dreambooth_lora_qwen_image.py computes
it, and the refusals. What every family does (bf16 runs, exports, resume, LoRA, 2 ranks, latent shards):
test_family_conformance.py."""

import re

import pytest
import torch
from example_steps import qwen_step
from helpers import args_with, step_equals_example, without_forward_hooks

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.data.latents import TEXT_STATES_KEY
from sd_training.families import qwen_image_parts as parts
from sd_training.families import registry as families
from sd_training.families.components import llm_text

pytestmark = pytest.mark.usefixtures("one_thread")
LLM_LEN = 12  # model.llm.max_length of the tests (the pipeline's default is 512): the long caption is cut
CAPTIONS = ["a red circle", "", "a blue square on green " * 6, "a yellow triangle"]

qwen_args = args_with({"dataset.params.resolution": 32, "model.llm.max_length": LLM_LEN})


@pytest.fixture(scope="module")
def pipeline(family_pipeline):
    return family_pipeline("qwen_image")


@pytest.fixture(scope="module")
def pipe(pipeline):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(pipeline)


@pytest.fixture(scope="module")
def family(pipeline, shapes_shards, tmp_path_factory):
    """The run's family (fp32, posterior mean, cosmap weighting), built from a config as the trainer builds it."""
    tmp = tmp_path_factory.mktemp("qwen_image_family")
    cfg = load(qwen_args(tmp, pipeline, shapes_shards, model__vae__latent_sampling="mean",
                         flow_matching__weighting="cosmap"))
    return families.create(cfg, torch.device("cpu"), 0, True)


def test_the_family_is_read_from_the_pipeline(pipeline, shapes_shards, tmp_path):
    assert families.detect(load(qwen_args(tmp_path, pipeline, shapes_shards)).model) == "qwen_image"


@pytest.mark.parametrize("override, message", [
    ({"model.t5.max_length": 16}, "model.llm.max_length"),
    ({"model.text_encoder.max_length": 16}, "model.llm.max_length"),
    ({"model.llm.max_length": 1025}, "at most 1024"),
    ({"model.text_encoder_2.pretrained": "/nowhere"}, "one text encoder"),
    ({"model.text_encoder.train": "true"}, "transformer only"),
    ({"dataset.params.resolution": 40}, "multiples of 16"),
])
def test_refusals_name_the_key(pipeline, shapes_shards, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load(qwen_args(tmp_path, pipeline, shapes_shards, **override))


def test_the_template_is_the_pipelines_and_its_prefix_is_34_tokens(pipe):
    """The family's format string and dropped prefix are the pipeline's; the tiny tokenizer spells the prefix in
    34 tokens, as Qwen2.5-VL's does, so the dropped tokens are exactly the template's."""
    assert parts.PROMPT_TEMPLATE == pipe.prompt_template_encode
    assert parts.PREFIX_TOKENS == pipe.prompt_template_encode_start_idx
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == parts.PREFIX_TOKENS


def test_conditioning_equals_the_pipelines_encode_prompt(family, pipe):
    """The states and mask equal ``encode_prompt`` at the configured length (to float32 rounding) for a batch holding the empty caption
    and one cut at the length; a batch of captions all at the length has no mask, as the pipeline returns none;
    the stored layout (bf16, the mask a last channel) reads back the same tokens."""
    ids = family.tokenizers[0](CAPTIONS).input_ids
    assert ids.shape == (4, LLM_LEN + 34) and (ids[2] >= 0).all() and (ids[0] < 0).any()
    states, mask = family.encode_condition({"input_ids": ids}, validation=True)
    with torch.no_grad():
        want, want_mask = pipe.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=LLM_LEN)
    assert states.shape == want.shape and states.shape[1] == LLM_LEN and torch.equal(mask, want_mask)
    # the pipeline tokenizes the batch to its longest caption (up to 1024 + 34), the family to max_length + 34:
    # the causal LLM's real tokens are the same, up to float32 rounding of matrix products of other lengths
    torch.testing.assert_close(states, want.float(), rtol=1e-5, atol=1e-6)
    assert states[1, : int(mask[1].sum())].abs().sum() > 0  # the empty caption: the template's end, encoded
    long = [CAPTIONS[2]] * 2
    states, mask = family.encode_condition({"input_ids": family.tokenizers[0](long).input_ids}, validation=True)
    with torch.no_grad():
        want, want_mask = pipe.encode_prompt(long, device="cpu", max_sequence_length=LLM_LEN)
    assert mask is None and want_mask is None
    torch.testing.assert_close(states, want.float(), rtol=1e-5, atol=1e-6)
    cond = llm_text.encode_llm(family.models.text_encoder, ids, family.tokenizers[0].pad_token_id,
                               llm_text.LLMTextSettings((-1,), LLM_LEN, 1024, template=parts.PROMPT_TEMPLATE,
                                                        drop_prefix=34, masked=True))
    stored = llm_text.with_mask(cond).bfloat16()
    back, back_mask = family.condition({TEXT_STATES_KEY: stored})
    online, online_mask = family.condition({"input_ids": ids})
    assert torch.equal(back_mask, online_mask) and torch.equal(back, online.bfloat16().float())


def test_latents_tokens_and_image_shapes_are_the_pipelines(family, pipe):
    """The latents are the VAE's per-channel normalised posterior (mode) of one frame; the tokens are
    ``_pack_latents``' and unpack with ``_unpack_latents``; the image shapes are what ``__call__`` passes."""
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode(pixels, mean=True)
    vae = pipe.vae
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    with torch.no_grad():
        want = (vae.encode(pixels.unsqueeze(2)).latent_dist.mode() - mean) * inv_std
    assert latents.shape == (2, z, 4, 4) and torch.equal(latents, want.squeeze(2))
    tokens = parts.tokens(latents)
    assert torch.equal(tokens, type(pipe)._pack_latents(want.permute(0, 2, 1, 3, 4), 2, z, 4, 4))
    assert torch.equal(parts.untokens(tokens, latents.shape), latents)
    assert torch.equal(type(pipe)._unpack_latents(tokens, 32, 32, pipe.vae_scale_factor).squeeze(2), latents)
    assert parts.img_shapes(latents) == [[(1, 32 // pipe.vae_scale_factor // 2, 32 // pipe.vae_scale_factor // 2)]] * 2


def test_blocks_are_the_units_and_lora_presets_hit_layers(family):
    net = family.net
    assert family.shard_units(net, "block") == list(net.transformer_blocks) == family.compile_units(net)
    names = [n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)]
    for preset, pattern in family.adapter_presets.items():
        assert [n for n in names if re.fullmatch(pattern, n)], preset
    attention = {n for n in names if re.fullmatch(family.adapter_presets["attention"], n)}
    # diffusers' example's default targets
    assert {f"transformer_blocks.0.attn.{k}" for k in ("to_q", "to_k", "to_v", "to_out.0")} <= attention


def test_one_step_equals_diffusers_training_example(family, pipe):
    """Loss and gradients of one step equal the example's (``example_steps.qwen_step``) for the same batch, u and
    noise, with its unshifted sigma table and cosmap weighting: within 1e-5 relative (float32; the example's
    all-ones mask rows and summation order differ). The last block's text-stream output feeds nothing: the example
    leaves those parameters without a gradient, the family gives them zeros (tie_last_text_output: DDP needs every
    trained parameter to have one)."""
    pixels = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    batch = {"pixel_values": pixels, "input_ids": family.tokenizers[0](CAPTIONS).input_ids,
             "sample_seeds": torch.arange(10, 14)}
    net = family.net
    last = len(net.transformer_blocks) - 1

    def example(u, noise):
        with without_forward_hooks(net.transformer_blocks[last]):  # the example's transformer: without the tie
            return qwen_step(pipe, net, pixels, CAPTIONS, u, noise.unsqueeze(2), "cosmap", length=LLM_LEN)

    with step_equals_example(family, batch, (pipe.vae.config.z_dim, 4, 4), example,
                             unused_in=f"transformer_blocks.{last}."):
        assert net.txt_in.weight.grad.abs().sum() > 0  # the text conditions the step


def test_step_flops_count_the_transformer_over_image_and_text_tokens(family):
    """MFU's FLOPs: 3 x one forward over the image patches and the text tokens; the 3-D VAE's encode of one frame
    and the LLM (the prefix included) are hardware FLOPs; more text tokens cost more."""
    flops = family.step_flops()
    assert flops.model == 3 * flops.unet_forward > 0 and flops.vae_encode > 0 and flops.text_encode > 0
    tok = family.models.tokenizer
    tok.max_length = 2 * LLM_LEN
    try:
        assert family.step_flops().unet_forward > flops.unet_forward
    finally:
        tok.max_length = LLM_LEN


def test_samples_use_the_pipelines_classifier_free_guidance(family):
    """Sample grids' guidance scale reaches QwenImagePipeline as true_cfg_scale against the empty caption (its
    guidance_scale feeds only guidance-distilled transformers), at the trained text length; 1 stays unguided."""
    pipe = family.inference_pipeline(family.net)
    pipe.set_progress_bar_config(disable=True)

    def image(call, **kw):
        with torch.no_grad():
            return call(prompt=["a red circle"], height=32, width=32, num_inference_steps=2, output_type="np",
                        generator=torch.Generator().manual_seed(3), **kw).images[0]

    guided, unguided = image(pipe, guidance_scale=4.0), image(pipe, guidance_scale=1.0)
    raw = pipe._pipe  # the QwenImagePipeline itself
    assert (guided == image(raw, true_cfg_scale=4.0, negative_prompt=[""], max_sequence_length=LLM_LEN)).all()
    assert (unguided == image(raw, max_sequence_length=LLM_LEN)).all() and not (guided == unguided).all()
