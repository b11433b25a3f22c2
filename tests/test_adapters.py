"""model.adapter (sd_training.adapters): a LoRA continued from another run's (init_from) exports a merged pipeline
that samples what base + LoRA samples; presets adapt what they say; bad input gets a ConfigError naming the key.
(Every family's LoRA trains with its base frozen and exports a folder plain diffusers loads with
``load_lora_weights``: test_family_conformance.py.)"""

import numpy as np
import pytest
import torch
from helpers import args_with, run_trainer

from sd_training import adapters
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families import registry as families

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "a red circle on a blue background"
LORA = {"model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.alpha": 8}
SHORT_T5 = {"model.t5.max_length": 16}  # the transformer families' tiny runs: a short T5

args = args_with({"dataset.params.resolution": 32, "experiment.num_examples_to_see": 8})
train = run_trainer


def image(pipe, steps=2, **kw):
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(PROMPT, num_inference_steps=steps, height=32, width=32, generator=torch.Generator().manual_seed(3),
                    output_type="np", **kw).images[0]


def test_lora_init_from_continues_and_merged_export_equals_the_lora(tiny_pipeline, shapes_shards, tmp_path):
    """A second run starts from the first run's LoRA (same weights before any step), exports the merged pipeline
    beside the LoRA, and the merged pipeline samples what base + LoRA samples."""
    from diffusers import StableDiffusionPipeline

    first = train(load(args(tmp_path, tiny_pipeline, shapes_shards, name="a", **LORA,
                            **{"optimizer.params.learning_rate": 1e-2})))
    lora = first.run_dir.pipeline(None)
    cfg = load(args(tmp_path, tiny_pipeline, shapes_shards, name="b", **LORA, **{
        "model.adapter.init_from": str(lora), "model.adapter.export_merged": "true",
        "optimizer.params.learning_rate": 1e-12}))
    fam = families.create(cfg, torch.device("cpu"), 0, True)
    ad = adapters.apply(cfg, fam, None)
    assert all(torch.equal(v, first.net.state_dict()[k]) for k, v in fam.net.state_dict().items())
    second = train(cfg)
    out = second.run_dir.pipeline(None)
    merged = StableDiffusionPipeline.from_pretrained(out / adapters.MERGED)
    base = StableDiffusionPipeline.from_pretrained(tiny_pipeline)
    base.load_lora_weights(str(out))
    np.testing.assert_allclose(image(merged), image(base), atol=1e-4, rtol=0)
    assert ad.encoders == {}


@pytest.mark.parametrize("over, message", [
    ({"model.adapter.rank": 4}, "model.adapter.type is not"),
    ({**LORA, "model.train_target": "vae"}, "model.train_target=vae"),
    ({**LORA, "model.adapter.target_regex": "("}, "model.adapter.target_regex"),
    ({**LORA, "model.text_encoder.train": "true"}, "model.adapter.text_encoders.train"),
    ({**LORA, "model.adapter.text_encoders.rank": 2}, "model.adapter.text_encoders.train is not"),
    ({**LORA, "model.adapter.use_dora": "true", "model.adapter.export_kohya": "true"}, "export_kohya' with model"),
    ({**LORA, "model.adapter.text_encoders.train": "true", "dataset.type": "latents",
      "dataset.params.text_embeddings": "true"}, "would get no gradient"),
])
def test_bad_adapter_config_is_refused_naming_the_key(over, message, tiny_pipeline, shapes_shards, tmp_path):
    with pytest.raises(ConfigError, match=message):
        load(args(tmp_path, tiny_pipeline, shapes_shards, **over))


@pytest.mark.parametrize("over, message", [
    ({"model.adapter.target_modules": "[to_nothing]"}, "target_modules' entry 'to_nothing' matches no"),
    ({"model.adapter.target_regex": "nothing.*"}, "target_regex' 'nothing.*' matches no"),
    ({"model.adapter.rank": 65}, "'model.adapter.rank' 65 is larger than the unet's layer"),
    ({"model.adapter.text_encoders.train": "true", "model.adapter.text_encoders.rank": 65},
     "'model.adapter.text_encoders.rank' 65 is larger than the text_encoder's layer"),
])
def test_targets_matching_nothing_and_too_large_ranks_are_refused(over, message, tiny_pipeline, shapes_shards, tmp_path):
    cfg = load(args(tmp_path, tiny_pipeline, shapes_shards, **{**LORA, **over}))
    fam = families.create(cfg, torch.device("cpu"), 0, True)
    with pytest.raises(ConfigError, match=message):
        adapters.apply(cfg, fam, None)


def test_a_lora_of_another_family_is_refused(tiny_pipeline, sdxl_pipeline, shapes_shards, tmp_path):
    cfg = load(args(tmp_path, tiny_pipeline, shapes_shards, **LORA))
    fam = families.create(cfg, torch.device("cpu"), 0, True)
    adapters.save_lora(adapters.apply(cfg, fam, None), fam.net, tmp_path)
    xl = load(args(tmp_path, sdxl_pipeline, shapes_shards, **LORA, **{"model.adapter.init_from": str(tmp_path)}))
    with pytest.raises(ConfigError, match="model.adapter.init_from"):
        adapters.apply(xl, families.create(xl, torch.device("cpu"), 0, True), None)


def test_presets_adapt_what_they_say(tiny_pipeline, shapes_shards, tmp_path):
    cfg = load(args(tmp_path, tiny_pipeline, shapes_shards, **LORA))
    fam = families.create(cfg, torch.device("cpu"), 0, True)
    resolve = lambda preset: adapters.resolve_targets(fam.net, fam.adapter_presets, preset, [], None, "k", "unet")  # noqa: E731
    attention, ffn, every = resolve("attention"), resolve("attention_ffn"), resolve("all_linear")
    assert attention and all(n.rsplit(".", 2)[-2] in ("attn1", "attn2", "to_out") for n in attention)
    assert set(attention) < set(ffn) < set(every)
    assert any(n.endswith("resnets.0.conv1") for n in every) and "conv_in" not in every and "conv_out" not in every
