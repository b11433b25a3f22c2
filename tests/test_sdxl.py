"""SDXL as a family: its conditioning equals StableDiffusionXLPipeline's, and training, validation,
exports, sample grids, eval images and exact resume work as for SD (bf16 autocast, loader workers,
two ranks under FSDP)."""

import json

import numpy as np
import pytest
import torch
from conftest import train_args
from test_resume import N, args_for, assert_same, final_state, finish, kill_after_checkpoint, launch, losses

from sd_training.checkpoint import complete_steps
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.data.transforms import unit_range
from sd_training.families import registry as families
from sd_training.families.sdxl import encode_prompts, time_ids
from sd_training.loop import main

# In-process training: one intra-op thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def test_family_is_read_from_the_pipeline(sdxl_pipeline, tiny_pipeline, shapes_shards, tmp_path):
    xl = load(train_args(tmp_path, sdxl_pipeline, shapes_shards))
    sd = load(train_args(tmp_path, tiny_pipeline, shapes_shards))
    assert families.detect(xl.model) == "sdxl" and families.detect(sd.model) == "sd"
    forced = load(train_args(tmp_path, tiny_pipeline, shapes_shards, model__family="sdxl"))
    assert families.detect(forced.model) == "sdxl"
    with pytest.raises(ConfigError, match="model.family"):
        load(train_args(tmp_path, tiny_pipeline, shapes_shards, model__family="kandinsky"))


@pytest.mark.parametrize("override, message", [
    ({"model.text_encoder.type": "open_clip", "model.text_encoder.open_clip_model": "ViT-bigG-14",
      "model.text_encoder.open_clip_weights": __file__}, "must be clip"),
    ({"model.vae.dtype": "fp16"}, "overflows in fp16"),
    ({"model.text_encoder.clip_skip": 2}, "penultimate"),
])
def test_sdxl_refuses_what_it_does_not_support_with_the_reason(sdxl_pipeline, shapes_shards, tmp_path, override,
                                                                 message):
    with pytest.raises(ConfigError, match=message):
        load(train_args(tmp_path, sdxl_pipeline, shapes_shards, **{k.replace(".", "__"): v for k, v in override.items()}))


def test_sdxl_an_sd_pipeline_named_sdxl_is_refused_at_build(tiny_pipeline, shapes_shards, tmp_path):
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, model__family="sdxl"))
    with pytest.raises(ConfigError, match="text_encoder_2"):
        families.create(cfg, torch.device("cpu"), 0, True)


def test_conditioning_equals_the_pipelines_own(sdxl_pipeline):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_pipeline)
    prompts = ["a red circle on a blue background", ""]
    ids = [tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
               return_tensors="pt").input_ids for tok in (pipe.tokenizer, pipe.tokenizer_2)]
    assert ids[0][1, 1] == pipe.tokenizer.eos_token_id and ids[1][1, 2] == 0  # the second pads with "!"
    states, pooled = encode_prompts(pipe.text_encoder, pipe.text_encoder_2, ids[0], ids[1], pipe.tokenizer.eos_token_id)
    want, _, want_pooled, _ = pipe.encode_prompt(prompts[0], device="cpu", do_classifier_free_guidance=False)
    assert states.shape == (2, 77, 128) and pooled.shape == (2, 64)
    torch.testing.assert_close(states[:1], want.float())
    torch.testing.assert_close(pooled[:1], want_pooled.float())
    # The empty caption is the pipeline's unconditional branch: zeros (force_zeros_for_empty_prompt).
    _, neg, _, neg_pooled = pipe.encode_prompt(prompts[0], device="cpu", do_classifier_free_guidance=True)
    assert torch.equal(states[1:], neg.float()) and torch.equal(pooled[1:], neg_pooled.float())
    assert not neg.abs().sum() and states[0].abs().sum() > 0


def test_time_ids_are_original_crop_target_per_sample():
    batch = {"input_ids": torch.zeros(2, 77), "original_size": torch.tensor([[300, 200], [64, 64]]),
             "crop_top_left": torch.tensor([[10, 0], [0, 0]]), "target_size": torch.tensor([[64, 48], [64, 64]])}
    assert time_ids(batch, 64, 64).tolist() == [[300, 200, 10, 0, 64, 48], [64, 64, 0, 0, 64, 64]]
    del batch["original_size"]
    assert time_ids(batch, 64, 64).tolist() == [[64, 64, 0, 0, 64, 64]] * 2


