"""Prodigy, Lion, schedule-free AdamW and CAME (pytorch-optimizer) as ``optimizer.name``.

- Config: a misspelt name is refused with the closest one; a key the chosen optimizer does not read is
  refused naming it; what a mode cannot support is refused with the reason (Prodigy at an AdamW-like LR,
  Prodigy and CAME under fsdp, schedule-free with a decaying schedule, Prodigy and schedule-free in the
  backward pass, Prodigy with per-group LRs, a missing package).
- In one process under bf16 autocast: each trains, its state (Prodigy's per-group d, schedule-free's z)
  survives a weights-only save and load; Lion and CAME in the backward pass equal their ordinary step bit
  for bit; Lion and schedule-free step on FSDP2's CPU-offloaded shards as on the plain module; fp16 loss
  scaling steps Prodigy; the memory plan's bytes per parameter are what each optimizer's state holds.
- Schedule-free: validation, samples and exports see the evaluation weights (x), not the training ones
  (y), and training goes on from y bit for bit.
- On 2 gloo ranks (one torchrun for every case, a loader worker, bf16): a run stopped after a checkpoint
  and resumed ends bit-identical to one never stopped (ddp: all four; fsdp: Lion and schedule-free); the
  checkpoints load under the other strategy on 2 ranks and in one process (elastic), state for state.

    python tests/test_optimizers.py OUT_DIR key=value ...     (the 2-rank worker, under torchrun)
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from conftest import train_args
from helpers import max_diff, ready_trainer

from sd_training import distributed
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.loop import Trainer

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.usefixtures("one_thread")
NEW = ("prodigy", "lion", "adamw_schedulefree", "came")
# What users of each set (kohya / SimpleTuner / OneTrainer recipes, scaled to the tiny model).
SETTINGS = {
    "prodigy": {"optimizer.params.learning_rate": 1.0, "optimizer.params.use_bias_correction": "true",
                "optimizer.params.safeguard_warmup": "true", "optimizer.params.d_coef": 2.0},
    "lion": {"optimizer.params.learning_rate": 3e-4, "optimizer.params.beta2": 0.99,
             "optimizer.params.weight_decay": 0.1},
    "adamw_schedulefree": {"optimizer.params.learning_rate": 2e-3},
    "came": {"optimizer.params.learning_rate": 2e-4, "optimizer.params.beta3": 0.9999},
}
QUIET = {"experiment.sample_per_prompt": 0}


def args(tmp_path, pipeline, shards, name, optimizer, **kw):
    return train_args(tmp_path, pipeline, shards, name=name, **{"optimizer.name": optimizer, **SETTINGS[optimizer],
                                                                 **QUIET, **kw})


def trainer(tmp_path, pipeline, shards, name, optimizer, **kw) -> Trainer:
    return ready_trainer(load(args(tmp_path, pipeline, shards, name, optimizer, **kw)))


def steps(t: Trainer, n: int, batch: int = 2, seed: int = 1234) -> None:
    """``n`` optimizer steps of the real micro-step and step on fixed latents, noise and timesteps."""
    g = torch.Generator().manual_seed(seed)
    tok = t.family.tokenizers
    ids = tok([f"a shape number {i}" for i in range(batch)], padding="max_length", max_length=tok.model_max_length,
              truncation=True, return_tensors="pt").input_ids
    channels = int(t.models.vae.config.latent_channels)
    for _ in range(n):
        t.micro_step({"input_ids": ids, "latents": torch.randn(batch, channels, 8, 8, generator=g),
                       "noise": torch.randn(batch, channels, 8, 8, generator=g),
                       "timesteps": torch.randint(0, 1000, (batch,), generator=g)}, sync=True)
        t.optimizer_step()
        t.state.step += 1


def weights(module: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------------------------------- config
def test_config_refuses_what_each_optimizer_cannot_do(tmp_path, tiny_pipeline, shapes_shards):
    def refused(**kw) -> str:
        with pytest.raises(ConfigError) as e:
            load(train_args(tmp_path, tiny_pipeline, shapes_shards, **kw))
        return str(e.value)

    # A misspelt name: refused with the closest one.
    for typo, meant in [("prodigi", "prodigy"), ("Lion", "lion"), ("schedulefree", "adamw_schedulefree"), ("cam", "came")]:
        assert f"did you mean '{meant}'" in refused(**{"optimizer.name": typo})
    # A key the chosen optimizer does not read: refused naming it (and who reads it), never ignored.
    for name, key, value in [("lion", "epsilon", 1e-6), ("came", "epsilon", 1e-6), ("adamw", "d_coef", 2.0),
                             ("sgd", "beta3", 0.99), ("adamw_schedulefree", "safeguard_warmup", "true"),
                             ("adafactor", "use_bias_correction", "true"), ("prodigy", "momentum", 0.9)]:
        message = refused(**{"optimizer.name": name, **SETTINGS.get(name, {}), f"optimizer.params.{key}": value})
        assert f"'optimizer.params.{key}' does not apply to optimizer.name={name}" in message, message
    assert "read by prodigy)" in refused(**{"optimizer.params.d_coef": 2.0})
    # Prodigy at an AdamW learning rate trains ~10^4 times slower: refused with the value to set.
    message = refused(**{"optimizer.name": "prodigy", "optimizer.params.learning_rate": 1e-4})
    assert "optimizer.params.learning_rate=1.0" in message and "10,000x slower" in message, message
    assert "'optimizer.scale_lr'" in refused(**{"optimizer.name": "prodigy", **SETTINGS["prodigy"],
                                                "optimizer.scale_lr": "true"})
    for name in ("prodigy", "came"):
        message = refused(**{"optimizer.name": name, **SETTINGS[name], "distributed.strategy": "fsdp"})
        assert f"optimizer.name={name} cannot train under distributed.strategy=fsdp" in message, message
    message = refused(**{"optimizer.name": "adamw_schedulefree", "lr_scheduler.scheduler": "CosineWithWarmup"})
    assert "'lr_scheduler.scheduler=CosineWithWarmup'" in message and "ConstantWithWarmup" in message, message
    for name in ("prodigy", "adamw_schedulefree"):
        message = refused(**{"optimizer.name": name, **SETTINGS[name], "optimizer.in_backward": "true",
                             "optimizer.params.max_grad_norm": "null"})
        assert f"'optimizer.in_backward' cannot work with optimizer.name={name}" in message, message
    # Accepted as users set them; under fsdp Lion and schedule-free, in the backward pass Lion and CAME.
    for name in NEW:
        load(args(tmp_path, tiny_pipeline, shapes_shards, "ok", name))
    for name in ("lion", "adamw_schedulefree"):
        load(args(tmp_path, tiny_pipeline, shapes_shards, "ok", name, **{"distributed.strategy": "fsdp"}))
    for name in ("lion", "came"):
        load(args(tmp_path, tiny_pipeline, shapes_shards, "ok", name, **{"optimizer.in_backward": "true",
                                                                          "optimizer.params.max_grad_norm": "null"}))


def test_build_refuses_per_group_lrs_for_prodigy_and_a_missing_package(tmp_path, tiny_pipeline, shapes_shards,
                                                                         monkeypatch):
    from sd_training.optim import build_optimizer

    cfg = load(args(tmp_path, tiny_pipeline, shapes_shards, "r", "prodigy")).optimizer
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 1.0},
              {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.5}]
    with pytest.raises(ConfigError, match="optimizer.name=prodigy steps every parameter group with one learning rate"):
        build_optimizer(groups, cfg, torch.device("cpu"), 1.0)
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)  # `import pytorch_optimizer` raises ImportError
    for name in NEW:
        cfg = load(args(tmp_path, tiny_pipeline, shapes_shards, "r", name)).optimizer
        with pytest.raises(ConfigError, match=f"optimizer.name={name} needs pytorch-optimizer"):
            build_optimizer(groups[:1], cfg, torch.device("cpu"), 1.0)


# ---------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("name", NEW)
def test_each_trains_under_bf16_and_its_state_survives_a_weights_only_load(tmp_path, tiny_pipeline, shapes_shards,
                                                                          name):
    """bf16 autocast, the LR warming up. Lion and CAME (per-parameter state, no sum over the whole net): in
    the backward pass each parameter's update is the ordinary step's, bit for bit, with the same state."""
    import pytorch_optimizer
    from test_resume import assert_same

    from sd_training.optim import PACKAGE_OPTIMIZERS

    kw = {"model.mixed_precision": "bf16", "optimizer.params.max_grad_norm": "null"}
    t = trainer(tmp_path, tiny_pipeline, shapes_shards, name, name, **kw)
    assert type(t.optimizer) is getattr(pytorch_optimizer, PACKAGE_OPTIMIZERS[name])
    init = weights(t.net)
    steps(t, 2)
    assert max_diff(weights(t.net), init) > 1e-7  # it trained (Prodigy's first steps are small: d starts at 1e-6)
    group, state = t.optimizer.param_groups[0], t.optimizer.state[t.optimizer.param_groups[0]["params"][0]]
    expected = {"prodigy": {"s", "p0", "exp_avg", "exp_avg_sq"}, "lion": {"exp_avg"},
                "adamw_schedulefree": {"z", "exp_avg_sq"}, "came": {"exp_avg", "exp_avg_sq_row", "exp_avg_sq_col"}}
    assert expected[name] <= set(state), sorted(state)
    if name == "prodigy":  # its step-size estimate lives in every group (d, d_max, d_hat, d_numerator)
        assert group["d_coef"] == 2.0 and group["bias_correction"] and group["safeguard_warmup"]
        assert group["d_hat"] > 0 and float(group["d_numerator"]) > 0
    if name == "adamw_schedulefree":  # its averaging weight so far, the LR schedule's warmup (not its own)
        assert group["train_mode"] and group["weight_sum"] > 0 and group["warmup_steps"] == 0
    # What a checkpoint holds, through a weights-only load (as checkpoints are read), into a fresh optimizer.
    buf = io.BytesIO()
    torch.save(t.optimizer.state_dict(), buf)
    buf.seek(0)
    again = type(t.optimizer)(t.optimizer.param_groups)
    again.load_state_dict(torch.load(buf, weights_only=True))
    assert_same(t.optimizer.state_dict(), again.state_dict(), "optimizer")
    t.trackers.close()
    if name in ("lion", "came"):
        b = trainer(tmp_path, tiny_pipeline, shapes_shards, "in_backward", name, **kw, **{"optimizer.in_backward": "true"})
        assert b.optimizer.in_backward is not None
        steps(b, 2)
        assert max_diff(weights(t.net), weights(b.net)) == 0.0
        assert_same(t.optimizer.state_dict(), b.optimizer.state_dict(), "optimizer")
        b.trackers.close()


def test_lion_and_schedule_free_step_on_cpu_offloaded_fsdp_shards(tmp_path, tiny_pipeline, shapes_shards):
    """FSDP2 with its CPU offload, in a process group of one: the optimizer steps on the offloaded DTensor
    shards and trains as the plain module does, within fp32 summation-order noise (as fsdp against ddp;
    schedule-free's Adam denominator at epsilon 1e-4, as test_memory_modes does, not to magnify it)."""
    for name in ("lion", "adamw_schedulefree"):
        kw = {"optimizer.params.max_grad_norm": "null", "lr_scheduler.params.warmup_length": 0,
              **({"optimizer.params.epsilon": 1e-4} if name == "adamw_schedulefree" else {})}
        plain = trainer(tmp_path, tiny_pipeline, shapes_shards, f"{name}_plain", name, **kw)
        steps(plain, 2)
        want = weights(plain.net)
        plain.trackers.close()
        try:
            t = Trainer(load(args(tmp_path, tiny_pipeline, shapes_shards, f"{name}_offload", name, **kw, **{
                "distributed.strategy": "fsdp", "distributed.fsdp_cpu_offload": "true"})),
                distributed.setup("cpu", one_rank_group=True))
            t.setup()
            assert t.strategy.plan_name == "fsdp_offload" and type(next(t.net.parameters())).__name__ == "DTensor"
            steps(t, 2)
            got = {k: v.detach().clone() for k, v in t.strategy.full_state_dict(t.net).items()}
            t.trackers.close()
        finally:
            distributed.teardown()
        assert max_diff(want, got) < 1e-5, (name, max_diff(want, got))


def test_fp16_loss_scaling_steps_prodigy(tmp_path, tiny_pipeline, shapes_shards):
    """The gradient scaler unscales before the step (Prodigy's estimate sees the true gradients) and steps
    it like any optimizer."""
    t = trainer(tmp_path, tiny_pipeline, shapes_shards, "fp16", "prodigy", **{"model.mixed_precision": "fp16"})
    assert t.scaler.is_enabled()
    init = weights(t.net)
    steps(t, 2)
    group = t.optimizer.param_groups[0]
    assert max_diff(weights(t.net), init) > 1e-7 and 0 < group["d_hat"] < 1 and float(group["d_numerator"]) > 0
    t.trackers.close()


def test_memory_plan_counts_each_optimizers_state():
    """The plan's optimizer column is what the optimizer's state holds after a step (CAME: its factored rows
    and columns, and the full second moment of 1-d parameters, on top of the momentum: 11% here, less in a
    real net, whose matrices are wider)."""
    import pytorch_optimizer

    from sd_training.memory.plan import GIB, memory_plan
    from sd_training.optim import PACKAGE_OPTIMIZERS

    for name in NEW:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32))
        opt = getattr(pytorch_optimizer, PACKAGE_OPTIMIZERS[name])(net.parameters(), lr=1.0 if name == "prodigy" else 1e-3)
        net(torch.randn(2, 64)).square().mean().backward()
        opt.step()
        held = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)
        row = memory_plan(net, [], name, 1, False, False, 4, None, "block")[0]
        planned = row.optimizer * GIB
        assert planned <= held <= planned * (1.15 if name == "came" else 1.0), (name, planned, held)


