"""Z-Image as a family on the LLM text-encoder component (components/llm_text.py): the
conditioning equals ZImagePipeline.encode_prompt (empty prompts and prompts cut at the configured length
included), one training step equals a step written after diffusers' train_dreambooth_lora_z_image.py, every draw
is per sample, the stored text round-trips through the shards' bf16 storage, and the refusals. The component's
other pipelines (FLUX.2, Qwen-Image): test_llm_text.py. What every family does (bf16 runs, resume, LoRA, 2 ranks,
latent shards): test_family_conformance.py."""

import numpy as np
import pytest
import torch
from helpers import args_with, example_timesteps

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.data.latents import from_stored, to_stored
from sd_training.families import registry as families
from sd_training.families.components import llm_text
from sd_training.families.components.ddpm import sample_generators

pytestmark = pytest.mark.usefixtures("one_thread")
LLM_LEN = 32  # model.llm.max_length of the tests (Z-Image's default is 512)
CAPTIONS = ["a red circle on a blue background", "", "a yellow triangle " * 12, "a cat <|endoftext|> and a dog"]

zimage_args = args_with({"dataset.params.resolution": 32, "model.llm.max_length": LLM_LEN})


@pytest.fixture(scope="module")
def pipe(zimage_pipeline):
    from diffusers import ZImagePipeline

    return ZImagePipeline.from_pretrained(zimage_pipeline)


@pytest.fixture(scope="module")
def family(zimage_pipeline, shapes_shards, tmp_path_factory):
    """The run's family (fp32), built from a config as the trainer builds it."""
    tmp = tmp_path_factory.mktemp("zimage_family")
    cfg = load(zimage_args(tmp, zimage_pipeline, shapes_shards, model__vae__latent_sampling="mean",
                           flow_matching__weighting="cosmap"))
    return families.create(cfg, torch.device("cpu"), 0, True)


def test_family_is_read_from_the_pipeline(zimage_pipeline, shapes_shards, tmp_path):
    cfg = load(zimage_args(tmp_path, zimage_pipeline, shapes_shards))
    assert families.detect(cfg.model) == "zimage"


@pytest.mark.parametrize("override, message", [
    ({"model.t5.max_length": 16}, "model.llm.max_length"),
    ({"model.text_encoder.max_length": 16}, "model.llm.max_length"),
    ({"model.llm.max_length": 993}, "at most 992"),
    ({"model.text_encoder_2.pretrained": "/nowhere"}, "one text encoder"),
    ({"model.text_encoder.train": "true"}, "transformer only"),
    ({"objective.prediction_type": "v_prediction"}, "flow_matching"),
    ({"dataset.params.resolution": 36}, "multiple"),
])
def test_zimage_refuses_what_it_does_not_support_with_the_reason(zimage_pipeline, shapes_shards, tmp_path, override,
                                                                 message):
    with pytest.raises(ConfigError, match=message):
        load(zimage_args(tmp_path, zimage_pipeline, shapes_shards, **override))


def test_conditioning_equals_the_pipelines_own(family, pipe):
    """The real tokens of hidden_states[-2] equal ZImagePipeline.encode_prompt's list, for a prompt, the empty
    one (caption dropout: the pipeline's own negative prompt), one cut at model.llm.max_length and one that
    holds the pad token's text (a real token for the pipeline: the mask comes from the tokenizer, not the id)."""
    tok = family.tokenizers[0]
    ids = tok(CAPTIONS).input_ids
    assert ids.shape == (len(CAPTIONS), LLM_LEN) and (ids == llm_text.PAD).any()
    got, pooled = family.condition({"input_ids": ids})
    with torch.no_grad():
        want, _ = pipe.encode_prompt(list(CAPTIONS), device="cpu", do_classifier_free_guidance=False,
                                     max_sequence_length=LLM_LEN)
    assert pooled is None and len(got) == len(want) == len(CAPTIONS)
    for g, w in zip(got, want):
        assert torch.equal(g, w.float())
    assert len(got[2]) == LLM_LEN and 0 < len(got[1]) < len(got[0]) < LLM_LEN  # cut; the empty prompt's template
    assert tok.pad_token_id in tok.text_tokenizer(CAPTIONS[3]).input_ids


def test_stored_text_round_trips_through_bf16_storage(family):
    """Latent shards store the states with the mask as a last channel (bf16: the mask exact): read back, each
    sample's real tokens are the online ones within bf16 rounding, their count exact."""
    encoding = type(family).text_encoding(str(family.cfg.model.pretrained), torch.device("cpu"), 0, LLM_LEN)
    states, pooled = encoding.encode(CAPTIONS)
    assert pooled is None and encoding.storage_dtype == "bf16"
    assert states.shape[1:] == (family.stored_text().length, family.stored_text().width)
    stored = from_stored(to_stored(states, "bfloat16"), "bfloat16")
    back, _ = family.condition({"encoder_hidden_states": torch.from_numpy(np.stack(stored))})
    online, _ = family.condition({"input_ids": family.tokenizers[0](CAPTIONS).input_ids})
    for b, o in zip(back, online):
        assert b.shape == o.shape
        torch.testing.assert_close(b, o, rtol=1e-2, atol=1e-5)