@pytest.mark.slow
def test_sdxl_trains_validates_exports_samples_in_bf16_with_workers_v_prediction(sdxl_pipeline, shapes_shards, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    cfg = load(train_args(
        tmp_path, sdxl_pipeline, shapes_shards, name="xl", model__mixed_precision="bf16", system__workers=2,
        experiment__num_examples_to_see=16, experiment__save_every=2, model__use_ema="true",
        validation__path=shapes_shards, validation__num_batches=1, experiment__num_eval_images=2,
        experiment__eval_caption_file=str(prompts), dataset__params__caption_dropout=0.5,
        objective__prediction_type="v_prediction", objective__loss_weighting="min_snr",
        dataset__params__resolution=32,  # bf16 convolutions on this CPU are ATen's slow kernels: a quarter of 64 px's
    ))
    out = main(cfg)
    run = tmp_path / "runs" / "xl"
    assert out["step"] == 4
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    assert [r["step"] for r in rows if "val/loss" in r] == [0, 2, 4]
    assert any(r.get("model_tflops_per_image", 0) > 0 for r in rows)  # MFU is defined for SDXL
    assert (run / "samples" / "step_00000004.png").is_file()
    assert len(list((run / "eval" / "step_00000004").glob("*.png"))) == 2
    for folder in ("current_pipeline", "current_pipeline_ema"):
        index = json.loads((run / folder / "model_index.json").read_text())
        assert index["_class_name"] == "StableDiffusionXLPipeline"
        # The objective's parameterisation reaches the exported (Euler) scheduler: it samples as it trained.
        assert json.loads((run / folder / "scheduler" / "scheduler_config.json").read_text())["prediction_type"] == \
            "v_prediction"
        pipe = StableDiffusionXLPipeline.from_pretrained(run / folder)  # plain diffusers, offline
        image = pipe("a red circle", height=64, width=64, num_inference_steps=2,
                     generator=torch.Generator().manual_seed(0)).images[0]
        assert image.size == (64, 64)
    # The frozen encoders are exported in fp32 as loaded (the run kept them in bf16).
    te2 = StableDiffusionXLPipeline.from_pretrained(run / "current_pipeline").text_encoder_2
    source = StableDiffusionXLPipeline.from_pretrained(sdxl_pipeline).text_encoder_2
    assert te2.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(te2.state_dict().values(), source.state_dict().values()))


@pytest.mark.slow
@pytest.mark.distributed
def test_sdxl_fsdp_two_ranks_kill_and_resume_is_bit_identical(tmp_path, sdxl_pipeline, shapes_shards):
    kw = {"system.batch_size": 2, "distributed.strategy": "fsdp", "system.workers": 1, "model.mixed_precision": "bf16"}
    finish(launch(tmp_path, args_for(tmp_path, sdxl_pipeline, shapes_shards, "straight", **kw), 2))
    resumed = args_for(tmp_path, sdxl_pipeline, shapes_shards, "resumed", **kw)
    run = tmp_path / "runs" / "resumed"
    kill_after_checkpoint(launch(tmp_path, resumed, 2), run / "checkpoints", 3)
    first = complete_steps(run / "checkpoints")
    assert max(first) < N, first  # the killed run left steps for the restart to train
    assert "resumed from" in finish(launch(tmp_path, resumed, 2))
    a, ta = final_state(tmp_path / "runs" / "straight")
    b, tb = final_state(run)
    for name in ("unet", "ema", "optimizer", "lr_scheduler"):
        assert_same(a[name], b[name], name)
    assert ta["step"] == tb["step"] == N
    # FSDP saves are asynchronous (DCP async_save): the log says how long training waited.
    assert "training waited" in (run / "train.log").read_text()
    # The memory plan at start-up: this run's strategy, each rank holding half of the trained state.
    plan = json.loads((run / "memory_plan.json").read_text())
    rows = {r["strategy"]: r for r in plan["rows"]}
    assert plan["strategy"] == "fsdp" and plan["world_size"] == 2
    n_params = sum(v.numel() for v in a["unet"].values())
    assert rows["ddp"]["weights"] * 2**30 == n_params * 4
    for key in ("weights", "gradients", "optimizer", "ema"):
        assert rows["fsdp"][key] == rows["ddp"][key] / 2 and rows["fsdp_offload"][key] == 0
    assert rows["ddp"]["optimizer"] == 2 * rows["ddp"]["weights"]  # AdamW: two fp32 moments
    assert 0 < rows["fsdp"]["gathered"] < rows["ddp"]["weights"] and rows["ddp"]["frozen"] > 0
    la, lb = losses(tmp_path / "runs" / "straight"), losses(run)
    for s in range(max(first) + 1, N + 1):
        assert la[s] == lb[s], (s, la[s], lb[s])


@pytest.fixture(scope="module")
def sdxl_latents(tmp_path_factory, sdxl_pipeline, shapes_shards):
    """The shapes shards precomputed for SDXL at 32 px: latents (mean, std), both encoders' states, pooled."""
    from conftest import run_precompute

    out = tmp_path_factory.mktemp("sdxl_latents") / "out"
    run_precompute(["--input", shapes_shards, "--pipeline", str(sdxl_pipeline), "--output", str(out), "--resolution",
                    "32", "--dtype", "fp32", "--text-embeddings", "--batch-size", "16", "--workers", "0", "--no-progress"])
    return out