def test_schedule_free_validates_samples_and_exports_its_evaluation_weights(tmp_path, tiny_pipeline, shapes_shards):
    """Compared with x = y + (1 - 1/beta1)(z - y), computed here from the optimizer's state: what the net
    holds in every forward of validation and sampling, and the exported UNet; they differ from the training
    weights y, which are back bit for bit afterwards (the step after an export is the step without one)."""
    from diffusers import UNet2DConditionModel

    from sd_training.optim import eval_weights

    t = trainer(tmp_path, tiny_pipeline, shapes_shards, "sf", "adamw_schedulefree",
                **{"model.mixed_precision": "bf16", "experiment.sample_per_prompt": 1, "system.batch_size": 2,
                   "validation.path": shapes_shards,
                   "validation.num_batches": 1})
    steps(t, 2)
    opt = t.optimizer
    beta1 = opt.param_groups[0]["betas"][0]
    names = {id(p): n for n, p in t.net.named_parameters()}
    train_y = weights(t.net)
    x = {names[id(p)]: p.detach().clone().lerp_(opt.state[p]["z"], 1.0 - 1.0 / beta1)
         for g in opt.param_groups for p in g["params"]}
    assert max_diff({k: train_y[k] for k in x}, x) > 1e-6  # the two weights differ
    seen = []
    probe = next(iter(x))

    def record(module, inputs):  # every forward of the net: validation's loss, each sampling step
        seen.append(dict(t.net.named_parameters())[probe].detach().clone())

    handle = t.net.register_forward_pre_hook(record)
    t.outputs.validate(2, t.model)
    n_validation = len(seen)
    t._export()
    handle.remove()
    assert n_validation >= 1 and len(seen) > n_validation  # validation and the sample grid ran the net
    assert all(torch.equal(s, x[probe]) for s in seen)
    exported = UNet2DConditionModel.from_pretrained(t.run_dir.root / "current_pipeline" / "unet").state_dict()
    for k, v in x.items():
        assert torch.equal(exported[k], v.to(exported[k].dtype)), k
    assert max_diff(weights(t.net), train_y) == 0.0 and all(g["train_mode"] for g in opt.param_groups)
    # The context manager nests (inside it, nothing more happens), and does nothing for other optimizers.
    with eval_weights(opt):
        with eval_weights(opt):
            assert torch.equal(dict(t.net.named_parameters())[probe], x[probe])
        assert not opt.param_groups[0]["train_mode"]
    assert max_diff(weights(t.net), train_y) == 0.0
    with eval_weights(torch.optim.SGD(t.net.parameters(), lr=1.0)):
        assert max_diff(weights(t.net), train_y) == 0.0
    t.trackers.close()


