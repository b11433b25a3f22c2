"""Flux as a family: its conditioning equals FluxPipeline's, one training step equals a hand-written step
after diffusers' train_dreambooth_flux.py, every draw is per sample, a tiny transformer trains from scratch and
exports a FluxPipeline that loads offline in plain diffusers and generates, and its refusals. What every family
does (a bf16 run with loader workers that validates, exports and resumes; LoRA; 2 ranks; latent shards):
test_family_conformance.py."""

import pytest
import torch
from helpers import args_with, step_equals_example

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families.components import flow_matching
from sd_training.families import registry as families
from sd_training.families.components.packing import image_ids, image_seq_len, pack, unpack
from sd_training.families.flux import encode_prompts
from sd_training.loop import main

pytestmark = pytest.mark.usefixtures("one_thread")
T5_LEN = 16  # model.t5.max_length of the tests (Flux's default is 512)


flux_args = args_with({"dataset.params.resolution": 32, "model.t5.max_length": T5_LEN})


@pytest.fixture(scope="module")
def pipe(flux_pipeline):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(flux_pipeline)


@pytest.fixture(scope="module")
def family(flux_pipeline, shapes_shards, tmp_path_factory):
    """The run's family (fp32), built from a config as the trainer builds it."""
    tmp = tmp_path_factory.mktemp("flux_family")
    cfg = load(flux_args(tmp, flux_pipeline, shapes_shards, model__vae__latent_sampling="mean",
                         flow_matching__weighting="cosmap"))
    return families.create(cfg, torch.device("cpu"), 0, True)


def test_family_is_read_from_the_pipeline(flux_pipeline, shapes_shards, tmp_path):
    cfg = load(flux_args(tmp_path, flux_pipeline, shapes_shards))
    assert families.detect(cfg.model) == "flux"


@pytest.mark.parametrize("override, message", [
    ({"model.t5.use": "false"}, "t5.use"),
    ({"model.t5.dropout": 0.1}, "t5.dropout"),
    ({"model.t5.max_length": 513}, "at most 512"),
    ({"model.text_encoder_3.pretrained": "/nowhere"}, "text_encoder_2"),
    ({"model.text_encoder.train": "true"}, "transformer only"),
    ({"model.unet.params": "{in_channels: 4}"}, "model.transformer"),
    ({"objective.prediction_type": "v_prediction"}, "flow_matching"),
    ({"model.train_target": "vae"}, "transformer"),
    ({"dataset.params.resolution": 40}, "multiples of 16"),
    ({"dataset.params.aspect_buckets": "true", "dataset.params.bucket_step": 8}, "multiples of 16"),
])
def test_flux_refuses_what_it_does_not_support_with_the_reason(flux_pipeline, shapes_shards, tmp_path, override,
                                                               message):
    with pytest.raises(ConfigError, match=message):
        load(flux_args(tmp_path, flux_pipeline, shapes_shards, **override))


def test_conditioning_equals_the_pipelines_own(pipe):
    """T5's states and CLIP's pooled output equal FluxPipeline.encode_prompt's, the empty caption included
    (encoded as "", as the pipeline does: no zeroing), and the text ids are its all-zero ones."""
    prompts = ["a red circle on a blue background", ""]
    ids = pipe.tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    ids_2 = pipe.tokenizer_2(prompts, padding="max_length", max_length=T5_LEN, truncation=True,
                             return_tensors="pt").input_ids
    states, pooled = encode_prompts(pipe.text_encoder, pipe.text_encoder_2, ids, ids_2)
    with torch.no_grad():  # as the pipeline's __call__ runs it
        want, want_pooled, text_ids = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=T5_LEN)
    assert states.shape == (2, T5_LEN, 128) and pooled.shape == (2, 64)
    assert torch.equal(states, want.float()) and torch.equal(pooled, want_pooled.float())
    assert states[1].abs().sum() > 0 and not torch.equal(states[0], states[1])
    assert not text_ids.any() and text_ids.shape == (T5_LEN, 3)