def test_sdxl_latent_shards_give_the_same_step_as_pixels(sdxl_latents, sdxl_pipeline, shapes_shards, tmp_path):
    """Loss and gradients of one step from shard latents (with and without the stored text embeddings) equal
    those from the same images encoded online (posterior mean), size conditioning included."""
    from data_fixtures import make_cfg

    from sd_training import distributed
    from sd_training.data import build_train_loader
    from sd_training.data.latents import EMPTY_POOLED_FILE, EMPTY_TEXT_FILE
    from sd_training.loop import Trainer

    info = json.loads((sdxl_latents / "latents_info.json").read_text())
    assert info["text_shape"] == [77, 128] and info["pooled_shape"] == [64] and info["text_family"] == "sdxl"
    assert not np.load(sdxl_latents / EMPTY_TEXT_FILE).any() and not np.load(sdxl_latents / EMPTY_POOLED_FILE).any()
    load(train_args(tmp_path, sdxl_pipeline, str(sdxl_latents), name="l", **{
        "dataset.type": "latents", "dataset.params.resolution": 32, "dataset.params.text_embeddings": "true"}))
    t = Trainer(load(train_args(tmp_path, sdxl_pipeline, shapes_shards, **{"dataset.params.resolution": 32})),
                distributed.setup("cpu"))
    t.setup()
    tokens = t.family.tokenizers

    def first(path, **params):
        cfg = make_cfg(str(path), resolution=32, **params)
        return next(iter(build_train_loader(cfg, tokenizer=tokens, rank=0, world_size=1, seed=3)))

    image = first(shapes_shards)
    shard = first(sdxl_latents, type="latents", latent_sampling="mean", text_embeddings=True)
    assert shard["keys"] == image["keys"]
    for k in ("input_ids", "input_ids_2", "original_size", "crop_top_left", "target_size"):
        assert torch.equal(shard[k], image[k]), k
    assert image["original_size"].tolist()[0] == [64, 64] and image["target_size"].tolist()[0] == [32, 32]
    g = torch.Generator().manual_seed(0)
    fixed = {"noise": torch.randn(shard["latents"].shape, generator=g), "timesteps": torch.randint(0, 1000, (4,), generator=g)}
    sizes = {k: image[k] for k in ("original_size", "crop_top_left", "target_size")}
    ids = {"input_ids": image["input_ids"], "input_ids_2": image["input_ids_2"]}

    def step(batch):
        t.optimizer.zero_grad(set_to_none=True)
        loss, *_ = t.micro_step(batch, sync=True)
        return loss, {n: p.grad.clone() for n, p in t.net.named_parameters() if p.grad is not None}

    with torch.no_grad():
        online_latents = t.family.encode(unit_range(image["pixel_values"]), mean=True)
    loss_online, grads_online = step({"latents": online_latents, **ids, **sizes, **fixed})
    stored = {"encoder_hidden_states": shard["encoder_hidden_states"], "pooled_text_embeds": shard["pooled_text_embeds"]}
    for extra in ({}, stored):
        loss, grads = step({"latents": shard["latents"], **ids, **sizes, **fixed, **extra})
        torch.testing.assert_close(loss, loss_online, rtol=1e-5, atol=1e-6)
        for n in grads_online:
            torch.testing.assert_close(grads[n], grads_online[n], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_sdxl_trains_both_text_encoders_and_exports_them(sdxl_pipeline, shapes_shards, tmp_path):
    """model.text_encoder.train: both encoders learn (fp32, under bf16 autocast, with loader workers) and are
    exported; the first encoder's last layer, which SDXL's conditioning never reads, stays as it was."""
    from diffusers import StableDiffusionXLPipeline

    cfg = load(train_args(tmp_path, sdxl_pipeline, shapes_shards, name="te", model__mixed_precision="bf16",
                          system__workers=1, experiment__num_examples_to_see=8, experiment__save_every=2,
                          model__text_encoder__train="true", optimizer__params__learning_rate=1e-2,
                          dataset__params__resolution=32))
    assert main(cfg)["step"] == 2
    run = tmp_path / "runs" / "te"
    before = StableDiffusionXLPipeline.from_pretrained(sdxl_pipeline)
    after = StableDiffusionXLPipeline.from_pretrained(run / "current_pipeline")
    for name in ("text_encoder", "text_encoder_2"):
        a, b = getattr(before, name).state_dict(), getattr(after, name).state_dict()
        changed = {k for k in a if not torch.equal(a[k], b[k])}
        assert changed, f"{name} did not train"
        if name == "text_encoder":
            assert not {k for k in changed if ".layers.1." in k or "final_layer_norm" in k}, "frozen last layer moved"
            assert any(".layers.0." in k for k in changed)
    folder = run / "checkpoints" / "step_00000002"
    assert (folder / "text_encoder.pt").is_file() and (folder / "text_encoder_2.pt").is_file()  # resumable
