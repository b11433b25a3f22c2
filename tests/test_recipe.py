"""Recipe options, each checked for what it does: optimizers, schedules, EMA, precision, init, NaN guard."""

import json
from pathlib import Path

import pytest
import torch
from conftest import train_args
from helpers import ready_trainer

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.config.schema import LRSchedulerConfig, LRSchedulerParams, OptimizerConfig, OptimizerParams
from sd_training.ema import EMA, decay_from_strength
from sd_training.loop import NonFiniteLossError, Trainer
from sd_training.loop import main as train
from sd_training.optim import build_optimizer, lr_factor, lr_scale, param_groups

# In-process training: one intra-op thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")
# The runs here: no run report (rank 0 redraws its plots at every export, ~1 CPU-s each; test_report checks it)
# and, where what is checked does not depend on the image size (learning-rate values, what is exported and
# where, a fixed validation loss, the autoencoder stage's outputs), 32 px: a quarter of the pixels to encode.
SMALL = {"dataset.params.resolution": 32}


def make_trainer(tmp_path, pipeline, shards, name="r", **overrides) -> Trainer:
    cfg = load(train_args(tmp_path, pipeline, shards, name=name, **overrides))
    return ready_trainer(cfg)


def fixed_batch(t: Trainer, n=4, nan=False):
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(n, 4, 8, 8, generator=g)
    if nan:
        latents[0, 0, 0, 0] = float("nan")
    ids = t.models.tokenizer(["a red circle"] * n, padding="max_length", max_length=77, return_tensors="pt").input_ids
    return {"latents": latents, "input_ids": ids}


# ---------------------------------------------------------------- optimizers and schedules


def test_param_groups_exclude_norms_and_biases_from_weight_decay():
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(2, 8), torch.nn.Linear(8, 4))
    decay, no_decay = param_groups(m, 0.1, True)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(m[0].weight), id(m[2].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(m[0].bias), id(m[1].weight), id(m[1].bias), id(m[2].bias)}
    (only,) = param_groups(m, 0.1, False)
    assert len(only["params"]) == 6


@pytest.mark.parametrize("name, cls", [("adamw", "AdamW"), ("adafactor", "Adafactor"), ("sgd", "SGD")])
def test_optimizers_build_and_step(name, cls):
    m = torch.nn.Linear(4, 2)
    cfg = OptimizerConfig(name=name, params=OptimizerParams(momentum=0.9 if name == "sgd" else 0.0))
    opt = build_optimizer(param_groups(m, 0.01, True), cfg, torch.device("cpu"), 1e-2)
    assert type(opt).__name__ == cls
    before = m.weight.detach().clone()
    m(torch.ones(3, 4)).sum().backward()
    opt.step()
    assert not torch.equal(before, m.weight)


def test_adamw_kernel_choice():
    groups = lambda: param_groups(torch.nn.Linear(2, 2), 0.0, True)  # noqa: E731
    assert build_optimizer(groups(), OptimizerConfig(), torch.device("cpu"), 1e-3).defaults["foreach"] is False
    foreach = OptimizerConfig(implementation="foreach")
    assert build_optimizer(groups(), foreach, torch.device("cpu"), 1e-3).defaults["foreach"] is True


def test_adamw8bit_without_bitsandbytes_says_what_to_install():
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed")
    with pytest.raises(ConfigError, match="pip install bitsandbytes"):
        build_optimizer([{"params": [torch.nn.Parameter(torch.zeros(1))]}], OptimizerConfig(name="adamw8bit"),
                        torch.device("cpu"), 1e-3)


def test_optimizer_key_that_does_not_apply_is_rejected(tmp_path):
    base = ["experiment.name=x", "experiment.num_examples_to_see=8", "model.pretrained=/p", "dataset.params.path=x.tar"]
    with pytest.raises(ConfigError, match="optimizer.params.beta2.*sgd"):
        load(base + ["optimizer.name=sgd", "optimizer.params.beta2=0.9"])
    with pytest.raises(ConfigError, match="warmup_length=0"):
        load(base + ["lr_scheduler.scheduler=Constant"])


def test_scale_lr_rule():
    assert lr_scale(OptimizerConfig(scale_lr=True), 64) == pytest.approx(64 ** 0.55)
    assert lr_scale(OptimizerConfig(), 64) == 1.0


def test_linear_schedule_and_constant():
    lin = LRSchedulerConfig(scheduler="LinearWithWarmup", params=LRSchedulerParams(learning_rate=1.0, warmup_length=2, min_lr_ratio=0.2))
    assert [round(lr_factor(s, lin, 6), 6) for s in range(6)] == [0.5, 1.0, 0.8, 0.6, 0.4, 0.2]
    const = LRSchedulerConfig(scheduler="Constant", params=LRSchedulerParams(learning_rate=1.0, warmup_length=0))
    assert {lr_factor(s, const, 6) for s in range(6)} == {1.0}