def test_packing_and_position_ids_are_the_pipelines(pipe):
    """2x2 packing round-trips; the image ids are those FluxPipeline.prepare_latents makes for the size."""
    latents = torch.randn(2, 16, 4, 6)
    tokens = pack(latents)
    assert tokens.shape == (2, 6, 64) and torch.equal(unpack(tokens, 4, 6), latents)
    _, want_ids = pipe.prepare_latents(2, 16, 4 * 8, 6 * 8, torch.float32, "cpu", None)
    assert torch.equal(image_ids(latents), want_ids) and image_seq_len(latents) == 6


def test_resolution_shift_is_the_pipelines_for_the_images_token_count(family, pipe):
    """The drawn sigmas use Flux's shift at the packed token count, the mu FluxPipeline samples with."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    sched = family.models.noise_scheduler
    assert flow_matching.uses_resolution_shift(family.cfg.flow_matching, sched)
    c = pipe.scheduler.config
    for n in (4, 1024, 4096):
        want = calculate_shift(n, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        assert flow_matching.resolution_mu(sched, n) == pytest.approx(want)
    seeds = torch.arange(4)
    batch = {"latents": torch.randn(4, 16, 8, 8), "input_ids": torch.zeros(4, 77, dtype=torch.long),
             "input_ids_2": torch.ones(4, T5_LEN, dtype=torch.long), "sample_seeds": seeds}
    with torch.no_grad():
        out = family.loss(family.net, batch, torch.autocast("cpu", enabled=False))
    sigmas = flow_matching.sample_sigmas(family.cfg.flow_matching, sched, 4, torch.device("cpu"), seeds, image_seq_len=16)
    assert torch.equal(out.timesteps, (sigmas * 1000).long())
    unshifted = flow_matching.sample_sigmas(family.cfg.flow_matching, sched, 4, torch.device("cpu"), seeds,
                                            image_seq_len=4096)
    assert not torch.equal(sigmas, unshifted)


def test_step_flops_count_the_transformer_over_image_and_text_tokens(family):
    """MFU's FLOPs: 3 x one forward over the packed image tokens and T5's tokens; the frozen VAE and both
    encoders are hardware FLOPs. More text tokens cost more (joint attention)."""
    from sd_training.speed.flops import encoder_flops

    flops = family.step_flops()
    assert flops.model == 3 * flops.unet_forward > 0 and flops.unet_train > 2 * flops.unet_forward
    assert flops.vae_encode > 0 and flops.text_encode == encoder_flops(family.models.text_encoder, 77) + \
        encoder_flops(family.models.text_encoder_2, T5_LEN)
    tok = family.models.tokenizer_2
    tok.model_max_length = 2 * T5_LEN
    try:
        assert family.step_flops().unet_forward > flops.unet_forward
    finally:
        tok.model_max_length = T5_LEN


def test_blocks_are_the_fsdp_and_compile_units(family):
    """FSDP2 shards, and model.compile compiles, each double- and single-stream block on its own."""
    net = family.net
    blocks = [*net.transformer_blocks, *net.single_transformer_blocks]
    assert family.shard_units(net, "layer") == family.shard_units(net, "block") == blocks
    assert family.compile_units(net) == blocks and family.net_name == "transformer"


def _batch(family, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    captions = ["a red circle", "", "a blue square on green", "a yellow triangle"][:n]
    tok, tok_2 = family.tokenizers
    return {
        "pixel_values": torch.rand(n, 3, 32, 32, generator=g) * 2 - 1,
        "input_ids": tok(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids,
        "input_ids_2": tok_2(captions, padding="max_length", max_length=T5_LEN, truncation=True,
                             return_tensors="pt").input_ids,
        "sample_seeds": torch.arange(10, 10 + n), "captions": captions,
    }


def reference_step(pipe, transformer, batch, u, noise, weighting_scheme, guidance_scale):
    """One step as diffusers' examples/dreambooth/train_dreambooth_flux.py computes it (the posterior mean
    in place of its sample; the VAE scale factor as this diffusers' pipeline unpacks with), given u and the
    noise. The scheduler is the pipeline's with an unshifted table (the example's)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    vae = pipe.vae
    with torch.no_grad():
        model_input = vae.encode(batch["pixel_values"]).latent_dist.mode()
        prompt_embeds, pooled_prompt_embeds, text_ids = pipe.encode_prompt(batch["captions"], device="cpu",
                                                                           max_sequence_length=T5_LEN)
    model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    b, c, h, w = model_input.shape
    latent_image_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices]
    step_indices = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[step_indices].flatten().view(b, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    packed = FluxPipeline._pack_latents(noisy_model_input, b, c, h, w)
    guidance = torch.tensor([guidance_scale]).expand(b) if transformer.config.guidance_embeds else None
    model_pred = transformer(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                             pooled_projections=pooled_prompt_embeds, encoder_hidden_states=prompt_embeds,
                             txt_ids=text_ids, img_ids=latent_image_ids, return_dict=False)[0]
    vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    model_pred = FluxPipeline._unpack_latents(model_pred, h * vae_scale_factor, w * vae_scale_factor, vae_scale_factor)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(b, -1), 1).mean()
    return loss, timesteps


