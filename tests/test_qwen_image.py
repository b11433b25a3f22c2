"""Qwen-Image as a family (families/qwen_image.py): the conditioning equals QwenImagePipeline.encode_prompt (the
empty caption and one cut at the configured length included), the latents, tokens and image shapes are the
pipeline's, one training step equals a step written as diffusers' train_dreambooth_lora_qwen_image.py computes
it, and the refusals. What every family does (bf16 runs, exports, resume, LoRA, 2 ranks, latent shards):
test_family_conformance.py."""

import re

import pytest
import torch
from helpers import args_with, example_timesteps

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.data.latents import TEXT_STATES_KEY
from sd_training.families import qwen_image_parts as parts
from sd_training.families import registry as families
from sd_training.families.components import llm_text
from sd_training.families.components.ddpm import sample_generators

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


def reference_step(pipe, transformer, pixels, prompts, u, noise, weighting_scheme, length):
    """One step as examples/dreambooth/train_dreambooth_lora_qwen_image.py computes it, given u and the noise (in
    its [B, C, 1, h, w] layout): each prompt's ``encode_prompt``, padded to the longest with the masks
    materialised (``concat_prompt_embedding_batches``), the posterior mode normalised per channel, the
    scheduler's unshifted table, the frame axis moved before packing."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    cls, vae = type(pipe), pipe.vae
    z, vsf = vae.config.z_dim, 2 ** len(vae.temperal_downsample)
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    with torch.no_grad():
        pairs = [pipe.encode_prompt(p, device="cpu", max_sequence_length=length) for p in prompts]
        model_input = vae.encode(pixels.unsqueeze(2)).latent_dist.mode()
    n = max(e.shape[1] for e, _ in pairs)
    masks = [torch.ones(e.shape[:2], dtype=torch.long) if m is None else m for e, m in pairs]
    prompt_embeds = torch.cat([torch.cat([e, e.new_zeros(1, n - e.shape[1], e.shape[2])], 1) for e, _ in pairs])
    prompt_embeds_mask = torch.cat([torch.cat([m, m.new_zeros(1, n - m.shape[1])], 1) for m in masks])
    model_input = (model_input - latents_mean) * latents_std
    bsz = model_input.shape[0]
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices]
    step_indices = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[step_indices].flatten().view(bsz, 1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    h, w = model_input.shape[3], model_input.shape[4]
    img_shapes = [(1, h // 2, w // 2)] * bsz
    packed = cls._pack_latents(noisy_model_input.permute(0, 2, 1, 3, 4), bsz, z, h, w)
    model_pred = transformer(hidden_states=packed, encoder_hidden_states=prompt_embeds,
                             encoder_hidden_states_mask=prompt_embeds_mask, timestep=timesteps / 1000,
                             img_shapes=img_shapes, return_dict=False)[0]
    model_pred = cls._unpack_latents(model_pred, h * vsf, w * vsf, vsf)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(bsz, -1), 1).mean()
    return loss, timesteps


def test_one_step_equals_diffusers_training_example(family, pipe):
    """Loss and gradients of one step equal the example's for the same batch, u and noise (drawn from the sample
    seeds' streams as the family draws them), with its unshifted sigma table and cosmap weighting: within 1e-5
    relative (float32; the example's all-ones mask rows and summation order differ)."""
    fm = family.cfg.flow_matching
    fm.shift, fm.resolution_shift = 1.0, False  # the example's table: the scheduler's own, unshifted
    seeds = torch.arange(10, 14)
    pixels = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    batch = {"pixel_values": pixels, "input_ids": family.tokenizers[0](CAPTIONS).input_ids, "sample_seeds": seeds}
    z = pipe.vae.config.z_dim
    try:
        u = example_timesteps(fm, seeds)
        noise = torch.cat([torch.randn(1, z, 4, 4, generator=g) for g in sample_generators(seeds, "noise", "cpu")])
        net = family.net
        net.zero_grad(set_to_none=True)
        ours = family.loss(net, batch, torch.autocast("cpu", enabled=False))
        ours.loss.backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        net.zero_grad(set_to_none=True)
        last = net.transformer_blocks[-1]
        hooks = dict(last._forward_hooks)  # the example's transformer: without the family's tie (see below)
        last._forward_hooks.clear()
        try:
            want, timesteps = reference_step(pipe, net, pixels, CAPTIONS, u, noise.unsqueeze(2), "cosmap", LLM_LEN)
            want.backward()
        finally:
            last._forward_hooks.update(hooks)
    finally:
        fm.shift, fm.resolution_shift = None, None
    assert torch.equal(ours.timesteps, timesteps.long()) and len(set(timesteps.tolist())) > 1
    torch.testing.assert_close(ours.loss, want, rtol=1e-5, atol=0)
    # the last block's text-stream output feeds nothing: the example leaves those parameters without a gradient,
    # the family gives them zeros (tie_last_text_output: DDP needs every trained parameter to have one)
    unused = {n for n, p in net.named_parameters() if p.grad is None}
    assert unused and all(n.startswith(f"transformer_blocks.{len(net.transformer_blocks) - 1}.") for n in unused)
    for n, p in net.named_parameters():
        torch.testing.assert_close(grads[n], torch.zeros_like(grads[n]) if n in unused else p.grad, rtol=1e-5,
                                   atol=1e-7, msg=n)
    assert net.txt_in.weight.grad.abs().sum() > 0  # the text conditions the step
    net.zero_grad(set_to_none=True)


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
