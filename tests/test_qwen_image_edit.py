"""Qwen-Image-Edit as a family (families/qwen_image_edit.py): the conditioning equals
QwenImageEditPipeline.encode_prompt(prompt, image=...) (the reference through Qwen2.5-VL's processor and vision
tower, the edit template's 64 tokens dropped, the mask), the reference's latents, tokens and img_shapes are the
pipeline's, one training step equals a step written as the pipeline's forward and diffusers'
train_dreambooth_lora_qwen_image.py compute it, a LoRA export loads with load_lora_weights on the edit pipeline,
and the refusals. What every family does: test_family_conformance.py."""

import re

import numpy as np
import pytest
import torch
from helpers import args_with, example_timesteps
from PIL import Image

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families import qwen_image_edit_parts as eparts
from sd_training.families import qwen_image_parts as parts
from sd_training.families import registry as families
from sd_training.families.components.ddpm import sample_generators
from sd_training.families.qwen_image_edit import QwenImageEdit, reference_size

pytestmark = pytest.mark.usefixtures("one_thread")
LLM_LEN = 40  # model.llm.max_length of the tests (the vision markers, the instruction, the template's end): none is cut
CAPTIONS = ["make the background blue", "", "turn the red circle green", "a"]
RES = 32

edit_args = args_with({"dataset.params.resolution": RES, "model.llm.max_length": LLM_LEN,
                       "dataset.params.references": 1})


def references(n: int, seed: int, size: int = RES) -> torch.Tensor:
    """uint8 reference images [n, 1, 3, size, size], as the loader's ``reference_values``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 1, 3, size, size), generator=g, dtype=torch.uint8)


def pil(refs: torch.Tensor) -> list[Image.Image]:
    return [Image.fromarray(r[0].permute(1, 2, 0).numpy()) for r in refs]


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
    ({"dataset.type": "latents"}, "depend on the image"),
    ({"model.llm.max_length": 1025}, "at most 1024"),
    ({"model.t5.max_length": 16}, "model.llm.max_length"),
    ({"dataset.params.resolution": 40}, "multiples of 16"),
])
def test_refusals_name_the_key(pipeline, shapes_shards, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load(edit_args(tmp_path, pipeline, shapes_shards, **override))


def test_stored_text_embeddings_are_refused(pipeline):
    with pytest.raises(ValueError, match="--text-embeddings.*depend on the image"):
        QwenImageEdit.text_encoding(str(pipeline), torch.device("cpu"))


def test_the_template_is_the_pipelines_and_its_system_prompt_is_64_tokens(pipe):
    """The family's template and dropped prefix are the pipeline's; the tiny tokenizer spells the system prompt in
    64 tokens as Qwen2.5-VL's does, so the dropped tokens are exactly the system prompt's and the image's tokens
    stay conditioning."""
    assert eparts.EDIT_TEMPLATE == pipe.prompt_template_encode
    assert eparts.EDIT_PREFIX_TOKENS == pipe.prompt_template_encode_start_idx
    system = pipe.prompt_template_encode.split(eparts.VISION_START)[0]
    ids = pipe.tokenizer(system + eparts.VISION_START).input_ids
    assert len(ids) == eparts.EDIT_PREFIX_TOKENS + 1 and ids[-1] == pipe.tokenizer.convert_tokens_to_ids(eparts.VISION_START)
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
