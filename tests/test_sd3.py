"""SD3 as a family: the T5 tokenizer built offline, conditioning equal to StableDiffusion3Pipeline.encode_prompt
(with and without T5, empty captions included), one step equal to diffusers' train_dreambooth_sd3.py, trained
CLIPs (their gradients, length and export), per-sample randomness, gradient checkpointing, FSDP shard units, and
its refusals. What every family does (a bf16 run with loader workers that validates, exports and resumes; LoRA;
2 ranks; latent shards): test_family_conformance.py."""

import copy

import pytest
import torch
from helpers import args_with

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.data.transforms import unit_range
from sd_training.families import registry as families
from sd_training.families.components.ddpm import stream_seed

pytestmark = pytest.mark.usefixtures("one_thread")
CAPTIONS = ["a red circle on a blue background", "", "a green square", "a yellow triangle on black"]


args = args_with({"dataset.params.resolution": 32})


def make(tmp_path, pipeline, shards, **overrides):
    return load(args(tmp_path, pipeline, shards, **overrides))


def family_of(tmp_path, pipeline, shards, **overrides):
    return families.create(make(tmp_path, pipeline, shards, **overrides), torch.device("cpu"), 0, True)


def batch_of(family, captions, seeds=None, size=32):
    g = torch.Generator().manual_seed(1)
    batch = {"pixel_values": torch.randint(0, 256, (len(captions), 3, size, size), generator=g, dtype=torch.uint8)}
    for k, tok in enumerate(family.tokenizers):
        ids = tok(captions, padding="max_length", truncation=True, max_length=tok.model_max_length,
                  return_tensors="pt").input_ids
        batch["input_ids" if k == 0 else f"input_ids_{k + 1}"] = ids
    if seeds is not None:
        batch["sample_seeds"] = torch.tensor(seeds)
    return batch


def test_t5_tokenizer_is_built_offline_and_loads_as_t5_tokenizer_fast(tmp_path):
    from transformers import T5TokenizerFast

    from sd_training.families.components.t5 import build_t5_tokenizer, tokenize_t5

    tok = build_t5_tokenizer(tmp_path / "t5", 16)
    again = T5TokenizerFast.from_pretrained(tmp_path / "t5")  # no sentencepiece, no network
    ids = tokenize_t5(again, ["a red circle", "", "Zebra?"], 16)
    assert ids.shape == (3, 16) and ids[0, :4].tolist() == tok("a red circle").input_ids
    assert ids[1, 0] == again.eos_token_id == 1 and again.pad_token_id == 0 and ids[1, 1:].eq(0).all()
    assert again.unk_token_id not in ids[2].tolist()  # unknown words are spelt out, not <unk>
    assert again.decode(ids[0], skip_special_tokens=True) == "a red circle"


def test_family_is_read_from_the_pipeline(sd3_pipeline, shapes_shards, tmp_path):
    cfg = make(tmp_path, sd3_pipeline, shapes_shards)
    assert families.detect(cfg.model) == "sd3"


