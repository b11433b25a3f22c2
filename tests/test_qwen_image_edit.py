"""Qwen-Image-Edit as a family (families/qwen_image_edit.py): the conditioning equals
QwenImageEditPipeline.encode_prompt(prompt, image=...) (the reference through Qwen2.5-VL's processor and vision
tower, the edit template's 64 tokens dropped, the mask), the reference's latents, tokens and img_shapes are the
pipeline's, one training step equals a step written as the pipeline's forward and diffusers'
train_dreambooth_lora_qwen_image.py compute it, a LoRA export loads with load_lora_weights on the edit pipeline,
and the refusals. What every family does: test_family_conformance.py."""


import numpy as np
import pytest
import torch
from example_steps import pil as image_of
from example_steps import qwen_step
from helpers import args_with, step_equals_example, without_forward_hooks
from PIL import Image

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.data.buckets import target_sizes
from sd_training.families import qwen_image_edit_parts as eparts
from sd_training.families import qwen_image_parts as parts
from sd_training.families import registry as families
from sd_training.families.qwen_image_edit import QwenImageEdit, reference_size

pytestmark = pytest.mark.usefixtures("one_thread")
LLM_LEN = 40  # model.llm.max_length of the tests (the vision markers, the instruction, the template's end): none is cut
CAPTIONS = ["make the background blue", "", "turn the red circle green", "a"]
RES = 32

# no sample grid (an edit family's needs reference files: the conformance suite's runs make them)
edit_args = args_with({"dataset.params.resolution": RES, "model.llm.max_length": LLM_LEN,
                       "dataset.params.references": 1, "experiment.sample_prompts": "[]"})


def references(n: int, seed: int, size: int = RES, k: int = 1) -> torch.Tensor:
    """uint8 reference images [n, k, 3, size, size], as the loader's ``reference_values``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, k, 3, size, size), generator=g, dtype=torch.uint8)


def pil(refs: torch.Tensor) -> list[Image.Image]:
    """Each sample's first reference as a PIL image."""
    return [image_of(r[0]) for r in refs]


@pytest.fixture(scope="module")
def pipeline(family_pipeline):
    return family_pipeline("qwen_image_edit")


@pytest.fixture(scope="module")
def pipe(pipeline):
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline.from_pretrained(pipeline)


@pytest.fixture(scope="module")
def family(pipeline, shapes_shards, tmp_path_factory):
    """The run's family (fp32, posterior mean, cosmap weighting), built from a config as the trainer builds it."""
    tmp = tmp_path_factory.mktemp("qwen_image_edit_family")
    cfg = load(edit_args(tmp, pipeline, shapes_shards, model__vae__latent_sampling="mean",
                         flow_matching__weighting="cosmap"))
    return families.create(cfg, torch.device("cpu"), 0, True)


def test_the_family_is_read_from_the_pipeline_and_takes_one_reference(pipeline, shapes_shards, tmp_path):
    assert families.detect(load(edit_args(tmp_path, pipeline, shapes_shards)).model) == "qwen_image_edit"
    assert QwenImageEdit.reference_images == (1, 1)
    for n in (0, 2):
        with pytest.raises(ConfigError, match="dataset.params.references"):
            load(edit_args(tmp_path, pipeline, shapes_shards, dataset__params__references=n))


