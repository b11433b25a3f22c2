"""Flux Kontext as a family: the reference's packed tokens and position ids equal FluxKontextPipeline's, one
training step equals a step written as diffusers' train_dreambooth_lora_flux_kontext.py computes it, the sample
grid and eval images pass each prompt's reference (shown before its images), a LoRA export loads with
``load_lora_weights`` on FluxKontextPipeline, and the sampling references are checked at load. What every
family does (a run on paired shards that validates, samples, exports and resumes; 2 ranks; latent shards):
test_family_conformance.py."""

import numpy as np
import pytest
import torch
from helpers import args_with, step_equals_example
from PIL import Image

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families import registry
from sd_training.families.base import SampleSettings

pytestmark = pytest.mark.usefixtures("one_thread")
T5_LEN, RES = 16, 32
GEN_RES = 64  # scripts/generate_examples.py's smallest --resolution
kontext_args = args_with({"dataset.params.resolution": RES, "model.t5.max_length": T5_LEN,
                          "dataset.params.references": 1, "experiment.sample_prompts": "[]"})


@pytest.fixture(scope="module")
def kontext_pipeline(family_pipeline):
    return family_pipeline("flux_kontext")


@pytest.fixture(scope="module")
def pipe(kontext_pipeline):
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline.from_pretrained(kontext_pipeline)


@pytest.fixture(scope="module")
def family(kontext_pipeline, shapes_shards, tmp_path_factory):
    """The run's family (fp32, posterior means: the example script's default --vae_encode_mode mode)."""
    tmp = tmp_path_factory.mktemp("kontext_family")
    cfg = load(kontext_args(tmp, kontext_pipeline, shapes_shards, model__vae__latent_sampling="mean",
                            flow_matching__weighting="cosmap"))
    return registry.create(cfg, torch.device("cpu"), 0, True)


def reference_files(folder, n=2):
    """``n`` reference images of different colours (64 px: the grid resizes them to the sample size)."""
    paths = []
    for i, colour in enumerate(["red", "green", "yellow"][:n]):
        im = Image.new("RGB", (64, 48), colour)
        im.paste((0, 0, 255), (8, 8, 24, 24))
        im.save(folder / f"ref{i}.png")
        paths.append(folder / f"ref{i}.png")
    return paths


def test_family_is_read_from_the_pipeline(kontext_pipeline, shapes_shards, tmp_path):
    cfg = load(kontext_args(tmp_path, kontext_pipeline, shapes_shards, model__family="auto"))
    assert registry.detect(cfg.model) == "flux_kontext"


