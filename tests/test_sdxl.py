"""SDXL as a family: its conditioning equals StableDiffusionXLPipeline's, its size conditioning, its refusals,
exact resume on two ranks under FSDP (with the memory plan), and both text encoders trained and exported. What
every family does (a bf16 run with loader workers that validates, exports and resumes; LoRA; 2 ranks under DDP;
latent shards): test_family_conformance.py."""

import json

import pytest
import torch
from conftest import train_args
from test_resume import N, args_for, assert_same, final_state, finish, kill_after_checkpoint, launch, losses

from sd_training.checkpoint import complete_steps
from sd_training.config import ConfigError
from sd_training.configure import load
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