# ---------------------------------------------------------------------------------------------- two ranks
BATCH, STEPS = 2, 4  # per rank; checkpoints and exports every 2 steps
# (optimizer, strategy, precision): each run trains STEPS steps straight, then resumes from its checkpoint at
# step 2 (the later one moved aside, as a kill after step 2's checkpoint leaves it) and trains to STEPS again.
CASES = [("prodigy", "ddp", "no"), ("came", "ddp", "no"), ("lion", "fsdp", "no"), ("adamw_schedulefree", "ddp", "bf16"),
         ("adamw_schedulefree", "fsdp", "no")]
ELASTIC = [("lion", "fsdp", "ddp"), ("adamw_schedulefree", "ddp", "fsdp")]  # (optimizer, written by, loaded under)
ONE_PROCESS = [("prodigy", "ddp"), ("came", "ddp"), ("adamw_schedulefree", "fsdp")]  # loaded in one process


def run_args(tmp, pipeline, shards, optimizer, written_by, precision="no", strategy=None):
    return args(tmp, pipeline, shards, f"{optimizer}_{written_by}", optimizer, **{
        "experiment.num_examples_to_see": STEPS * BATCH * 2, "experiment.checkpoint_every": 2,
        "experiment.save_every": 2, "experiment.keep_last_checkpoints": 10, "system.batch_size": BATCH,
        "system.workers": 1, "model.mixed_precision": precision, "model.use_ema": "true", "model.ema.decay": 0.9,
        "distributed.strategy": strategy or written_by, "experiment.allow_config_change": "true",
        "experiment.export_weights": "raw",
        # 32 px: what is compared (bit-identical resumes, state for state) does not depend on the size; measured,
        # the one torchrun of every case took 111 CPU-s instead of 124 (bf16 convolutions are slow on a CPU).
        "dataset.params.resolution": 32})