def test_references_are_required_and_checked_at_load(kontext_pipeline, flux_pipeline, shapes_shards, tmp_path):
    """An edit family needs one reference per sample and per sample prompt, eval images need a reference file
    whose lines match the prompts and whose paths exist; a text-to-image family refuses sampling references."""
    ref, _ = reference_files(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("make it blue\nmake it red\n")
    (tmp_path / "refs.txt").write_text(f"{ref.name}\n{ref.name}\n")
    (tmp_path / "short.txt").write_text(f"{ref.name}\n")
    (tmp_path / "missing.txt").write_text(f"{ref.name}\nnot_there.png\n")
    evals = {"experiment.num_eval_images": 2, "experiment.eval_caption_file": str(prompts)}
    cases = [
        ({"dataset.params.references": 0}, "dataset.params.references"),
        ({"experiment.sample_prompts": "[make it blue]"}, "experiment.sample_references"),
        ({"experiment.sample_prompts": "[make it blue]", "experiment.sample_references": "[/nowhere/x.png]"},
         "does not exist"),
        ({"experiment.sample_prompts": "[make it blue]", "experiment.sample_references": f"[[{ref}, {ref}]]"},
         "exactly 1"),
        (evals, "experiment.eval_reference_file"),
        ({**evals, "experiment.eval_reference_file": str(tmp_path / "short.txt")}, "1 lines for the 2 prompts"),
        ({**evals, "experiment.eval_reference_file": str(tmp_path / "missing.txt")}, "not_there.png"),
    ]
    for over, message in cases:
        with pytest.raises(ConfigError, match=message):
            load(kontext_args(tmp_path, kontext_pipeline, shapes_shards, **over))
    load(kontext_args(tmp_path, kontext_pipeline, shapes_shards, **evals, **{
        "experiment.eval_reference_file": str(tmp_path / "refs.txt"), "experiment.sample_prompts": "[make it blue]",
        "experiment.sample_references": f"[{ref}]"}))
    with pytest.raises(ConfigError, match="experiment.sample_references"):
        load(kontext_args(tmp_path, flux_pipeline, shapes_shards, dataset__params__references=0,
                          experiment__sample_references=f"[{ref}]"))


def test_reference_conditioning_equals_the_pipelines(family, pipe):
    """The reference's latents are FluxKontextPipeline's (posterior mode, shifted and scaled), packed 2x2 as its
    image_latents, and the position ids are its latent ids followed by the reference's with first coordinate 1."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randint(0, 256, (2, 1, 3, RES, RES), dtype=torch.uint8, generator=g)
    latents = torch.randn(2, 16, RES // 8, RES // 8, generator=g)
    refs = family.reference_latents({"reference_values": ref})
    with torch.no_grad():
        want_latents = pipe._encode_vae_image(ref[:, 0].float() / 127.5 - 1, generator=None)
    assert len(refs) == 1 and refs[0].shape == latents.shape
    torch.testing.assert_close(refs[0], want_latents, rtol=1e-5, atol=1e-6)
    states = torch.zeros(2, T5_LEN, 128)
    inputs = family.transformer_inputs(latents, states, torch.zeros(2, 64))
    tokens, joined = family.join_references(latents, refs, inputs)
    _, image_latents, latent_ids, ref_ids = pipe.prepare_latents(refs[0], 2, 16, RES, RES, torch.float32, "cpu", None)
    assert torch.equal(tokens, image_latents) and torch.equal(ref_ids[:, 0], torch.ones(len(ref_ids)))
    assert torch.equal(joined["img_ids"], torch.cat([latent_ids, ref_ids])) and torch.equal(inputs["img_ids"], latent_ids)


def batch_of(family, n=4, seed=0):
    """A paired batch as the loader makes it (uint8 targets and references, token ids, sample seeds)."""
    g = torch.Generator().manual_seed(seed)
    captions = ["make the background blue", "", "make it red", "add a square"][:n]
    tok, tok_2 = family.tokenizers
    return {
        "pixel_values": torch.randint(0, 256, (n, 3, RES, RES), dtype=torch.uint8, generator=g),
        "reference_values": torch.randint(0, 256, (n, 1, 3, RES, RES), dtype=torch.uint8, generator=g),
        "input_ids": tok(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids,
        "input_ids_2": tok_2(captions, padding="max_length", max_length=T5_LEN, truncation=True,
                             return_tensors="pt").input_ids,
        "sample_seeds": torch.arange(10, 10 + n), "captions": captions,
    }


def example_step(pipe, transformer, batch, u, noise, weighting_scheme, guidance_scale):
    """One step as diffusers' examples/dreambooth/train_dreambooth_lora_flux_kontext.py computes it
    (--vae_encode_mode mode, its default), given u and the noise; the scheduler's table unshifted (the example's)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    vae = pipe.vae
    pixel_values = batch["pixel_values"].float() / 127.5 - 1
    cond_pixel_values = batch["reference_values"][:, 0].float() / 127.5 - 1
    with torch.no_grad():
        model_input = vae.encode(pixel_values).latent_dist.mode()
        cond_model_input = vae.encode(cond_pixel_values).latent_dist.mode()
        prompt_embeds, pooled_prompt_embeds, text_ids = pipe.encode_prompt(batch["captions"], prompt_2=None,
                                                                           device="cpu", max_sequence_length=T5_LEN)
    model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    cond_model_input = (cond_model_input - vae.config.shift_factor) * vae.config.scaling_factor
    b, c, h, w = model_input.shape
    latent_image_ids = FluxKontextPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
    cond_latents_ids = FluxKontextPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
    cond_latents_ids[..., 0] = 1
    latent_image_ids = torch.cat([latent_image_ids, cond_latents_ids], dim=0)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    step_indices = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[step_indices].flatten().view(b, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    packed = FluxKontextPipeline._pack_latents(noisy_model_input, b, c, h, w)
    orig_inp_shape = packed.shape
    packed = torch.cat([packed, FluxKontextPipeline._pack_latents(cond_model_input, b, c, h, w)], dim=1)
    guidance = torch.tensor([guidance_scale]).expand(b) if transformer.config.guidance_embeds else None
    model_pred = transformer(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                             pooled_projections=pooled_prompt_embeds, encoder_hidden_states=prompt_embeds,
                             txt_ids=text_ids, img_ids=latent_image_ids, return_dict=False)[0]
    model_pred = model_pred[:, : orig_inp_shape[1]]
    vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    model_pred = FluxKontextPipeline._unpack_latents(model_pred, h * vae_scale_factor, w * vae_scale_factor,
                                                     vae_scale_factor)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(b, -1), 1).mean()
    return loss, timesteps