@pytest.mark.parametrize("override, message", [
    # from latent shards: the text read with the references is stored (it cannot be encoded without their pixels)
    ({"dataset.type": "latents"}, "needs dataset.params.text_embeddings: true.*--references 1 --text-embeddings"),
    ({"dataset.type": "latents", "model.text_encoder.train": "true"}, "trained text encoder.*from image shards"),
    ({"dataset.type": "latents", "model.adapter.type": "lora", "model.adapter.text_encoders.train": "true"},
     "trained text encoder.*from image shards"),
    ({"model.llm.max_length": 1025}, "at most 1024"),
    ({"model.t5.max_length": 16}, "model.llm.max_length"),
    ({"dataset.params.resolution": 40}, "multiples of 16"),
])
def test_refusals_name_the_key(pipeline, shapes_shards, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load(edit_args(tmp_path, pipeline, shapes_shards, **override))


def test_stored_text_is_read_with_the_references(pipeline, shapes_shards, tmp_path):
    """The shards' text is read with each sample's references: --text-embeddings without --references is refused,
    naming the flag (the encoding itself: the conformance suite's latent-shard test)."""
    from conftest import run_precompute

    with pytest.raises(ValueError, match="add --references 1"):
        QwenImageEdit.text_encoding(str(pipeline), torch.device("cpu"))
    with pytest.raises(SystemExit, match="--text-embeddings.*add --references 1"):
        run_precompute(["--input", shapes_shards, "--pipeline", str(pipeline), "--output", str(tmp_path / "out"),
                        "--text-embeddings", "--no-progress"])


def test_the_template_is_the_pipelines_and_its_system_prompt_is_64_tokens(pipe):
    """The family's template and dropped prefix are the pipeline's; the tiny tokenizer spells the system prompt in
    64 tokens as Qwen2.5-VL's does, so the dropped tokens are exactly the system prompt's and the image's tokens
    stay conditioning."""
    assert eparts.EDIT_TEMPLATE == pipe.prompt_template_encode
    assert eparts.EDIT_PREFIX_TOKENS == pipe.prompt_template_encode_start_idx
    system = pipe.prompt_template_encode.split(eparts.VISION_START)[0]
    ids = pipe.tokenizer(system + eparts.VISION_START).input_ids
    start = pipe.tokenizer.convert_tokens_to_ids(eparts.VISION_START)
    assert len(ids) == eparts.EDIT_PREFIX_TOKENS + 1 and ids[-1] == start
    assert pipe.text_encoder.config.image_token_id == pipe.processor.image_token_id


def test_conditioning_equals_the_pipelines_encode_prompt_with_the_image(family, pipe):
    """States and mask equal ``encode_prompt(prompt, image=...)`` (to float32 rounding of other padded lengths) for
    a batch holding the empty instruction; the reference is conditioning: another image, other states."""
    refs = references(len(CAPTIONS), 0)
    ids = family.tokenizers[0](CAPTIONS).input_ids
    assert ids.shape == (4, LLM_LEN + 64)
    states, mask = family.condition({"input_ids": ids, "reference_values": refs})
    with torch.no_grad():
        want, want_mask = pipe.encode_prompt(CAPTIONS, image=pil(refs), device="cpu")
    assert states.shape == want.shape and torch.equal(mask, want_mask)
    _, grid = eparts.vision_inputs(pipe.processor.image_processor, refs[:1, 0])
    (n_image,) = eparts.image_token_count(grid, pipe.processor.image_processor.merge_size)
    assert n_image > 1 and int(mask[1].sum()) == 3 + n_image - 1 + 5  # the markers, the image, the template's end
    torch.testing.assert_close(states, want.float(), rtol=1e-5, atol=1e-6)
    other, _ = family.condition({"input_ids": ids, "reference_values": references(len(CAPTIONS), 1)})
    assert not torch.allclose(other, states)
    with pytest.raises(ValueError, match="reference_values"):
        family.condition({"input_ids": ids})


def test_stored_text_of_a_bucket_is_the_steps_condition(family, pipeline):
    """What latent shards store for a caption (``text_encoding(..., references, sizes)``, an aspect bucket's
    reference) is the step's online condition once read back: padded to the longest of the folder's sizes, the
    padding masked out; the family expects text read with its references by its rule."""
    from sd_training.data.latents import TEXT_STATES_KEY
    from sd_training.families import qwen_image_edit_text as etext

    sizes = target_sizes(64, True, 16, 2.0)  # (48, 80), (64, 64), (80, 48)...
    encoding = QwenImageEdit.text_encoding(str(pipeline), torch.device("cpu"), 0, LLM_LEN, references=1, sizes=sizes)
    square = etext.stored_length(family.models.processor, family.vl_rule, 8, 1, LLM_LEN, [(64, 64)])
    assert encoding.text_shape[0] > square > LLM_LEN  # a 48 x 80 bucket's reference has more VL tokens
    expected = family.stored_text()  # the run's (32 px, one reference, read at the target's size)
    assert (expected.references, expected.vl_images, expected.width) == (1, etext.TARGET_SIZE, encoding.text_shape[1])
    refs = references(len(CAPTIONS), 2)[..., :16].repeat_interleave(3, -1)  # 32 x 48 px: a bucket's shape
    stored, _ = encoding.encode(CAPTIONS, refs)
    assert stored.shape == (len(CAPTIONS), *encoding.text_shape)
    ids = family.tokenizers[0](CAPTIONS).input_ids
    want = family.condition({"input_ids": ids, "reference_values": refs})
    got = family.condition({TEXT_STATES_KEY: torch.from_numpy(stored)})
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], want[1])