def _batch(family, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    captions = CAPTIONS[:n]
    return {"pixel_values": torch.rand(n, 3, 32, 32, generator=g) * 2 - 1,
            "input_ids": family.tokenizers[0](captions).input_ids,
            "sample_seeds": torch.arange(10, 10 + n), "captions": captions}


def reference_step(pipe, transformer, batch, u, noise, weighting_scheme):
    """One step as diffusers' examples/dreambooth/train_dreambooth_lora_z_image.py computes it (the posterior
    mode, its prompt embeddings from the pipeline's encode_prompt), given u and the noise; the scheduler is the
    pipeline's (Z-Image's static shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    vae = pipe.vae
    with torch.no_grad():
        model_input = vae.encode(batch["pixel_values"]).latent_dist.mode()
        prompt_embeds, _ = pipe.encode_prompt(list(batch["captions"]), device="cpu", do_classifier_free_guidance=False,
                                              max_sequence_length=LLM_LEN)
    model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices]
    step_indices = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[step_indices].flatten().view(-1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    timestep_normalized = (1000 - timesteps) / 1000
    model_pred_list = transformer(list(noisy_model_input.unsqueeze(2).unbind(dim=0)), timestep_normalized,
                                  prompt_embeds, return_dict=False)[0]
    model_pred = -torch.stack(model_pred_list, dim=0).squeeze(2)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    b = model_input.shape[0]
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(b, -1), 1).mean()
    return loss, timesteps


def test_one_step_equals_diffusers_z_image_training_example(family, pipe):
    """Loss and gradients of one step equal the example's for the same batch, u and noise (drawn from the sample
    seeds' streams, as the family draws them) with cosmap weighting: within 1e-5 relative (float32)."""
    fm = family.cfg.flow_matching
    batch = _batch(family)
    seeds = batch["sample_seeds"]
    u = example_timesteps(fm, seeds)
    latent = 32 // 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    noise = torch.cat([torch.randn(1, 16, latent, latent, generator=g)
                       for g in sample_generators(seeds, "noise", "cpu")])
    net = family.net
    net.zero_grad(set_to_none=True)
    ours = family.loss(net, batch, torch.autocast("cpu", enabled=False))
    ours.loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    want, timesteps = reference_step(pipe, net, batch, u, noise, "cosmap")
    want.backward()
    assert torch.equal(ours.timesteps, timesteps.long())
    torch.testing.assert_close(ours.loss, want, rtol=1e-5, atol=0)
    assert grads.keys() == {n for n, p in net.named_parameters() if p.grad is not None} and grads
    for n, p in net.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    net.zero_grad(set_to_none=True)


def test_loss_is_independent_of_the_batch_split(family):
    """Every draw (sigma, noise) comes from the sample's seeds: a batch of 4 and the same samples as 2 + 2 give
    the same per-sample losses (the captions' different lengths included)."""
    batch = _batch(family)
    halves = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
    with torch.no_grad():
        whole = family.loss(family.net, batch, torch.autocast("cpu", enabled=False))
        parts = [family.loss(family.net, h, torch.autocast("cpu", enabled=False)) for h in halves]
    torch.testing.assert_close(whole.per_sample, torch.cat([p.per_sample for p in parts]), rtol=1e-5, atol=1e-6)
    assert torch.equal(whole.timesteps, torch.cat([p.timesteps for p in parts]))


def test_blocks_are_the_fsdp_and_compile_units_and_flops_count_the_text(family):
    """FSDP2 shards, and model.compile compiles, each refiner and main block; MFU's FLOPs grow with the text."""
    net = family.net
    blocks = [*net.noise_refiner, *net.context_refiner, *net.layers]
    assert family.shard_units(net, "layer") == family.shard_units(net, "block") == blocks
    assert family.compile_units(net) == blocks and family.net_name == "transformer"
    flops = family.step_flops()
    assert flops.model == 3 * flops.unet_forward > 0 and flops.vae_encode > 0 and flops.text_encode > 0
    tok = family.models.tokenizer
    tok.max_length = 2 * LLM_LEN
    try:
        assert family.step_flops().unet_forward > flops.unet_forward
    finally:
        tok.max_length = LLM_LEN


def test_the_memory_plan_has_a_z_image_row():
    """The reference model (Z-Image 6B with Qwen3-4B) plans: its activations grow with the image and the text."""
    from sd_training.memory.activations import SampleShape

    cls = families.FAMILIES["zimage"]
    ref = cls.reference_models()["Z-Image"]
    small = cls.sample_activation_elements(ref.config, SampleShape(512, 8, 16, 512), False)
    assert 0 < small < cls.sample_activation_elements(ref.config, SampleShape(1024, 8, 16, 512), False)
    assert cls.sample_activation_elements(ref.config, SampleShape(1024, 8, 16, 512), True) < small * 4


def test_a_transformer_from_params_is_built_and_checked(zimage_pipeline, shapes_shards, tmp_path):
    """model.transformer.params builds the transformer from scratch (seeded); one that does not fit the LLM's
    width is refused naming the key."""
    params = ("{in_channels: 16, dim: 32, n_layers: 1, n_refiner_layers: 1, n_heads: 2, n_kv_heads: 2, cap_feat_dim: 32,"
              " axes_dims: [8, 4, 4], axes_lens: [1024, 32, 32]}")
    cfg = load(zimage_args(tmp_path, zimage_pipeline, shapes_shards, model__transformer__params=params))
    fam = families.create(cfg, torch.device("cpu"), 0, True)
    assert len(fam.net.layers) == 1 and "from scratch" in str(fam.component_sources()["transformer"])
    with torch.no_grad():
        out = fam.loss(fam.net, _batch(fam, 2), torch.autocast("cpu", enabled=False))
    assert torch.isfinite(out.loss)
    wrong = load(zimage_args(tmp_path, zimage_pipeline, shapes_shards,
                             model__transformer__params=params.replace("cap_feat_dim: 32", "cap_feat_dim: 16")))
    with pytest.raises(ConfigError, match="cap_feat_dim 16 != the text encoder's hidden_size 32"):
        families.create(wrong, torch.device("cpu"), 0, True)