@pytest.mark.parametrize("override, message", [
    ({"model.unet.params": "{in_channels: 16}"}, "model.unet applies to the UNet families"),
    ({"objective.prediction_type": "v_prediction"}, "flow_matching"),
    ({"model.attention": "sliced"}, "sliced"),
    ({"model.text_encoder.max_length": 78}, "2 \\(start and end\\) to 77"),
    ({"model.text_encoder.clip_skip": 2}, "leave it at 0"),
    ({"flow_matching.shift": 2.0, "flow_matching.resolution_shift": "true"}, "exclude each other"),
    ({"model.transformer.params": "{num_layerz: 2}"}, "did you mean 'model.transformer.params.num_layers'"),
])
def test_sd3_refuses_what_it_does_not_apply_with_the_reason(sd3_pipeline, shapes_shards, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        cfg = make(tmp_path, sd3_pipeline, shapes_shards, **override)
        families.create(cfg, torch.device("cpu"), 0, True)


@pytest.fixture(scope="module")
def sd3_family(sd3_pipeline, shapes_shards, tmp_path_factory):
    return family_of(tmp_path_factory.mktemp("sd3_family"), sd3_pipeline, shapes_shards,
                     **{"model.vae.latent_sampling": "mean", "flow_matching.weighting": "cosmap"})


def test_conditioning_equals_the_pipelines_own(sd3_family, sd3_pipeline, shapes_shards, tmp_path):
    """States and pooled as encode_prompt gives them, empty captions encoded as "" (no zeroing); without T5
    (model.t5.use=false) as the pipeline without text_encoder_3 (zeros) at the trained T5 length."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_pipeline)
    states, pooled = sd3_family.condition(batch_of(sd3_family, CAPTIONS), validation=True)
    want, _, want_pooled, _ = pipe.encode_prompt(CAPTIONS, None, None, device="cpu", do_classifier_free_guidance=False)
    assert states.shape == (4, 77 + 256, 128) and pooled.shape == (4, 128)
    torch.testing.assert_close(states, want.float())
    torch.testing.assert_close(pooled, want_pooled.float())
    _, neg, _, neg_pooled = pipe.encode_prompt(CAPTIONS[:1], None, None, device="cpu")  # the negative branch: ""
    torch.testing.assert_close(states[1:2], neg.float())
    torch.testing.assert_close(pooled[1:2], neg_pooled.float())
    assert states[1].abs().sum() > 0

    no_t5 = family_of(tmp_path, sd3_pipeline, shapes_shards, **{"model.t5.use": "false", "model.t5.max_length": 16})
    assert len(no_t5.tokenizers) == 2 and no_t5.models.text_encoder_3 is None
    states, pooled = no_t5.condition(batch_of(no_t5, CAPTIONS), validation=True)
    pipe.text_encoder_3 = pipe.tokenizer_3 = None
    want, _, want_pooled, _ = pipe.encode_prompt(CAPTIONS, None, None, device="cpu", do_classifier_free_guidance=False,
                                                 max_sequence_length=16)
    assert states.shape == (4, 77 + 16, 128) and not states[:, 77:].any()
    torch.testing.assert_close(states, want.float())
    torch.testing.assert_close(pooled, want_pooled.float())


def test_t5_dropout_per_sample_from_its_seed(sd3_pipeline, shapes_shards, tmp_path):
    fam = family_of(tmp_path, sd3_pipeline, shapes_shards, **{"model.t5.dropout": 0.5})
    seeds = list(range(100, 108))
    captions = ["a red circle"] * 8
    states, _ = fam.condition(batch_of(fam, captions, seeds), validation=False)
    dropped = ~states[:, 77:].flatten(1).any(dim=1)
    assert 0 < int(dropped.sum()) < 8 and states[:, :77].flatten(1).any(dim=1).all()  # CLIP parts kept
    half, _ = fam.condition(batch_of(fam, captions[:4], seeds[4:]), validation=False)
    assert torch.equal(~half[:, 77:].flatten(1).any(dim=1), dropped[4:])
    kept, _ = fam.condition(batch_of(fam, captions, seeds), validation=True)  # validation drops nothing
    assert kept[:, 77:].flatten(1).any(dim=1).all()


def hand_written_step(pipe, transformer, pixels, captions, seeds, cfg, train_text=False):
    """One step as diffusers' examples/dreambooth/train_dreambooth_sd3.py computes it (its code, with the
    posterior mean instead of a sample, and each sample's noise and u from its seed's streams); ``train_text``:
    the prompt embeddings keep their graph (gradients reach the pipeline's CLIPs, as the example's
    --train_text_encoder does)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    sched = pipe.scheduler
    vae = pipe.vae
    model_input = vae.encode(pixels).latent_dist.mean
    model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    noise = torch.cat([torch.randn((1, *model_input.shape[1:]), generator=torch.Generator().manual_seed(
        stream_seed(s, "noise"))) for s in seeds])
    u = torch.cat([compute_density_for_timestep_sampling(
        weighting_scheme=cfg.timestep_sampling, batch_size=1, logit_mean=cfg.logit_mean, logit_std=cfg.logit_std,
        mode_scale=cfg.mode_scale, generator=torch.Generator().manual_seed(stream_seed(s, "timesteps"))) for s in seeds])
    indices = (u * sched.config.num_train_timesteps).long()
    timesteps = sched.timesteps[indices]
    step_indices = [(sched.timesteps == t).nonzero().item() for t in timesteps]  # get_sigmas
    sigmas = sched.sigmas[step_indices].flatten().view(-1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    with torch.set_grad_enabled(train_text):
        prompt_embeds, _, pooled_prompt_embeds, _ = pipe.encode_prompt(captions, None, None, device="cpu",
                                                                       do_classifier_free_guidance=False)
    model_pred = transformer(hidden_states=noisy_model_input, timestep=timesteps, encoder_hidden_states=prompt_embeds,
                             pooled_projections=pooled_prompt_embeds, return_dict=False)[0]
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=cfg.weighting, sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1)
    return loss.mean(), timesteps