@pytest.mark.slow
def test_schedule_ends_at_min_lr_with_accumulation(tmp_path, tiny_pipeline, shapes_shards):
    """The LR of the last optimizer step is the schedule's last value, with gradient accumulation > 1."""
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, name="sched", **{
        "system.gradient_accumulation": 2, "system.batch_size": 2, "experiment.num_examples_to_see": 40,
        "lr_scheduler.scheduler": "CosineWithWarmup", "lr_scheduler.params.warmup_length": 2,
        "lr_scheduler.params.min_lr_ratio": 0.1, "optimizer.scale_lr": "true", "experiment.sample_per_prompt": 0,
        **SMALL}))
    out = train(cfg)
    assert out["step"] == 10  # 40 images / (2 x 2) optimizer steps, not 20 micro-steps
    rows = [json.loads(l) for l in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}
    peak = 1e-3 * 4 ** 0.55  # scale_lr with global batch 4
    # Logged after step s: the LR the next step would use; after the last step it is the floor.
    assert lrs[1] == pytest.approx(peak * 1.0)
    assert lrs[10] == pytest.approx(peak * 0.1)


# ---------------------------------------------------------------- EMA


def test_ema_decay_warmup_interval_and_start_step():
    m = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(0.0)
    ema = EMA(m, decay=0.5, update_every=2, start_step=2)
    assert torch.equal(ema.shadow.weight, m.weight)  # an exact copy at the start
    with torch.no_grad():
        m.weight.fill_(1.0)
    ema.update(m, step=1)  # not due (every 2 steps)
    assert ema.shadow.weight.sum() == 0
    ema.update(m, step=2)  # due, but within start_step: copies
    assert torch.equal(ema.shadow.weight, m.weight) and ema.num_updates == 0
    with torch.no_grad():
        m.weight.fill_(3.0)
    ema.update(m, step=4)  # 0.5 * 1 + 0.5 * 3
    assert torch.allclose(ema.shadow.weight, torch.full_like(m.weight, 2.0))
    w = EMA(m, decay=0.999, warmup=True)
    assert w.current_decay() == pytest.approx(1 / 10)


def test_ema_strength_target_and_cpu_device():
    d = decay_from_strength(0.1, total_steps=1000, update_every=10)
    assert d ** 100 == pytest.approx(0.1)
    ema = EMA(torch.nn.Linear(2, 2), 0.9, device=torch.device("cpu"))
    assert next(ema.shadow.parameters()).device.type == "cpu"


@pytest.mark.slow
def test_ema_exported_and_sampled_separately(tmp_path, tiny_pipeline, shapes_shards):
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, name="ema", **{
        "model.use_ema": "true", "model.ema.decay": 0.5, "model.ema.device": "cpu",
        "experiment.sample_from": "both", "experiment.num_examples_to_see": 12, **SMALL}))
    run = Path(train(cfg)["run_dir"])
    from diffusers import UNet2DConditionModel

    raw = UNet2DConditionModel.from_pretrained(run / "current_pipeline" / "unet")
    ema = UNet2DConditionModel.from_pretrained(run / "current_pipeline_ema" / "unet")
    assert any(not torch.equal(a, b) for a, b in zip(raw.parameters(), ema.parameters()))
    assert (run / "samples" / "step_00000003.png").exists() and (run / "samples" / "step_00000003_raw.png").exists()


# ---------------------------------------------------------------- precision, attention, compile


def test_vae_fp16_overflow_falls_back_to_fp32(tmp_path, tiny_pipeline, shapes_shards, caplog):
    t = make_trainer(tmp_path, tiny_pipeline, shapes_shards, **{"model.vae.dtype": "fp16"})
    assert t.models.vae.dtype == torch.float16
    pixels = torch.full((1, 3, 64, 64), 6.0e4)  # overflows fp16 activations
    latents = t.family.encode(pixels)
    assert t.models.vae.dtype == torch.float32 and "keeping the VAE in fp32" in caplog.text
    assert latents.dtype == torch.float32


def test_vae_dtype_auto_follows_bf16(tmp_path, tiny_pipeline, shapes_shards):
    t = make_trainer(tmp_path, tiny_pipeline, shapes_shards, **{"model.mixed_precision": "bf16"})
    assert t.models.vae.dtype == torch.bfloat16
    loss, *_ = t.micro_step(fixed_batch(t), sync=True)
    assert torch.isfinite(loss)


