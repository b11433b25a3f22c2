"""model.adapter (sd_training.adapters): for every family a tiny run trains a LoRA and exports it in diffusers'
format; plain diffusers loads it with ``load_lora_weights`` and makes the image our model makes (same seed, within
ATOL), unlike the base pipeline's; the base weights are bit-identical after training and the optimizer holds only
adapter parameters. Bad input gets a ConfigError naming the key."""

import numpy as np
import pytest
import torch
from conftest import train_args

from sd_training import adapters, distributed
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families import registry as families
from sd_training.loop import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "a red circle on a blue background"
# Images in [0, 1]: plain diffusers with the exported LoRA against our training pipeline, same seed and call.
# Both run the same peft layers on the same weights; measured difference 0 on the CPU.
ATOL = 1e-5
LORA = {"model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.alpha": 8}
# Per family: extra keys of a tiny run (the transformer families: a short T5, as their own tests use).
FAMILY_KEYS = {"sd": {}, "sdxl": {}, "sd3": {"model.t5.max_length": 16}, "flux": {"model.t5.max_length": 16}}
FIXTURES = {"sd": "tiny_pipeline", "sdxl": "sdxl_pipeline", "sd3": "sd3_pipeline", "flux": "flux_pipeline"}


def args(tmp_path, pipeline, shards, name="run", **over):
    kw = {"dataset.params.resolution": 32, "experiment.num_examples_to_see": 8, **over}
    return train_args(tmp_path, pipeline, shards, name=name, **{k.replace(".", "__"): v for k, v in kw.items()})


def train(cfg) -> Trainer:
    t = Trainer(cfg, distributed.setup("cpu"))
    try:
        t.run()
    finally:
        distributed.teardown()
    return t


def image(pipe, steps=2, **kw):
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(PROMPT, num_inference_steps=steps, height=32, width=32, generator=torch.Generator().manual_seed(3),
                    output_type="np", **kw).images[0]


@pytest.mark.parametrize("family", ["sd", "sdxl", "sd3", "flux"])
def test_lora_trains_exports_and_plain_diffusers_loads_it(family, request, shapes_shards, tmp_path):
    from diffusers import DiffusionPipeline

    pipeline = request.getfixturevalue(FIXTURES[family])
    text = {"model.adapter.text_encoders.train": "true"} if family == "sd" else {}
    kohya = {"model.adapter.export_kohya": "true"} if family in ("sd", "sdxl") else {}
    cfg = load(args(tmp_path, pipeline, shards=shapes_shards, **LORA, **text, **kohya, **FAMILY_KEYS[family],
                    **{"optimizer.params.learning_rate": 1e-2}))
    t = train(cfg)
    base = DiffusionPipeline.from_pretrained(pipeline)
    base_net = getattr(base, t.net_name)

    # Only the adapters trained: the base weights are bit-identical, the optimizer holds adapter parameters only.
    names = {id(p): n for m in [t.net, *t.family.adapters.encoders.values()] for n, p in m.named_parameters()}
    trained = [names[id(p)] for g in t.optimizer.param_groups for p in g["params"]]
    assert trained and all("lora_" in n for n in trained)
    assert all(id(p) in {id(q) for g in t.optimizer.param_groups for q in g["params"]} for p in t.optimizer.state)
    want = base_net.state_dict()
    for name, p in t.net.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(p, want[name.replace("base_layer.", "")]), name
    assert any(float(p.abs().sum()) > 0 for n, p in t.net.named_parameters() if "lora_B" in n)  # it moved

    # The export is a diffusers LoRA folder: plain diffusers loads it and samples what our model samples.
    out = t.run_dir.pipeline(None)
    assert (out / adapters.LORA_FILE).is_file() and not (out / "model_index.json").exists()
    ours_pipe = t.family.inference_pipeline(t.net)
    kw = {"max_sequence_length": ours_pipe._max_length} if hasattr(ours_pipe, "_max_length") else {}
    kw["guidance_scale"] = float(cfg.model.guidance_embed) if family == "flux" else 1.0
    ours = image(ours_pipe, **kw)
    before = image(base, **kw)
    base.load_lora_weights(str(out))
    loaded = image(base, **kw)
    np.testing.assert_allclose(loaded, ours, atol=ATOL, rtol=0)
    assert np.abs(loaded - before).max() > 1e-3, "the LoRA changed nothing"
    if kohya:  # the kohya-named copy (alpha 8 != rank 4, and SD's CLIP LoRA as lora_te1_) loads to the same image
        from safetensors.torch import load_file

        file = out / adapters.KOHYA_FILE
        keys = load_file(str(file))
        assert any(k.startswith("lora_unet_") and k.endswith(".lora_down.weight") for k in keys)
        alphas = {k.split("_")[1]: float(v) for k, v in keys.items() if k.endswith(".alpha")}  # unet: 8; CLIP: its rank
        assert alphas == ({"unet": 8.0, "te1": 4.0} if family == "sd" else {"unet": 8.0})
        assert all(k.startswith("lora_te1_text_model_encoder_layers_") for k in keys if k.startswith("lora_te"))
        fresh = DiffusionPipeline.from_pretrained(pipeline)
        fresh.load_lora_weights(str(file))
        np.testing.assert_allclose(image(fresh, **kw), ours, atol=ATOL, rtol=0)


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


def test_a_kohya_export_of_a_transformer_family_is_refused(sd3_pipeline, shapes_shards, tmp_path):
    cfg = load(args(tmp_path, sd3_pipeline, shapes_shards, **LORA, **FAMILY_KEYS["sd3"],
                    **{"model.adapter.export_kohya": "true"}))
    fam = families.create(cfg, torch.device("cpu"), 0, True)
    with pytest.raises(ConfigError, match="'model.adapter.export_kohya': the sd3 family's transformer has no kohya"):
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