def test_one_step_equals_the_diffusers_example(sd3_family, sd3_pipeline):
    """Loss and gradients of the family's step equal the example's (fp32, same batch, seeds, timesteps):
    rtol 1e-5 on the loss, 1e-4 relative on each gradient (summation order differs)."""
    import contextlib

    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_pipeline)
    seeds = [7, 8, 9, 10]
    batch = batch_of(sd3_family, CAPTIONS, seeds)
    net = sd3_family.net
    ref = copy.deepcopy(net)
    net.zero_grad(set_to_none=True)
    out = sd3_family.loss(sd3_family.loss_module, batch, contextlib.nullcontext())
    out.loss.backward()
    want, timesteps = hand_written_step(pipe, ref, unit_range(batch["pixel_values"]), CAPTIONS, seeds,
                                        sd3_family.cfg.flow_matching)
    want.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-7)
    assert out.timesteps.tolist() == timesteps.long().tolist()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        scale = q.grad.abs().max().clamp(min=1e-12)
        assert (p.grad - q.grad).abs().max() / scale < 1e-4, name
    net.zero_grad(set_to_none=True)


def test_trained_clips_get_the_gradients_of_the_example_with_its_text_encoders_trained(sd3_pipeline, shapes_shards,
                                                                                       tmp_path):
    """model.text_encoder.train: both CLIPs are fp32, trained, in the optimizer (their own LR), left out of the
    frozen modules; every CLIP parameter gets a gradient (DDP waits for none), equal to backpropagating the
    example's loss through encode_prompt; T5 stays frozen."""
    import contextlib

    from diffusers import StableDiffusion3Pipeline

    fam = family_of(tmp_path, sd3_pipeline, shapes_shards, **{
        "model.text_encoder.train": "true", "model.text_encoder.learning_rate": 1e-4, "model.vae.latent_sampling": "mean"})
    m = fam.models
    assert fam.trained_encoders() == {"text_encoder": m.text_encoder, "text_encoder_2": m.text_encoder_2}
    assert all(e.training and next(e.parameters()).dtype == torch.float32 for e in fam.trained_encoders().values())
    assert fam.frozen_modules() == [m.vae, m.text_encoder_3] and not any(p.requires_grad for p in m.text_encoder_3.parameters())
    groups = fam.extra_param_groups(1e-3, 1.0)
    assert {g["name"] for g in groups} == {"text_encoder", "text_encoder_2"} and {g["lr"] for g in groups} == {1e-4}
    assert sum(len(g["params"]) for g in groups) == len(list(m.text_encoder.parameters())) * 2
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_pipeline)
    ref = copy.deepcopy(fam.net)
    seeds = [7, 8, 9, 10]
    batch = batch_of(fam, CAPTIONS, seeds)
    out = fam.loss(fam.loss_module, batch, contextlib.nullcontext())
    out.loss.backward()
    want, _ = hand_written_step(pipe, ref, unit_range(batch["pixel_values"]), CAPTIONS, seeds, fam.cfg.flow_matching,
                                train_text=True)
    want.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-7)
    for name in ("text_encoder", "text_encoder_2"):
        # k_proj's bias has an analytic gradient of 0 (softmax ignores a shift of every key): rounding noise
        # only, so each parameter's error is measured against the larger of its own and the encoder's scale
        floor = 1e-3 * max(float(q.grad.abs().max()) for q in getattr(pipe, name).parameters())
        for (key, p), q in zip(getattr(m, name).named_parameters(), getattr(pipe, name).parameters()):
            assert p.grad is not None, (name, key)
            scale = max(float(q.grad.abs().max()), floor)
            assert (p.grad - q.grad).abs().max() / scale < 1e-4, (name, key)
    assert all(p.grad is None for p in m.text_encoder_3.parameters())
    with torch.no_grad():  # validation (and the frozen case) encode without a graph
        states, _ = fam.condition(batch_of(fam, CAPTIONS), validation=True)
    assert not states.requires_grad


def test_clip_max_length_conditions_as_the_pipeline_with_that_tokenizer_length(sd3_pipeline, shapes_shards, tmp_path):
    """model.text_encoder.max_length 10: both CLIP tokenizers pad to 10, the conditioning is encode_prompt's of a
    pipeline whose tokenizers say 10 (10 + T5 tokens), and stored text expects that length."""
    from diffusers import StableDiffusion3Pipeline

    fam = family_of(tmp_path, sd3_pipeline, shapes_shards, **{"model.text_encoder.max_length": 10,
                                                                "model.t5.max_length": 16})
    assert [t.model_max_length for t in fam.tokenizers[:2]] == [10, 10]
    batch = batch_of(fam, CAPTIONS)
    assert batch["input_ids"].shape == batch["input_ids_2"].shape == (4, 10)
    states, pooled = fam.condition(batch, validation=True)
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_pipeline)
    pipe.tokenizer.model_max_length = pipe.tokenizer_2.model_max_length = 10
    pipe = StableDiffusion3Pipeline(**pipe.components)  # tokenizer_max_length is read at construction
    want, _, want_pooled, _ = pipe.encode_prompt(CAPTIONS, None, None, device="cpu", do_classifier_free_guidance=False,
                                                 max_sequence_length=16)
    assert states.shape == (4, 10 + 16, 128)
    torch.testing.assert_close(states, want.float())
    torch.testing.assert_close(pooled, want_pooled.float())
    assert fam.stored_text().length == 26 and type(fam).text_tokens(fam.cfg) == 26