def test_sliced_attention_and_channels_last(tmp_path, tiny_pipeline, shapes_shards):
    t = make_trainer(tmp_path, tiny_pipeline, shapes_shards, **{"model.attention": "sliced", "model.channels_last": "true"})
    procs = {type(p).__name__ for p in t.net.attn_processors.values()}
    assert procs == {"SlicedAttnProcessor"}
    conv = t.net.conv_in.weight
    assert conv.is_contiguous(memory_format=torch.channels_last)
    loss, *_ = t.micro_step(fixed_batch(t), sync=True)
    assert torch.isfinite(loss)


def test_fp16_uses_a_grad_scaler(tmp_path, tiny_pipeline, shapes_shards):
    t = make_trainer(tmp_path, tiny_pipeline, shapes_shards, **{"model.mixed_precision": "fp16"})
    assert t.scaler.is_enabled()
    assert "grad_scaler" in t.checkpoints.plain_objects()


def test_compile_wrapper_never_leaks_into_saved_keys(tmp_path, tiny_pipeline, shapes_shards, monkeypatch):
    # The eager backend exercises the wrapper without minutes of compilation on CPU.
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real(m, backend="eager"))
    t = make_trainer(tmp_path, tiny_pipeline, shapes_shards, **{"model.compile": "true"})
    assert type(t.model).__name__ == "OptimizedModule"
    t.micro_step(fixed_batch(t), sync=True)
    t.optimizer_step()
    assert not any("_orig_mod" in k for k in t.checkpoints.plain_objects()["unet"].state_dict())


# ---------------------------------------------------------------- init modes and NaN guard


@pytest.mark.slow
def test_stage_two_init_from_run_dir(tmp_path, tiny_pipeline, shapes_shards):
    first = train(load(train_args(tmp_path, tiny_pipeline, shapes_shards, name="stage1",
                                  **{"model.use_ema": "true", **SMALL})))
    t = make_trainer(tmp_path, tiny_pipeline, shapes_shards, name="stage2", **{"model.init_from": first["run_dir"]})
    from sd_training.checkpoint import Checkpointer

    shared, _, _ = Checkpointer.load(Checkpointer(Path(first["run_dir"]) / "checkpoints").latest(), 0)
    for k, v in t.net.state_dict().items():
        assert torch.equal(v, shared["ema"]["shadow"][k]), k  # init_weights=ema by default
    assert t.state.step == 0  # a new run: fresh optimizer and schedule
    t2 = make_trainer(tmp_path, tiny_pipeline, shapes_shards, name="stage2b", **{
        "model.init_from": str(Path(first["run_dir"]) / "current_pipeline"), "model.init_weights": "raw"})
    for k, v in t2.net.state_dict().items():
        assert torch.equal(v, shared["unet"][k]), k


@pytest.mark.parametrize("implementation", ["for_loop", "fused"])
def test_nonfinite_steps_are_skipped_then_the_run_saves_and_stops(tmp_path, tiny_pipeline, shapes_shards,
                                                                  implementation):
    """The host-side skip (per-tensor AdamW) and the device-side one (fused AdamW gets the flag as its
    found_inf, no host sync) leave the weights and the optimizer state untouched alike."""
    t = make_trainer(tmp_path, tiny_pipeline, shapes_shards, name="nan", **{
        "experiment.max_nonfinite_steps": 2, "optimizer.implementation": implementation})
    assert t.device_side_skip == (implementation == "fused")
    t.micro_step(fixed_batch(t), sync=True)
    t.optimizer_step()  # one good step first, so the optimizer has state to protect
    before = {k: v.clone() for k, v in t.net.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in t.optimizer.state.values()]
    t.micro_step(fixed_batch(t, nan=True), sync=True)
    t.optimizer_step()
    assert int(t.guards.nonfinite_streak) == 1 and int(t.guards.nonfinite_total) == 1
    assert all(torch.equal(v, t.net.state_dict()[k]) for k, v in before.items())  # no update
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, t.optimizer.state.values()))
    t.micro_step(fixed_batch(t), sync=True)
    t.optimizer_step()
    assert int(t.guards.nonfinite_streak) == 0  # a good step resets the streak
    t._check_nonfinite(None)  # read at log time: counted once
    assert t.state.nonfinite_steps == 1 and int(t.guards.nonfinite_total) == 0
    # Through the loop: every batch poisoned -> two skipped steps, a checkpoint, a clear error.
    class PoisonedLoader(list):  # the loop needs iteration, state_dict and stats
        def state_dict(self):
            return {}

        def stats(self):
            return {}

    t.loader = PoisonedLoader([fixed_batch(t, nan=True)] * 100)
    t.trackers = __import__("sd_training.outputs.trackers", fromlist=["x"]).Trackers([])
    from sd_training.run.preemption import StopFlag

    with pytest.raises(NonFiniteLossError, match="learning_rate.*mixed_precision=bf16"):
        t._loop(StopFlag())
    assert (t.run_dir.checkpoints / "step_00000002" / "COMPLETE").exists()  # two skipped loop steps


