"""FLUX.2's reference images (klein and dev: the pipelines' ``image=[...]``) as the families train with them:
the references' tokens and position ids equal the pipeline's ``prepare_image_latents`` on the same images,
one step with references equals a step written as diffusers' ``train_dreambooth_lora_flux2_klein_img2img.py``
computes it (several references joined as the pipeline joins them), the limits of
``dataset.params.references``, a batch that lost its references refused, the sample grid with each prompt's
references, a step from latent shards with stored reference latents equal to the online step, and a short klein
LoRA run on paired shards whose export loads with ``load_lora_weights`` and generates with ``image=``. FLUX.2
without references: test_flux2.py."""

import numpy as np
import pytest
import torch
from conftest import assert_shard_step_equals_online, run_precompute
from example_steps import flux2_step, pil
from helpers import args_with, run_trainer, step_equals_example
from PIL import Image
# test_flux2.py's families, text lengths (the template and a short caption fit) and fixtures: name (each FLUX.2
# family in turn), its tiny pipeline folder and the pipeline loaded
from test_flux2 import LLM_LEN, name, pipe, pipeline  # noqa: F401

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families import flux2_latents as flux2
from sd_training.families import registry as families
from sd_training.families.components.ddpm import reference_seeds
from sd_training.families.flux2 import sample_reference

pytestmark = pytest.mark.usefixtures("one_thread")
MOST = {"flux2_klein": 4, "flux2_dev": 6}  # BFL's documented limits (docs.bfl.ml, "Image Editing")

args = args_with({"dataset.params.resolution": 32})


@pytest.fixture(scope="module")
def family(name, pipeline, shapes_shards, tmp_path_factory):
    """The run's family with two references per sample (fp32, posterior mean: the pipeline's mode)."""
    tmp = tmp_path_factory.mktemp("flux2_refs")
    cfg = load(args(tmp, pipeline, shapes_shards, model__vae__latent_sampling="mean", model__llm__max_length=LLM_LEN[name],
                    dataset__params__references=2, dataset__params__reference_crop="center"))
    return families.create(cfg, torch.device("cpu"), 0, True)