def test_reference_latents_tokens_and_img_shapes_are_the_pipelines(family, pipe):
    """The reference latents are ``_encode_vae_image``'s (the normalised posterior mode) of the reference at the
    target's size, packed after the target's tokens (``prepare_latents``); ``img_shapes`` are what ``__call__``
    passes for a reference of the output's size; the prediction is the target's tokens."""
    refs = references(2, 3)
    batch = {"reference_values": refs}
    (ours,) = family.reference_latents(batch)
    pixels = refs[:, 0].float() / 127.5 - 1
    with torch.no_grad():
        want = pipe._encode_vae_image(pixels.unsqueeze(2), generator=None)
    mean_latents = family.encode(pixels, mean=True)
    torch.testing.assert_close(mean_latents, want.squeeze(2), rtol=1e-6, atol=1e-6)
    assert ours.shape == mean_latents.shape
    noisy = torch.randn_like(mean_latents)
    _, packed = pipe.prepare_latents(pixels.unsqueeze(2), 2, 4, RES, RES, torch.float32, "cpu", None, latents=None)
    joint = eparts.joint_tokens(noisy, [mean_latents])
    n = (RES // 16) ** 2
    torch.testing.assert_close(joint[:, n:], packed, rtol=1e-6, atol=1e-6)
    assert torch.equal(joint[:, :n], parts.tokens(noisy))
    h = RES // pipe.vae_scale_factor // 2
    assert eparts.joint_img_shapes(noisy, [mean_latents]) == [[(1, h, h), (1, h, h)]] * 2
    assert torch.equal(eparts.target_tokens(joint, noisy.shape), noisy)


def check_step(family, pipe, refs, vl_images=None):
    """The family's step against the edit pipelines' forward in diffusers' training step
    (``example_steps.qwen_step`` with ``refs``, each prompt read with ``vl_images(its references)``) on one batch
    (4 targets, ``refs``, the instructions), the same u and noise, the unshifted sigma table, cosmap weighting: loss
    and gradients within 1e-5 relative (float32; padded lengths and summation order differ; the last block's
    text-stream output feeds nothing, as in test_qwen_image.py). The references condition the step: other
    references, another loss."""
    target = torch.rand(4, 3, RES, RES, generator=torch.Generator().manual_seed(1)) * 2 - 1
    batch = {"pixel_values": target, "reference_values": refs, "input_ids": family.tokenizers[0](CAPTIONS).input_ids,
             "sample_seeds": torch.arange(10, 14)}
    net = family.net
    last = len(net.transformer_blocks) - 1

    def example(u, noise):
        with without_forward_hooks(net.transformer_blocks[last]):  # the reference's transformer: without the tie
            return qwen_step(pipe, net, target, CAPTIONS, u, noise.unsqueeze(2), "cosmap", refs=refs,
                             vl_images=vl_images)

    side = RES // pipe.vae_scale_factor
    other = {**batch, "reference_values": references(4, 5, k=refs.shape[1])}
    with step_equals_example(family, batch, (pipe.vae.config.z_dim, side, side), example,
                             unused_in=f"transformer_blocks.{last}.",
                             other=lambda: family.loss(net, other, torch.autocast("cpu", enabled=False))) as step:
        assert abs(float(step.other.loss) - float(step.ours.loss.detach())) > 1e-4
        assert net.txt_in.weight.grad.abs().sum() > 0 and net.img_in.weight.grad.abs().sum() > 0


def test_one_step_equals_the_edit_pipelines_forward_in_diffusers_training_step(family, pipe):
    check_step(family, pipe, references(4, 2))


def test_validation_batches_keep_the_reference_pixels_and_fix_its_latents(family):
    """A validation batch holds the reference's posterior mean (fixed like the target's) and its pixels (the VL
    encoder's input); its loss is the same at every call."""
    batch = {"pixel_values": references(2, 6)[:, 0], "reference_values": references(2, 7),
             "input_ids": family.tokenizers[0](CAPTIONS[:2]).input_ids}
    b = family.validation_batch(batch, torch.Generator().manual_seed(0), 0)
    assert torch.equal(b["reference_values"], batch["reference_values"]) and b["reference_latents"].shape[1] == 1
    fixed = {k: b[k] for k in ("noise", "timesteps")}
    with torch.no_grad():
        first = family.loss(family.net, b, torch.autocast("cpu", enabled=False), fixed=fixed, validation=True)
        again = family.loss(family.net, b, torch.autocast("cpu", enabled=False), fixed=fixed, validation=True)
    assert torch.equal(first.per_sample, again.per_sample)


def edit(call, refs, **kw):
    """One 32 px image of ``call`` (a pipeline) editing ``refs`` (PIL images, one per prompt)."""
    with torch.no_grad():
        return call(prompt=["make the background blue"] * len(refs), image=refs, height=RES, width=RES,
                    num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(3), **kw).images


def test_samples_size_the_reference_as_training_and_guide_with_true_cfg(family):
    """Sample grids call the edit pipeline with ``reference_call``'s image; the reference is brought to the
    sample's size (as training pairs it) instead of ~1 Mpx, and the guidance scale is ``true_cfg_scale`` against
    the empty instruction (read with the same image); the pipeline's sizing is restored after the call."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as module

    original = module.calculate_dimensions
    pipe = family.inference_pipeline(family.net)
    pipe.set_progress_bar_config(disable=True)
    image = pil(references(1, 8))[0]
    kw = family.reference_call([image])
    assert kw == {"image": image}
    with pytest.raises(ValueError, match="one reference"):
        family.reference_call([image, image])
    guided = edit(pipe, [kw["image"]], guidance_scale=4.0)
    assert module.calculate_dimensions is original and original(1024 * 1024, 1.0)[:2] == (1024, 1024)
    raw = pipe._pipe
    with reference_size(RES, RES):
        assert module.calculate_dimensions(1024 * 1024, 1.0)[:2] == (RES, RES)
        assert module.calculate_dimensions(1024 * 1024, 2.0)[:2] == original(RES * RES, 2.0)[:2]
        want = edit(raw, [image], true_cfg_scale=4.0, negative_prompt=[""], max_sequence_length=LLM_LEN)
        unguided = edit(raw, [image], true_cfg_scale=1.0)
    assert guided.shape == (1, RES, RES, 3) and (guided == want).all() and not (guided == unguided).all()


def test_a_lora_export_loads_with_load_lora_weights_on_the_edit_pipeline(pipeline, shapes_shards, tmp_path):
    """A LoRA on the family's transformer (its B moved off zero, as training moves it) exports a diffusers LoRA file
    (and the merged pipeline); plain ``QwenImageEditPipeline.load_lora_weights`` makes the image the run's own
    pipeline makes for the same reference and seed, unlike the base pipeline; the merged export is an edit
    pipeline making it too."""
    from diffusers import DiffusionPipeline, QwenImageEditPipeline

    from sd_training import adapters

    cfg = load(edit_args(tmp_path, pipeline, shapes_shards, model__adapter__type="lora", model__adapter__rank=4,
                         model__adapter__alpha=8))
    family = families.create(cfg, torch.device("cpu"), 0, True)
    ad = adapters.apply(cfg, family, None)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in family.net.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    out = tmp_path / "export"
    adapters.export(ad, family, family.net, out, merged=True)
    image = [pil(references(1, 9))[0]]
    ours_pipe = family.inference_pipeline(family.net)._pipe
    base = QwenImageEditPipeline.from_pretrained(pipeline)
    merged = DiffusionPipeline.from_pretrained(out / adapters.MERGED)
    assert type(merged) is QwenImageEditPipeline
    for p in (ours_pipe, base, merged):
        p.set_progress_bar_config(disable=True)
    with reference_size(RES, RES):
        ours, before = edit(ours_pipe, image, true_cfg_scale=1.0), edit(base, image, true_cfg_scale=1.0)
        base.load_lora_weights(str(out))
        loaded = edit(base, image, true_cfg_scale=1.0)
        from_merged = edit(merged, image, true_cfg_scale=1.0)
    np.testing.assert_allclose(loaded, ours, atol=1e-5, rtol=0)
    np.testing.assert_allclose(from_merged, ours, atol=1e-4, rtol=0)
    assert np.abs(loaded - before).max() > 1e-3, "the LoRA changed nothing"


# -- Qwen-Image-Edit-Plus (2509 / 2511): several references, named in the text -----------------------------------
plus_args = args_with({"dataset.params.resolution": RES, "model.llm.max_length": LLM_LEN + 16,
                       "dataset.params.references": 2, "experiment.sample_prompts": "[]"})


@pytest.fixture(scope="module")
def plus_pipeline(family_pipeline):
    return family_pipeline("qwen_image_edit_plus")


@pytest.fixture(scope="module")
def plus_pipe(plus_pipeline):
    from diffusers import QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline.from_pretrained(plus_pipeline)


@pytest.fixture(scope="module")
def plus(plus_pipeline, shapes_shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen_image_edit_plus_family")
    cfg = load(plus_args(tmp, plus_pipeline, shapes_shards, model__vae__latent_sampling="mean",
                         flow_matching__weighting="cosmap"))
    return families.create(cfg, torch.device("cpu"), 0, True)


def condition_images(images: list[Image.Image]) -> list[Image.Image]:
    """What QwenImageEditPlusPipeline.__call__ gives encode_prompt: each image at ~384^2 of its ratio."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

    resizer = VaeImageProcessor(vae_scale_factor=16)
    sizes = [module.calculate_dimensions(module.CONDITION_IMAGE_SIZE, im.width / im.height) for im in images]
    return [resizer.resize(im, h, w) for im, (w, h) in zip(images, sizes)]


def test_plus_takes_one_to_three_references_named_in_its_template(plus_pipeline, plus_pipe, shapes_shards, tmp_path):
    assert families.detect(load(plus_args(tmp_path, plus_pipeline, shapes_shards)).model) == "qwen_image_edit_plus"
    with pytest.raises(ConfigError, match="dataset.params.references"):
        load(plus_args(tmp_path, plus_pipeline, shapes_shards, dataset__params__references=4))
    pictures = "".join(f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>" for i in range(2))
    assert eparts.plus_template(2).format("x") == plus_pipe.prompt_template_encode.format(pictures + "x")
    assert plus_pipe.prompt_template_encode_start_idx == eparts.EDIT_PREFIX_TOKENS


def test_plus_conditioning_equals_encode_prompt_with_its_images(plus, plus_pipe):
    """Each sample's states equal ``encode_prompt(prompt, image=[its references at ~384^2])`` (the pipeline encodes
    one prompt at a time); the VL images are 384^2-sized whatever the target's size."""
    refs = references(len(CAPTIONS), 0, k=2)
    states, mask = plus.condition({"input_ids": plus.tokenizers[0](CAPTIONS).input_ids, "reference_values": refs})
    for i, caption in enumerate(CAPTIONS):
        images = [image_of(r) for r in refs[i]]
        assert condition_images(images)[0].size == (384, 384)
        with torch.no_grad():
            want, want_mask = plus_pipe.encode_prompt(caption, image=condition_images(images), device="cpu")
        n = want.shape[1]
        assert want_mask is None and int(mask[i].sum() if mask is not None else states.shape[1]) == n
        torch.testing.assert_close(states[i, :n], want[0].float(), rtol=1e-5, atol=1e-6)


def test_plus_step_equals_its_pipelines_forward_in_diffusers_training_step(plus, plus_pipe):
    check_step(plus, plus_pipe, references(4, 2, k=2), vl_images=condition_images)


def test_plus_samples_size_the_references_as_training(plus):
    """Plus's sample call takes the prompt's references as a list; their VAE images at the sample's size, the VL
    images at 384^2, as in training; the pipeline's sizing restored after the call."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

    from sd_training.families.qwen_image_edit import PLUS_MODULE

    original = module.calculate_dimensions
    pipe = plus.inference_pipeline(plus.net)
    pipe.set_progress_bar_config(disable=True)
    images = [image_of(r) for r in references(1, 8, k=2)[0]]
    kw = plus.reference_call(images)
    assert kw == {"image": images}
    with torch.no_grad():
        ours = pipe(prompt="make the background blue", height=RES, width=RES, num_inference_steps=2, output_type="np",
                    generator=torch.Generator().manual_seed(3), guidance_scale=1.0, **kw).images
    assert module.calculate_dimensions is original
    with reference_size(RES, RES, PLUS_MODULE):
        vl_area = module.CONDITION_IMAGE_SIZE
        assert module.calculate_dimensions(vl_area, 1.0) == original(vl_area, 1.0)
        assert module.calculate_dimensions(module.VAE_IMAGE_SIZE, 1.0) == (RES, RES)
        with torch.no_grad():
            want = pipe._pipe(prompt="make the background blue", height=RES, width=RES, num_inference_steps=2,
                              output_type="np", generator=torch.Generator().manual_seed(3), true_cfg_scale=1.0,
                              max_sequence_length=LLM_LEN + 16, **kw).images
    assert ours.shape == (1, RES, RES, 3) and (ours == want).all()