# ---------------------------------------------------------------- objective and conditioning through the loop


@pytest.mark.slow
def test_text_encoder_training_and_v_prediction_reach_the_export(tmp_path, tiny_pipeline, shapes_shards):
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, name="te", **{
        "model.text_encoder.train": "true", "model.text_encoder.learning_rate": 5e-4,
        "objective.prediction_type": "v_prediction", "objective.zero_terminal_snr": "true",
        "objective.loss_weighting": "min_snr", "experiment.num_examples_to_see": 12, **SMALL}))
    run = Path(train(cfg)["run_dir"])
    from diffusers import StableDiffusionPipeline
    from transformers import CLIPTextModel

    pipe = StableDiffusionPipeline.from_pretrained(run / "current_pipeline")
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.scheduler.config.rescale_betas_zero_snr and pipe.scheduler.config.timestep_spacing == "trailing"
    before = CLIPTextModel.from_pretrained(tiny_pipeline / "text_encoder")
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), pipe.text_encoder.parameters()))
    from sd_training.checkpoint import Checkpointer

    shared, _, _ = Checkpointer.load(Checkpointer(run / "checkpoints").latest(), 0)
    assert "text_encoder" in shared
    lrs = {g["lr"] for g in shared["optimizer"]["param_groups"]}
    assert len(lrs) == 2  # the text encoder's own learning rate


# ---------------------------------------------------------------- validation and the autoencoder stage


@pytest.mark.slow
def test_validation_loss_is_fixed_and_logged_from_step_zero(tmp_path, tiny_pipeline, shapes_shards):
    args = train_args(tmp_path, tiny_pipeline, shapes_shards, name="val", **{
        "validation.path": shapes_shards, "validation.num_batches": 2, "validation.every": 2,
        "experiment.sample_per_prompt": 0, "optimizer.params.learning_rate": 0.0, **SMALL})
    run = Path(train(load(args))["run_dir"])
    vals = [(r["step"], r["val/loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val/loss" in r]
    assert [s for s, _ in vals] == [0, 2, 4, 6, 8]
    # Learning rate 0: the weights never change, so a fixed-noise validation gives the same number every time.
    assert len({round(v, 7) for _, v in vals}) == 1


@pytest.mark.slow
def test_autoencoder_stage_trains_exports_and_measures_scale(tmp_path, tiny_pipeline, shapes_shards):
    args = train_args(tmp_path, tiny_pipeline, shapes_shards, name="vae", **{
        "model.train_target": "vae", "experiment.num_examples_to_see": 40, "experiment.save_every": 5,
        "validation.path": shapes_shards, "validation.num_batches": 1, "model.use_ema": "true", **SMALL})
    out = train(load(args))
    run = Path(out["run_dir"])
    from diffusers import AutoencoderKL, StableDiffusionPipeline

    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("vae/rec" in r and "vae/kl" in r for r in rows)
    scales = [r["vae/scaling_factor"] for r in rows if "vae/scaling_factor" in r]
    trained = AutoencoderKL.from_pretrained(run / "current_pipeline" / "vae")
    # Measured per exported weights (raw, then EMA) and recorded in each exported config.
    assert trained.config.scaling_factor == pytest.approx(scales[-2])
    before = AutoencoderKL.from_pretrained(tiny_pipeline / "vae")
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), trained.parameters()))
    pipe = StableDiffusionPipeline.from_pretrained(run / "current_pipeline_ema")  # a whole pipeline, EMA VAE
    assert pipe.vae.config.scaling_factor > 0
    assert (run / "samples" / "step_00000010.png").exists()  # reconstruction grid
    with pytest.raises(ConfigError, match="fp16"):
        load(args + ["model.mixed_precision=fp16"])


@pytest.mark.slow
@pytest.mark.distributed
def test_schedule_ends_at_min_lr_with_accumulation_on_two_ranks(tmp_path, tiny_pipeline, shapes_shards):
    """2 ranks x batch 1 x accumulation 2: 40 images are 10 optimizer steps, and the LR of the last step
    is the schedule's floor (a schedule counted in micro-steps or per rank would end elsewhere)."""
    from test_resume import finish, launch

    args = train_args(tmp_path, tiny_pipeline, shapes_shards, name="sched2", **{
        "system.gradient_accumulation": 2, "system.batch_size": 1, "experiment.num_examples_to_see": 40,
        "lr_scheduler.scheduler": "CosineWithWarmup", "lr_scheduler.params.warmup_length": 2,
        "lr_scheduler.params.min_lr_ratio": 0.1, "experiment.sample_per_prompt": 0, **SMALL})
    finish(launch(tmp_path, args, nproc=2))
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / "runs" / "sched2" / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    assert max(lrs) == 10
    assert lrs[1] == pytest.approx(1e-3) and lrs[10] == pytest.approx(1e-4)