def test_one_step_equals_diffusers_flux_training_example(family, pipe):
    """Loss and gradients of one step equal the example's for the same batch, u and noise (drawn from the
    sample seeds' streams, as the family draws them) with the example's unshifted sigma table, guidance
    embedding and cosmap weighting: within 1e-5 relative (float32; only summation order differs)."""
    batch, net = _batch(family), family.net

    def example(u, noise):
        return reference_step(pipe, net, batch, u, noise, "cosmap", family.cfg.model.guidance_embed)

    with step_equals_example(family, batch, (16, 4, 4), example):
        assert net.time_text_embed.guidance_embedder.linear_1.weight.grad.abs().sum() > 0  # the guidance path trains


def test_loss_is_independent_of_the_batch_split(family):
    """Every draw (posterior sample, sigma, noise) comes from the sample's seeds: a batch of 4 and the same
    samples as 2 + 2 give the same per-sample losses."""
    family.cfg.model.vae.latent_sampling = "sample"
    try:
        batch = _batch(family)
        halves = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
        with torch.no_grad():
            whole = family.loss(family.net, batch, torch.autocast("cpu", enabled=False))
            parts = [family.loss(family.net, h, torch.autocast("cpu", enabled=False)) for h in halves]
    finally:
        family.cfg.model.vae.latent_sampling = "mean"
    torch.testing.assert_close(whole.per_sample, torch.cat([p.per_sample for p in parts]), rtol=1e-5, atol=1e-6)
    assert torch.equal(whole.timesteps, torch.cat([p.timesteps for p in parts]))
    assert len(set(whole.timesteps.tolist())) > 1  # per sample, not one draw per batch


def _generate(folder):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(folder)  # plain diffusers, offline
    image = pipe("a red circle", height=32, width=32, num_inference_steps=2, max_sequence_length=T5_LEN,
                 generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (32, 32)
    return pipe


@pytest.mark.slow
def test_flux_trains_from_scratch_on_a_tiny_config(flux_pipeline, shapes_shards, tmp_path):
    """model.transformer.params builds the transformer (here without a guidance embedding, as schnell)."""
    from diffusers import FluxPipeline

    params = ("{in_channels: 64, num_layers: 1, num_single_layers: 1, attention_head_dim: 8, num_attention_heads: 2,"
              " joint_attention_dim: 128, pooled_projection_dim: 64, guidance_embeds: false, axes_dims_rope: [2, 2, 4]}")
    cfg = load(flux_args(tmp_path, flux_pipeline, shapes_shards, name="scratch", model__transformer__params=params,
                         experiment__num_examples_to_see=8, experiment__save_every=2))
    assert main(cfg)["step"] == 2
    run = tmp_path / "runs" / "scratch"
    pipe = FluxPipeline.from_pretrained(run / "current_pipeline")
    assert pipe.transformer.config.num_attention_heads == 2 and not pipe.transformer.config.guidance_embeds
    assert "from scratch" in (run / "sources.json").read_text()
    _generate(run / "current_pipeline")