def loaded_state(t: Trainer) -> dict:
    """The model state a Trainer's set-up loaded, as full tensors (collective under fsdp)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True) if t.strategy.sharded else StateDictOptions()
    names = {id(p): n for n, p in t.net.named_parameters()}
    return {"unet": get_model_state_dict(t.net, options=opts), "ema": get_model_state_dict(t.ema.shadow, options=opts),
            "optimizer": get_optimizer_state_dict(t.net, t.optimizer, options=opts),
            "names": [[names[id(p)] for p in g["params"]] for g in t.optimizer.param_groups],
            "plain_optimizer": None if t.strategy.sharded else t.optimizer.state_dict(),
            "ema_meta": t.ema.meta_state_dict(), "lr_scheduler": t.lr_scheduler.state_dict(),
            "grad_scaler": t.scaler.state_dict(), "step": t.state.step}


def worker(tmp: str, pipeline: str, shards: str) -> None:
    """Every case of CASES, then ELASTIC's loads, in one process group of 2 ranks."""
    import shutil

    tmp_path = Path(tmp)
    info = distributed.setup("cpu", "gloo")
    try:
        for optimizer, strategy, precision in CASES:
            argv = run_args(tmp_path, pipeline, shards, optimizer, strategy, precision)
            Trainer(load(argv), info).run()
            run = tmp_path / "runs" / f"{optimizer}_{strategy}"
            if info.is_main:  # what a kill right after step 2's checkpoint leaves (and the straight run's results)
                shutil.move(run / "checkpoints" / f"step_{STEPS:08d}", run / "straight_checkpoint")
                shutil.move(run / "current_pipeline", run / "straight_pipeline")
            distributed.barrier()
            assert Trainer(load(argv), info).run()["step"] == STEPS
        for optimizer, source, target in ELASTIC:
            t = Trainer(load(run_args(tmp_path, pipeline, shards, optimizer, source, strategy=target)), info)
            t.setup()
            state = loaded_state(t)
            if info.is_main:
                torch.save(state, tmp_path / f"{optimizer}_{source}_as_{target}.pt")
            distributed.barrier()
    finally:
        distributed.teardown()