def pixels(b, r, h, w, seed):
    """uint8 reference_values [b, r, 3, h, w] of random pixels (the loader's layout)."""
    return torch.randint(0, 256, (b, r, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_references_are_optional_up_to_the_documented_limit(name, pipeline, shapes_shards, tmp_path):
    """0 (text-to-image) to klein's 4 / dev's 6 references load; one more is refused naming the key."""
    assert families.FAMILIES[name].reference_images == (0, MOST[name])
    load(args(tmp_path, pipeline, shapes_shards, dataset__params__references=MOST[name]))
    with pytest.raises(ConfigError, match="dataset.params.references"):
        load(args(tmp_path, pipeline, shapes_shards, dataset__params__references=MOST[name] + 1))


def test_reference_tokens_and_ids_are_the_pipelines(family, pipe):
    """The batch's references (uint8, VAE-encoded as the targets, the posterior mode) as tokens and ids equal
    ``prepare_image_latents`` on the same images through the pipeline's own preprocessing (PIL in, its
    ``image_processor``), sample by sample: the k-th at time 10 + 10k, packed after the one before."""
    values = pixels(2, 2, 32, 32, seed=0)
    refs = family.reference_latents({"reference_values": values})
    assert len(refs) == 2 and refs[0].shape == (2, pipe.vae.config.latent_channels, 4, 4)
    ours, ids = flux2.reference_tokens(refs)
    assert ours.shape == (2, 2 * 2 * 2, pipe.transformer.config.in_channels) and ids.shape == (2, 8, 4)
    assert ids[0, :, 0].tolist() == [10] * 4 + [20] * 4 and torch.equal(ids[0], ids[1])
    for i in range(2):
        images = [pipe.image_processor.preprocess(pil(values[i, k]), height=32, width=32, resize_mode="crop")
                  for k in range(2)]
        with torch.no_grad():
            want, want_ids = pipe.prepare_image_latents(images, 1, None, "cpu", torch.float32)
        torch.testing.assert_close(ours[i:i + 1], want, rtol=1e-5, atol=1e-6)
        assert torch.equal(ids[i:i + 1], want_ids)


def test_references_of_other_sizes_pack_as_the_pipeline(pipe, family):
    """References of their own sizes (the pipeline resizes each on its own) pack and take ids as
    ``prepare_image_latents``: each its own grid, in order."""
    images = [torch.rand(1, 3, h, w, generator=torch.Generator().manual_seed(h + w)) * 2 - 1
              for h, w in ((32, 48), (16, 32), (48, 16))]
    ours, ids = flux2.reference_tokens([family.encode(x, mean=True) for x in images])
    with torch.no_grad():
        want, want_ids = pipe.prepare_image_latents(images, 1, None, "cpu", torch.float32)
    assert torch.equal(ids, want_ids) and ours.shape == want.shape == (1, 6 + 2 + 3, ours.shape[-1])
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)


def test_one_step_with_references_equals_diffusers_img2img_example(name, family, pipe):
    """Loss and gradients of one step with two references equal the img2img example's (``example_steps.flux2_step``
    with the references as its conditions) for the same batch, u and noise: within 1e-5 relative (float32). The
    references change the step (the transformer attends to them)."""
    captions = ["make the background blue", "", "a red circle", "make it green"]
    target = pixels(4, 1, 32, 32, seed=1)[:, 0]
    refs = pixels(4, 2, 32, 32, seed=2)
    batch = {"pixel_values": target, "reference_values": refs, "sample_seeds": torch.arange(20, 24),
             "input_ids": family.tokenizers[0](captions).input_ids}
    net = family.net

    def unit(x):  # the loader's uint8 -> [-1, 1]
        return x.float() / 127.5 - 1

    def example(u, noise):
        return flux2_step(pipe, net, unit(target), captions, u, flux2.patchify(noise), family.cfg.model.guidance_embed,
                          LLM_LEN[name], conds=[unit(refs[:, k]) for k in range(2)])

    def alone():  # the same batch without its references
        family.cfg.dataset.params.references = 0
        try:
            return family.loss(net, {k: v for k, v in batch.items() if k != "reference_values"},
                               torch.autocast("cpu", enabled=False))
        finally:
            family.cfg.dataset.params.references = 2

    with step_equals_example(family, batch, (pipe.vae.config.latent_channels, 4, 4), example, other=alone) as step:
        assert abs(step.other.loss.item() - step.ours.loss.item()) > 1e-6, "the references changed nothing"


def test_a_batch_without_its_references_is_refused(family):
    """A run set for references whose batch has none (latent shards made without them) is refused naming the
    key, not trained text-to-image."""
    batch = {"pixel_values": pixels(2, 1, 32, 32, seed=4)[:, 0], "input_ids": family.tokenizers[0](["a", "b"]).input_ids}
    with pytest.raises(ValueError, match="dataset.params.references=2"):
        family.loss(family.net, batch, torch.autocast("cpu", enabled=False))
    with pytest.raises(ValueError, match="has 1 reference"):
        family.loss(family.net, {**batch, "reference_values": pixels(2, 1, 32, 32, seed=5)},
                    torch.autocast("cpu", enabled=False))


def test_flops_inputs_count_the_reference_tokens(family):
    """MFU's forward (``flops_inputs``): each reference adds the target's patches to the image sequence."""
    conf = family.net.config
    inputs = family.flops_inputs(conf, 8, 8)  # an 8 x 8 latent grid: 16 patches, 2 references at its size
    assert inputs["hidden_states"].shape == (1, 3 * 16, conf.in_channels) and inputs["img_ids"].shape == (3 * 16, 4)


def test_sampled_references_are_posteriors_of_their_own(family):
    """With ``latent_sampling: sample`` each reference is its own posterior sample (its seeds apart from the
    target's and from the other reference's, ``ddpm.reference_seeds``), the same for the same seeds."""
    values = pixels(2, 2, 32, 32, seed=3)
    same = values.clone()
    same[:, 1] = same[:, 0]  # two identical references: different draws
    seeds = torch.tensor([5, 6])
    vae = family.cfg.model.vae
    vae.latent_sampling = "sample"
    try:
        a = family.reference_latents({"reference_values": same, "sample_seeds": seeds})
        b = family.reference_latents({"reference_values": same, "sample_seeds": seeds})
        mean = family.encode(same[:, 0].float() / 127.5 - 1, mean=True)
        first = family.encode(same[:, 0].float() / 127.5 - 1, sample_seeds=reference_seeds(seeds, 0))
    finally:
        vae.latent_sampling = "mean"
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[0], first)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], mean)