def test_one_step_equals_diffusers_kontext_training_example(family, pipe):
    """Loss and gradients of one step on a paired batch equal the example's for the same batch, u and noise
    (drawn from the sample seeds' streams, as the family draws them), with its unshifted sigma table, guidance
    embedding and cosmap weighting: within 1e-5 relative (float32; only summation order differs). The reference
    reaches the prediction (another reference changes the loss)."""
    batch, net = batch_of(family), family.net

    def example(u, noise):
        return example_step(pipe, net, batch, u, noise, "cosmap", family.cfg.model.guidance_embed)

    def other():  # the references of other samples
        return family.loss(net, {**batch, "reference_values": batch["reference_values"].flip(0)},
                           torch.autocast("cpu", enabled=False))

    with step_equals_example(family, batch, (16, 4, 4), example, other=other) as step:
        assert abs(float(step.other.loss) - float(step.ours.loss.detach())) > 1e-6


def test_the_sample_grid_and_eval_images_pass_each_prompts_reference(family, tmp_path):
    """Each grid row shows the prompt's reference at the sample size, then its images, generated from it (another
    reference, another image); eval images i use prompt i's reference and equal the grid's image of the same
    prompt and seed."""
    refs = reference_files(tmp_path)
    settings = SampleSettings(["make it blue", "make it blue"], 2, 5, 2, 3.5, RES, None,
                              references=((str(refs[0]),), (str(refs[1]),)))
    grid = np.asarray(family.sample_image(family.net, settings))
    assert grid.shape == (2 * RES, 3 * RES, 3)
    for row, ref in enumerate(refs):
        shown = np.asarray(Image.open(ref).convert("RGB").resize((RES * 64 // 48, RES), Image.BICUBIC))
        left = (shown.shape[1] - RES) // 2
        # the reference cover-resized and center-cropped (a resize of the crop, not a crop of the resize: the
        # edges of the blue square land a pixel apart)
        assert np.abs(grid[row * RES:(row + 1) * RES, :RES].astype(int) - shown[:, left:left + RES]).mean() < 2
    cell = lambda r, c: grid[r * RES:(r + 1) * RES, c * RES:(c + 1) * RES].astype(int)  # noqa: E731
    assert np.abs(cell(0, 1) - cell(1, 1)).max() > 0, "the reference did not reach the images"
    paths = family.eval_images(family.net, settings._replace(seed=5), 2, tmp_path / "eval", 0, 1)
    assert [p.name for p in paths] == ["000000.png", "000001.png"]
    np.testing.assert_array_equal(np.asarray(Image.open(paths[0])).astype(int), cell(0, 1))
    np.testing.assert_array_equal(np.asarray(Image.open(paths[1])).astype(int), cell(1, 2))


def test_a_lora_export_loads_with_load_lora_weights_on_the_kontext_pipeline(kontext_pipeline, shapes_shards, tmp_path):
    """A LoRA on the family's transformer (its up-projections moved off zero) exports a diffusers LoRA folder that
    FluxKontextPipeline.load_lora_weights loads: the same edit as the run's own pipeline, another than the base's."""
    from diffusers import FluxKontextPipeline

    from sd_training import adapters

    cfg = load(kontext_args(tmp_path, kontext_pipeline, shapes_shards, **{
        "model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.alpha": 8}))
    family = registry.create(cfg, torch.device("cpu"), 0, True)
    family.adapters = adapters.apply(cfg, family, None)
    with torch.no_grad():
        for n, p in family.net.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(n)))
    adapters.export(family.adapters, family, family.net, tmp_path / "lora", merged=False)
    ref = Image.open(reference_files(tmp_path, 1)[0]).convert("RGB").resize((RES, RES))

    def edit(p):
        p.set_progress_bar_config(disable=True)
        with torch.no_grad():
            return p(prompt="make it blue", height=RES, width=RES, num_inference_steps=2, max_sequence_length=T5_LEN,
                     generator=torch.Generator().manual_seed(3), output_type="np", **family.reference_call([ref])).images[0]

    ours = edit(family.inference_pipeline(family.net))
    base = FluxKontextPipeline.from_pretrained(kontext_pipeline)
    before = edit(base)
    base.load_lora_weights(str(tmp_path / "lora"))
    np.testing.assert_allclose(edit(base), ours, atol=1e-5, rtol=0)
    assert np.abs(ours - before).max() > 1e-3, "the LoRA changed nothing"


def test_estimates_count_the_references_tokens(family):
    """MFU's forward and the memory plan's activations see the reference's tokens beside the target's."""
    from sd_training.families.flux import Flux
    from sd_training.memory import activations

    inputs = family.flops_inputs(family.net.config, 4, 4)
    assert inputs["hidden_states"].shape[1] == inputs["img_ids"].shape[0] == 2 * 4
    from sd_training.memory.fit import sample_activations

    conf = dict(family.net.config)
    shape = activations.SampleShape(RES, text_tokens=T5_LEN, references=1)  # the run's: dataset.params.references=1
    tokens = activations.image_tokens(conf, RES / 8, RES / 8, 16)  # 4x4 latents packed 2x2: 4 tokens
    want = activations.transformer_activation_elements(conf, 2 * tokens, T5_LEN, False)
    assert type(family).sample_activation_elements(conf, shape, False) == pytest.approx(want)
    assert sample_activations(family.cfg, conf, False, T5_LEN, type(family)) == pytest.approx(4 * want)  # fp32
    assert want > Flux.sample_activation_elements(conf, activations.SampleShape(RES, text_tokens=T5_LEN), False) > 0
    assert family.step_flops().unet_forward > 0


def test_the_evaluation_cli_generates_from_a_reference_file(kontext_pipeline, pipe, tmp_path):
    """``python -m sd_training.evaluation --pipeline ... --reference-file``: image i edits prompt i's reference
    (resized to --resolution), as the pipeline called with the family's reference_call makes it; a file whose
    lines do not match the prompts is refused."""
    from sd_training.evaluation.__main__ import main
    from sd_training.families.flux_kontext import FluxKontext
    from sd_training.outputs import sample_references

    refs = reference_files(tmp_path)
    (tmp_path / "prompts.txt").write_text("make it blue\nmake it red\n")
    (tmp_path / "refs.txt").write_text(f"{refs[0].name}\n{refs[1].name}\n")
    common = ["--pipeline", str(kontext_pipeline), "--prompts", str(tmp_path / "prompts.txt"), "--resolution", str(RES),
              "--steps", "2", "--seed", "4", "--images", str(tmp_path / "images"), "--out", str(tmp_path / "r.json")]
    main([*common, "--reference-file", str(tmp_path / "refs.txt")])
    (ref,) = sample_references.load([refs[1]], RES)  # as the grid test checks it: cover-resized, center-cropped
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt=["make it red"], num_inference_steps=2, guidance_scale=7.5, height=RES, width=RES,
                generator=[torch.Generator().manual_seed(5)], **FluxKontext.reference_call([ref])).images[0]
    got = np.asarray(Image.open(tmp_path / "images" / "000001.png")).astype(int)
    np.testing.assert_array_equal(got, np.asarray(want).astype(int))
    (tmp_path / "short.txt").write_text(f"{refs[0].name}\n")
    with pytest.raises(SystemExit, match="1 lines for 2 prompts"):
        main([*common, "--reference-file", str(tmp_path / "short.txt")])