def test_trained_clips_are_exported_with_their_length_and_generate(sd3_pipeline, shapes_shards, tmp_path):
    """Two optimizer steps with model.text_encoder.train and max_length 10: both CLIPs changed, T5 did not;
    the exported pipeline holds the trained CLIPs, its tokenizers say 10, and plain diffusers loads it and
    generates offline."""
    from diffusers import StableDiffusion3Pipeline

    from sd_training.loop import main

    cfg = make(tmp_path, sd3_pipeline, shapes_shards, **{
        "experiment.name": "clips", "experiment.num_examples_to_see": 8, "model.text_encoder.train": "true",
        "model.text_encoder.max_length": 10, "model.t5.max_length": 16})
    assert main(cfg)["step"] == 2
    source = StableDiffusion3Pipeline.from_pretrained(sd3_pipeline)
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "runs" / "clips" / "current_pipeline")
    assert pipe.tokenizer.model_max_length == pipe.tokenizer_2.model_max_length == pipe.tokenizer_max_length == 10

    def same(name):
        a, b = getattr(pipe, name).state_dict(), getattr(source, name).state_dict()
        return all(torch.equal(a[k], b[k]) for k in b)

    assert not same("text_encoder") and not same("text_encoder_2") and same("text_encoder_3") and same("vae")
    image = pipe("a red circle", height=32, width=32, num_inference_steps=2, max_sequence_length=16,
                 generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (32, 32)


def test_a_samples_loss_does_not_depend_on_the_batch_split(sd3_pipeline, shapes_shards, tmp_path):
    """Posterior sample, noise, timestep and T5 dropout of sample i all come from its seed."""
    import contextlib

    fam = family_of(tmp_path, sd3_pipeline, shapes_shards, **{"model.t5.dropout": 0.3})
    seeds = [21, 22, 23, 24]
    whole = fam.loss(fam.loss_module, batch_of(fam, CAPTIONS, seeds), contextlib.nullcontext())
    parts = []
    for rows in ([0, 1], [2, 3]):
        b = batch_of(fam, CAPTIONS, seeds)
        b = {k: v[rows] for k, v in b.items()}
        torch.manual_seed(rows[0])  # the global RNG plays no part
        parts.append(fam.loss(fam.loss_module, b, contextlib.nullcontext()).per_sample)
    torch.testing.assert_close(torch.cat(parts), whole.per_sample, rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients_and_blocks_are_the_shard_units(sd3_pipeline, shapes_shards,
                                                                                         tmp_path):
    import contextlib

    plain = family_of(tmp_path, sd3_pipeline, shapes_shards)
    ckpt = family_of(tmp_path, sd3_pipeline, shapes_shards, **{"model.gradient_checkpointing": "true"})
    assert ckpt.net.is_gradient_checkpointing and not plain.net.is_gradient_checkpointing
    grads = []
    for fam in (plain, ckpt):
        out = fam.loss(fam.loss_module, batch_of(fam, CAPTIONS, [1, 2, 3, 4]), contextlib.nullcontext())
        out.loss.backward()
        grads.append({n: p.grad for n, p in fam.net.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7)
    units = type(plain).shard_units(plain.net, "layer")
    assert units == list(plain.net.transformer_blocks) and type(plain).shard_units(plain.net, "block") == units
    assert plain.net_name == "transformer" and plain.compile_units(plain.net) == units
    flops = plain.step_flops()  # MFU: image patches and 77 + 256 text tokens through joint attention
    assert flops.unet_train > 2 * flops.unet_forward > 0 and flops.text_encode > 0 and flops.vae_encode > 0


@pytest.mark.parametrize("override", [{"flow_matching.shift": 2.0}, {"model.t5.use": "false"},
                                      {"model.transformer.params": "{num_layers: 2}"}])
def test_the_sd_family_refuses_the_transformer_keys(tiny_pipeline, shapes_shards, tmp_path, override):
    with pytest.raises(ConfigError, match="applies to the transformer families"):
        make(tmp_path, tiny_pipeline, shapes_shards, **override)


def test_sd3_refuses_the_autoencoder_stage_with_the_reason(sd3_pipeline, shapes_shards, tmp_path):
    """Like Flux: model.train_target=vae is a UNet pipeline's stage (it failed at build with an AttributeError)."""
    with pytest.raises(ConfigError, match="model.train_target=vae trains a UNet pipeline's autoencoder; sd3 trains"):
        make(tmp_path, sd3_pipeline, shapes_shards, **{"model.train_target": "vae"})