def checkpoint_state(folder: Path) -> dict:
    """A checkpoint's model state and schedule as written: plain files, or the DCP shards as full tensors."""
    from sd_training.checkpoint import Checkpointer

    shared, _, train_state = Checkpointer.load(folder, 0)
    if (folder / "sharded").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(folder / "sharded", folder.parent / f"{folder.name}_full.pt")
        shared.update(torch.load(folder.parent / f"{folder.name}_full.pt", weights_only=False))
    return {**shared, "step": train_state["step"]}


@pytest.mark.slow
@pytest.mark.distributed
def test_on_two_ranks_a_resumed_run_is_bit_identical_and_checkpoints_load_elsewhere(tmp_path, tiny_pipeline,
                                                                                   shapes_shards):
    """One torchrun (2 gloo ranks, a loader worker each) for every case. Then each checkpoint in one process
    (no process group), and schedule-free's exports: its evaluation weights, from the state loaded there."""
    from diffusers import UNet2DConditionModel
    from test_reshard import launch, saved_state
    from test_resume import assert_same

    from sd_training.optim import eval_weights

    launch([str(Path(__file__).resolve()), str(tmp_path), str(tiny_pipeline), shapes_shards], 2, tmp_path)
    runs = tmp_path / "runs"
    for optimizer, strategy, _ in CASES:
        run = runs / f"{optimizer}_{strategy}"
        straight, resumed = checkpoint_state(run / "straight_checkpoint"), checkpoint_state(
            run / "checkpoints" / f"step_{STEPS:08d}")
        assert straight["step"] == resumed["step"] == STEPS
        for key in ("unet", "optimizer", "ema", "lr_scheduler"):
            assert_same(straight[key], resumed[key], f"{optimizer}_{strategy}.{key}")
        a = UNet2DConditionModel.from_pretrained(run / "straight_pipeline" / "unet").state_dict()
        b = UNet2DConditionModel.from_pretrained(run / "current_pipeline" / "unet").state_dict()
        assert_same(a, b, f"{optimizer}_{strategy} export")
    for optimizer, source, target in ELASTIC:  # ddp -> fsdp and fsdp -> ddp on 2 ranks, state for state
        loaded = torch.load(tmp_path / f"{optimizer}_{source}_as_{target}.pt", weights_only=False)
        saved = saved_state(runs / f"{optimizer}_{source}" / "checkpoints" / f"step_{STEPS:08d}", loaded["names"])
        assert loaded["step"] == STEPS and saved["optimizer"]["state"]
        for key in ("unet", "ema", "optimizer", "lr_scheduler"):
            assert_same(saved[key], loaded[key], f"{optimizer} {source}->{target}.{key}")
    for optimizer, source in ONE_PROCESS:  # 2 ranks -> one process
        run = runs / f"{optimizer}_{source}"
        t = ready_trainer(load(run_args(tmp_path, tiny_pipeline, shapes_shards, optimizer, source, strategy="ddp")))
        assert t.state.step == STEPS and not torch.distributed.is_initialized()
        loaded = loaded_state(t)
        saved = saved_state(run / "checkpoints" / f"step_{STEPS:08d}", loaded["names"])
        for key in ("unet", "ema", "optimizer", "lr_scheduler"):
            assert_same(saved[key], loaded[key], f"{optimizer} {source}->1.{key}")
        if "plain_optimizer" in saved:  # ddp -> one process: the optimizer state dict as written, groups and all
            assert_same(saved["plain_optimizer"], loaded["plain_optimizer"], f"{optimizer} plain")
        if optimizer == "adamw_schedulefree":  # the export holds the evaluation weights of the loaded state
            exported = UNet2DConditionModel.from_pretrained(run / "current_pipeline" / "unet").state_dict()
            with eval_weights(t.optimizer):
                x = weights(t.net)
            assert_same(exported, {k: v.to(exported[k].dtype) for k, v in x.items()}, "export")
            assert max_diff(x, loaded["unet"]) > 0  # not the training weights
            # Stage 2 from a schedule-free run: its checkpoint's raw weights are y, refused naming the export.
            from sd_training.checkpoint.init_from import init_weights_from

            ddp_run = runs / "adamw_schedulefree_ddp"
            with pytest.raises(ConfigError, match="adamw_schedulefree run: its unet weights are the training"):
                init_weights_from(str(ddp_run), t.net, "unet", want_ema=False)
            init_weights_from(str(ddp_run / "current_pipeline"), t.net, "unet", want_ema=False)
            pipeline = UNet2DConditionModel.from_pretrained(ddp_run / "current_pipeline" / "unet").state_dict()
            assert_same(pipeline, {k: v.to(pipeline[k].dtype) for k, v in weights(t.net).items()}, "init_from")
        t.trackers.close()


if __name__ == "__main__":
    worker(*sys.argv[1:4])