def test_generate_examples_takes_a_reference_file_and_saves_the_references(kontext_pipeline, flux_pipeline, pipe,
                                                                          tmp_path):
    """``scripts/generate_examples.py --pipeline ... --reference-file``: image i edits prompt i's reference, as the
    pipeline called with the family's reference_call makes it; each reference is saved beside its image (and left
    out of the evaluation's image list); the edit pipeline without the file and a text-to-image one with it are
    refused before anything is generated. At 64 px: the script's smallest size."""
    import importlib.util
    from pathlib import Path

    from sd_training.evaluation.fid import image_files
    from sd_training.families.flux_kontext import FluxKontext
    from sd_training.outputs import sample_references

    spec = importlib.util.spec_from_file_location("generate_examples",
                                                  Path(__file__).resolve().parents[1] / "scripts/generate_examples.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    refs = reference_files(tmp_path)
    (tmp_path / "prompts.txt").write_text("make it blue\nmake it red\n")
    (tmp_path / "refs.txt").write_text(f"{refs[0].name}\n{refs[1].name}\n")
    out = tmp_path / "images"
    common = ["--prompts", str(tmp_path / "prompts.txt"), "--resolution", str(GEN_RES), "--steps", "2", "--seed", "4",
              "--device", "cpu", "--no-progress", "--out", str(out), "--num-images", "3"]
    written = gen.main([*common, "--pipeline", str(kontext_pipeline), "--reference-file", str(tmp_path / "refs.txt")])
    assert [p.name for p in written] == ["000000.png", "000001.png", "000002.png"]
    assert image_files(out) == written
    for i in range(3):  # image i's reference: prompt i % 2's, at the output's size
        (want,) = sample_references.load([refs[i % 2]], GEN_RES)
        np.testing.assert_array_equal(np.asarray(Image.open(out / f"{i:06d}.ref.png")), np.asarray(want))
    assert not list(out.glob("*.ref2.png"))
    (ref,) = sample_references.load([refs[1]], GEN_RES)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt=["make it red"], num_inference_steps=2, guidance_scale=7.5, height=GEN_RES, width=GEN_RES,
                generator=[torch.Generator().manual_seed(5)], **FluxKontext.reference_call([ref])).images[0]
    np.testing.assert_array_equal(np.asarray(Image.open(written[1])).astype(int), np.asarray(want).astype(int))
    common[-3] = str(tmp_path / "refused")
    with pytest.raises(SystemExit, match="flux_kontext model, which edits reference images: give --reference-file"):
        gen.main([*common, "--pipeline", str(kontext_pipeline)])
    with pytest.raises(SystemExit, match="flux model, which generates from text alone"):
        gen.main([*common, "--pipeline", str(flux_pipeline), "--reference-file", str(tmp_path / "refs.txt")])
    (tmp_path / "two.txt").write_text(f"{refs[0].name}\t{refs[1].name}\n{refs[1].name}\n")
    with pytest.raises(SystemExit, match="line 1 of .*two.txt has 2 reference image.*takes exactly 1"):
        gen.main([*common, "--pipeline", str(kontext_pipeline), "--reference-file", str(tmp_path / "two.txt")])
    assert not (tmp_path / "refused").exists()