def test_sample_references_reach_the_pipelines_least_size():
    """The pipelines refuse a reference under 64 px a side: a smaller one (the sample sizes of CPU runs) is scaled
    up, aspect kept; a larger one is passed as it is (the pipeline bounds it to 1024 x 1024 px of area itself)."""
    assert sample_reference(Image.new("RGB", (32, 32))).size == (64, 64)
    assert sample_reference(Image.new("RGB", (40, 80))).size == (64, 128)
    big = Image.new("RGB", (2048, 1024))
    assert sample_reference(big).size == big.size
    assert sample_reference(Image.new("L", (100, 100))).mode == "RGB"
    call = families.FAMILIES["flux2_klein"].reference_call([Image.new("RGB", (32, 32))] * 3)
    assert list(call) == ["image"] and [im.size for im in call["image"]] == [(64, 64)] * 3


def test_the_sample_grid_shows_each_prompts_references_then_images_made_from_them(family, tmp_path):
    """Each grid row shows the prompt's two references at the sample size, then its image, generated with
    ``image=[...]``: other references, another image (the same prompt and seed)."""
    from sd_training.families.base import SampleSettings

    paths = []
    for i in range(4):
        path = tmp_path / f"ref{i}.png"
        pil(pixels(1, 1, 48, 48, seed=10 + i)[0, 0]).save(path)
        paths.append(str(path))
    settings = SampleSettings(["make the background blue"] * 2, 1, 5, 2, 1.0, 32, None,
                              references=(tuple(paths[:2]), tuple(paths[2:])))
    grid = np.asarray(family.sample_image(family.net, settings)).astype(int)
    assert grid.shape == (2 * 32, 3 * 32, 3)
    shown = np.asarray(Image.open(paths[0]).convert("RGB").resize((32, 32), Image.BICUBIC)).astype(int)
    assert np.abs(grid[:32, :32] - shown).mean() < 2  # the first reference, at the sample size
    assert np.abs(grid[:32, 64:] - grid[32:, 64:]).max() > 0, "the references did not reach the images"


# ------------------------------------------------------------------------------------------ a LoRA run
def generate(pipe, images, length, prompt="make the background blue"):
    """A 32 px image in [0, 1]: 2 steps, seed 3, the trained text length, no guidance (klein's CFG off)."""
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(prompt=prompt, height=32, width=32, num_inference_steps=2, guidance_scale=1.0,
                    max_sequence_length=length, generator=torch.Generator().manual_seed(3), output_type="np",
                    **({"image": images} if images else {})).images[0]


def first_references(shards: str, n: int) -> list[Image.Image]:
    """The first sample's references (KEY.ref.jpg, KEY.ref2.jpg ...) of the first shard."""
    import io
    import tarfile

    first = shards.split("{")[0] + shards.split("{")[1].split("..")[0] + shards.split("}")[1]
    with tarfile.open(first) as tar:
        members = sorted(m.name for m in tar.getmembers())
        key = members[0].split(".")[0]
        names = [f"{key}.ref.jpg", *[f"{key}.ref{k}.jpg" for k in range(2, n + 1)]]
        return [Image.open(io.BytesIO(tar.extractfile(name).read())).convert("RGB") for name in names]


def test_a_klein_lora_run_with_references_loads_with_load_lora_weights_and_generates_with_image(
        family_pipeline, tmp_path):
    """A short klein LoRA run on paired shards with two references per sample (the data side's tar members,
    batched as ``reference_values``) trains the adapter alone; its export loads with ``load_lora_weights`` on
    ``Flux2KleinPipeline`` and, given the sample's references as ``image=[...]`` (``reference_call``), makes the
    image the run's own pipeline makes, unlike the base's; the references change the image."""
    from diffusers import DiffusionPipeline

    from sd_training import adapters
    from sd_training.data.synthetic import write_edit_shards

    pipeline = family_pipeline("flux2_klein")
    shards = write_edit_shards(str(tmp_path / "edit"), n_samples=8, n_shards=2, size=32, references=2, seed=0)
    length = LLM_LEN["flux2_klein"]
    run = dict(model__adapter__type="lora", model__adapter__rank=4, model__adapter__alpha=8,
               model__llm__max_length=length, dataset__params__reference_crop="center",
               experiment__num_examples_to_see=8, system__batch_size=2, experiment__sample_per_prompt=0,
               optimizer__params__learning_rate=1e-2, validation__path=shards, validation__num_batches=1)
    # That the references reach the steps needs no second run on the targets alone: a batch without them is
    # refused (test_a_batch_without_its_references_is_refused) and other references give another loss (the
    # step test's), so this run trained on them.
    t = run_trainer(load(args(tmp_path, pipeline, shards, dataset__params__references=2, **run)))
    trained = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert trained and all("lora_" in n for n, p in t.net.named_parameters() if id(p) in trained)
    out = t.run_dir.pipeline(None)
    assert (out / adapters.LORA_FILE).is_file()
    call = t.family.reference_call(first_references(shards, 2))  # 32 px: raised to the pipeline's 64
    ours = generate(t.family.inference_pipeline(t.net), call["image"], length)
    base = DiffusionPipeline.from_pretrained(pipeline)
    before = generate(base, call["image"], length)
    base.load_lora_weights(str(out))
    loaded = generate(base, call["image"], length)
    np.testing.assert_allclose(loaded, ours, atol=1e-5, rtol=0)
    assert np.abs(loaded - before).max() > 1e-3, "the LoRA changed nothing"
    assert np.abs(generate(base, None, length) - loaded).max() > 1e-3, "the references changed nothing"


# ------------------------------------------------------------------------------------------ latent shards
def test_a_step_from_latent_shards_with_references_equals_the_online_step(family_pipeline, tmp_path):
    """Latent shards precomputed with two references per sample (``--references 2``: FLUX.2's normalising
    VAE view) hold each reference's latents as the family encodes them online; a klein step from the shards
    (stored latents, reference latents and text) equals the step from the images encoded online."""
    from data_fixtures import make_cfg

    from sd_training.data import build_train_loader
    from sd_training.data.synthetic import write_edit_shards
    from sd_training.data.transforms import unit_range

    pipeline, length = family_pipeline("flux2_klein"), LLM_LEN["flux2_klein"]
    shards = write_edit_shards(str(tmp_path / "edit"), n_samples=8, n_shards=1, size=32, references=2, seed=1)
    out = tmp_path / "latents"
    summary = run_precompute(["--input", shards, "--pipeline", str(pipeline), "--output", str(out), "--resolution",
                              "32", "--dtype", "fp32", "--text-embeddings", "--max-length", str(length), "--batch-size",
                              "8", "--workers", "0", "--no-progress", "--references", "2"])
    assert summary["shards_written"] == ["edit-000000.tar"]

    def family(data, **over):
        cfg = load(args(tmp_path, pipeline, data, model__llm__max_length=length, dataset__params__references=2, **over))
        return families.create(cfg, torch.device("cpu"), 0, True)

    online = family(shards, model__vae__latent_sampling="mean")
    from_shards = family(str(out), dataset__type="latents", dataset__params__text_embeddings="true")

    def first(path, **params):
        cfg = make_cfg(str(path), references=2, **params)
        return next(iter(build_train_loader(cfg, tokenizer=from_shards.tokenizers, rank=0, world_size=1, seed=3)))

    image = first(shards)
    shard = first(out, type="latents", latent_sampling="mean", text_embeddings=True)
    assert shard["keys"] == image["keys"] and shard["reference_latents"].shape[:2] == (4, 2)
    ids = {k: v for k, v in image.items() if isinstance(v, torch.Tensor)
           and k not in ("pixel_values", "sample_seeds", "reference_values")}
    refs = ({"reference_values": image["reference_values"]}, {"reference_latents": shard["reference_latents"]})
    with torch.no_grad():
        want = online.latents({"pixel_values": unit_range(image["pixel_values"])})
        want_refs = torch.stack(online.reference_latents(refs[0]), dim=1)
    torch.testing.assert_close(shard["reference_latents"], want_refs, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(0)
    fixed = {"noise": torch.randn(want.shape, generator=g), "timesteps": torch.tensor([100, 400, 700, 999])}
    assert_shard_step_equals_online(online, from_shards, want, shard, ids, fixed, stored_tol=2e-2, refs=refs)
