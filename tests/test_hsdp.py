"""distributed.strategy=hsdp: FSDP2 on a 2-D mesh ("replicate", "shard"), sharded inside groups of
distributed.hsdp_shard_size ranks and replicated across them (issue 38).

The multi-rank runs (4 gloo ranks as 2 shard groups of 2, fp32, EMA, 2 loader workers per rank, 8 canonical
readers; built once for the module):

- ``straight``: hsdp, 4 optimizer steps of a global batch of 4, never stopped;
- ``killed``: the same run, SIGKILLed after the checkpoint of step 2 (DCP shards written on the 2-D mesh);
  its step-2 checkpoint then resumes three ways: on the same 4 ranks under hsdp (bit-identical to
  ``straight``), on 2 ranks under fsdp and in one process (the same samples, per-sample noise and timesteps
  as ``straight``: only the order gradients are summed in differs);
- ``one``: one process with the global batch of 4 from the start (hsdp equals one rank).
"""

import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import train_args
from elastic_runs import drop_checkpoints_after, elastic_args, full_checkpoint, steps_keys
from helpers import largest, max_diff
from test_resume import assert_same, finish, kill_after_checkpoint, launch, losses

from sd_training.config import ConfigError

STEPS = 4
GLOBAL_BATCH = 4
# fp32: the same samples, noise and timesteps give the same gradients up to the order in which they are
# summed (4 ranks: reduce-scatter in a group of 2, then all-reduce across the 2 groups; 2 ranks; one) -- a
# few fp32 ulps at the weights' magnitude (test_elastic's bounds). Another sample or noise draw would move
# every weight by about a learning rate (1e-3) per step.
TOL = {"unet": 1e-6, "ema": 1e-6, "loss": 1e-5}


def run_args(tmp_path, pipeline, shards, name, strategy="hsdp", workers=2, **more):
    return elastic_args(tmp_path, pipeline, shards, name, STEPS, GLOBAL_BATCH, **{
        "system.workers": workers,
        "dataset.params.resolution": 32,
        "dataset.params.canonical_readers": 8,
        "model.mixed_precision": "no",
        "distributed.strategy": strategy,
        # A larger Adam epsilon keeps near-zero gradients (whose fp32 rounding depends on the summation
        # order) from turning into full-size updates of different sign (test_distributed's setting).
        "optimizer.params.epsilon": 1e-4,
        "lr_scheduler.params.warmup_length": 0,
        **({"distributed.hsdp_shard_size": 2} if strategy == "hsdp" else {}),
        **more,
    })


def state_at(run: Path, step: int) -> dict:
    """Checkpoint ``step`` of ``run`` as full tensors (DCP shards gathered)."""
    return full_checkpoint(run, step)[0]


_FINAL: dict = {}


def final(run: Path) -> tuple[dict, dict]:
    """The last checkpoint of ``run`` as full tensors and its train state, gathered from DCP once per run
    (the checks share the runs)."""
    if run not in _FINAL:
        _FINAL[run] = full_checkpoint(run, STEPS)
    return _FINAL[run]


def weights(state: dict) -> dict:
    """The net's and the EMA's weights of a checkpoint, whichever layout wrote it (ema.pt holds the shadow
    with the EMA's scalars; DCP the shadow alone)."""
    ema = state["ema"]
    return {"unet": state["unet"], "ema": ema["shadow"] if "shadow" in ema else ema}


# ---------------------------------------------------------------------------------------------------
# Start-up: the shard size, the refusals, the memory plan (no process group)
# ---------------------------------------------------------------------------------------------------

def test_shard_size_defaults_to_one_node_and_must_divide_the_ranks():
    from sd_training.distributed import hsdp_shard_size, probe_env

    assert hsdp_shard_size(0, 8, 4) == 4  # the ranks of one node
    assert hsdp_shard_size(2, 8, 4) == 2
    assert hsdp_shard_size(8, 8, 4) == 8
    for configured, world, local in ((3, 8, 4), (0, 6, 4), (16, 8, 8)):
        with pytest.raises(ConfigError, match="distributed.hsdp_shard_size") as e:
            hsdp_shard_size(configured, world, local)
        assert f"does not divide the {world} ranks" in str(e.value)
    # The node's ranks as the launchers say them: torchrun's LOCAL_WORLD_SIZE, srun's tasks per node
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert probe_env(env)["local_world_size"] == 4
    srun = {"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "7",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "MASTER_ADDR": "n1"}
    layout = probe_env(srun)
    assert (layout["world_size"], layout["local_world_size"]) == (8, 4)
    assert hsdp_shard_size(0, layout["world_size"], layout["local_world_size"]) == 4


def test_setup_refuses_a_shard_size_that_does_not_divide_before_any_rendezvous(monkeypatch):
    """Every rank raises the same ConfigError before it opens a socket (no rank waits for the others)."""
    from sd_training import distributed

    for k, v in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=r"distributed.hsdp_shard_size=3 does not divide the 4 ranks"):
        distributed.setup("cpu", "gloo", hsdp_shard=3)


def test_hsdp_with_one_shard_group_runs_as_fsdp(caplog):
    from sd_training.config.schema import DistributedConfig
    from sd_training.distributed import DistInfo
    from sd_training.distributed.strategy import Strategy

    info = DistInfo(rank=0, world_size=4, local_world_size=4, launcher="torchrun", backend="gloo")
    with caplog.at_level(logging.INFO, logger="sd_training.distributed.strategy"):
        one_node = Strategy("hsdp", True, torch.device("cpu"), None, DistributedConfig(strategy="hsdp"), info)
    assert (one_node.name, one_node.shard_size, one_node.sharded, one_node.plan_name) == ("fsdp", 4, True, "fsdp")
    assert "one shard group of all 4 rank(s)" in caplog.text and "runs as fsdp" in caplog.text
    two = Strategy("hsdp", True, torch.device("cpu"), None, DistributedConfig(strategy="hsdp", hsdp_shard_size=2), info)
    assert (two.name, two.shard_size, two.replicas, two.sharded, two.plan_name) == ("hsdp", 2, 2, True, "hsdp")
    offload = DistributedConfig(strategy="hsdp", hsdp_shard_size=2, fsdp_cpu_offload=True)
    assert Strategy("hsdp", True, torch.device("cpu"), None, offload, info).plan_name == "fsdp_offload"


@pytest.mark.parametrize("keys, words", [
    ({"model.mixed_precision": "fp16"}, "'model.mixed_precision=fp16' is not supported with distributed.strategy=hsdp"),
    ({"model.text_encoder.train": "true"}, "'model.text_encoder.train' is not supported with distributed.strategy=hsdp"),
    ({"model.ema.device": "cpu", "model.use_ema": "true"}, "'model.ema.device=cpu' is not supported with distributed.strategy=hsdp"),
    ({"optimizer.name": "prodigy", "optimizer.params.learning_rate": 1.0}, "cannot train under distributed.strategy=hsdp"),
    ({"model.block_swap": 1, "model.gradient_checkpointing": "true"}, "distributed.strategy=hsdp: FSDP already shards"),
    ({"distributed.strategy": "ddp", "distributed.hsdp_shard_size": 2}, "'distributed.hsdp_shard_size' applies to distributed.strategy=hsdp"),
    ({"distributed.hsdp_shard_size": -1}, "distributed.hsdp_shard_size"),
])
def test_what_fsdp_refuses_hsdp_refuses_naming_it(tmp_path, tiny_pipeline, shapes_shards, keys, words):
    from sd_training.configure import load

    argv = train_args(tmp_path, tiny_pipeline, shapes_shards, **{"distributed.strategy": "hsdp", **keys})
    with pytest.raises(ConfigError) as e:
        load(argv)
    assert words in str(e.value)


def test_hsdp_takes_cpu_offload(tmp_path, tiny_pipeline, shapes_shards):
    from sd_training.configure import load

    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{
        "distributed.strategy": "hsdp", "distributed.fsdp_cpu_offload": "true", "distributed.hsdp_shard_size": 2}))
    assert cfg.distributed.strategy == "hsdp" and cfg.distributed.fsdp_cpu_offload


def test_memory_plan_has_an_hsdp_row_sharded_over_its_group():
    from sd_training.memory.fit import Setting
    from sd_training.memory.plan import TrainedState, strategy_rows

    state = TrainedState(params=1000, weights=4000, grads=4000, optimizer=8000, ema=4000, base=0)
    counts = dict(trained_params=1000, base_params=0, encoder_trained_params=0)
    rows = {r.strategy: r for r in strategy_rows(state, 100, 0, 16, 0.0, counts, shard_size=4)}
    assert list(rows) == ["ddp", "fsdp", "hsdp", "fsdp_offload"]
    for col, whole in (("weights", 4000), ("gradients", 4000), ("optimizer", 8000), ("ema", 4000)):
        gib = 2**30
        assert getattr(rows["hsdp"], col) * gib == pytest.approx(whole / 4)  # 1/shard_size, not 1/world
        assert getattr(rows["fsdp"], col) * gib == pytest.approx(whole / 16)
    assert rows["hsdp"].gathered == rows["fsdp"].gathered
    # No hsdp row where it would be fsdp (one shard group) or when not asked for
    assert "hsdp" not in {r.strategy for r in strategy_rows(state, 100, 0, 8, 0.0, counts, shard_size=8)}
    assert "hsdp" not in {r.strategy for r in strategy_rows(state, 100, 0, 8, 0.0, counts)}
    s = Setting(1, False, "adamw", False, True, "hsdp", 16, shard=4)
    assert s.divisor == 4 and Setting(1, False, "adamw", False, True, "fsdp", 16).divisor == 16


def test_load_time_fit_reads_the_shard_size_from_the_launcher(tmp_path, tiny_pipeline, shapes_shards, monkeypatch):
    from sd_training.configure import load
    from sd_training.memory.fit import current_setting, describe, load_plan

    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"distributed.strategy": "hsdp"}))
    s = current_setting(cfg)
    assert (s.strategy, s.world, s.shard, s.divisor) == ("hsdp", 16, 8, 8)
    plan = load_plan(cfg)
    assert plan is not None
    fsdp = current_setting(load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"distributed.strategy": "fsdp"})))
    assert plan.state(s) == pytest.approx(2 * plan.state(fsdp))  # over 8 ranks of a group, not all 16
    assert "over a shard group of 8 of the 16 ranks" in describe(plan, cfg)


# ---------------------------------------------------------------------------------------------------
# 4 gloo ranks (2 x 2): equals one rank, kill-and-resume bit-identical, elastic to fsdp on 2 and to 1 rank
# ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_pipeline, shapes_shards):
    tmp = tmp_path_factory.mktemp("hsdp")
    args = lambda name, **kw: run_args(tmp, tiny_pipeline, shapes_shards, name, **kw)  # noqa: E731
    out = {"straight": finish(launch(tmp, args("straight"), 4))}
    run = tmp / "runs" / "killed"
    kill_after_checkpoint(launch(tmp, args("killed"), 4), run / "checkpoints", 2)
    drop_checkpoints_after(run, 2)  # a slow kill may have let a later one complete
    # The same step-2 checkpoint resumed elsewhere: copies under other log_dirs (the name is part of the config)
    for where in ("fsdp2", "one"):
        shutil.copytree(run, tmp / where / "killed")
    out["resumed"] = finish(launch(tmp, args("killed"), 4))
    out["fsdp2"] = finish(launch(tmp, args("killed", strategy="fsdp", workers=1,
                                           **{"experiment.log_dir": tmp / "fsdp2"}), 2))
    out["one"] = finish(launch(tmp, args("killed", strategy="ddp", workers=1, **{"experiment.log_dir": tmp / "one"}), 1))
    out["one_straight"] = finish(launch(tmp, args("one", strategy="ddp", workers=1), 1))
    paths = {"straight": tmp / "runs" / "straight", "resumed": run, "fsdp2": tmp / "fsdp2" / "killed",
             "one": tmp / "one" / "killed", "one_straight": tmp / "runs" / "one"}
    return paths, out


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_on_4_ranks_built_a_2x2_mesh_and_equals_one_rank_with_the_global_batch(runs):
    paths, out = runs
    log = (paths["straight"] / "train.log").read_text()
    assert "hsdp: 2 replica(s) x 2-rank shard groups (distributed.hsdp_shard_size)" in log, out["straight"][-3000:]
    assert (paths["straight"] / "checkpoints" / f"step_{STEPS:08d}" / "sharded").is_dir()
    a, b = weights(final(paths["straight"])[0]), weights(final(paths["one_straight"])[0])
    assert steps_keys(paths["straight"], GLOBAL_BATCH) == steps_keys(paths["one_straight"], GLOBAL_BATCH)
    # The steps moved the weights (by far more than the tolerance), so the equality below means something
    moved = max_diff(a["unet"], weights(state_at(paths["resumed"], 2))["unet"], strict=True)
    assert moved > 1e-4, moved
    for name in ("unet", "ema"):
        diff, scale = max_diff(a[name], b[name], strict=True), largest(a[name])
        print(f"{name}: 4-rank hsdp vs one rank: max abs difference {diff:.3g} (largest magnitude {scale:.3g})")
        assert diff <= TOL[name], f"{name} differs by {diff:.3g} > {TOL[name]}"
    la, lb = losses(paths["straight"]), losses(paths["one_straight"])
    assert sorted(la) == list(range(1, STEPS + 1))
    # The export gathered the full weights from the 2-D mesh's shards (Strategy.plain_copy): the checkpoint's,
    # in the export's dtype
    from safetensors.torch import load_file

    exported = load_file(paths["straight"] / "current_pipeline" / "unet" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == a["unet"].keys()
    for k, v in exported.items():
        assert torch.equal(v, a["unet"][k].to(v.dtype)), k
    for s in la:
        assert abs(la[s] - lb[s]) <= TOL["loss"] * abs(lb[s]), (s, la[s], lb[s])


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_kill_and_resume_on_4_ranks_is_bit_identical(runs):
    paths, out = runs
    assert "resumed from" in out["resumed"]
    a, ta = final(paths["straight"])
    b, tb = final(paths["resumed"])
    assert ta["step"] == tb["step"] == STEPS
    for name in ("unet", "ema", "optimizer", "lr_scheduler"):
        assert_same(a[name], b[name], name)
    la, lb = losses(paths["straight"]), losses(paths["resumed"])
    for s in range(3, STEPS + 1):
        assert la[s] == lb[s], (s, la[s], lb[s])
    assert steps_keys(paths["resumed"], GLOBAL_BATCH) == steps_keys(paths["straight"], GLOBAL_BATCH)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("where, ranks", [("fsdp2", 2), ("one", 1)])
def test_hsdp_checkpoint_resumes_elsewhere_on_the_uninterrupted_runs_samples(runs, where, ranks):
    """On 2 ranks under fsdp (DCP reshards the 2-D mesh's shards onto a 1-D mesh) and in one process (full
    tensors gathered from the shards), with 1 loader worker per rank instead of 2."""
    paths, out = runs
    log = (paths[where] / "train.log").read_text()
    assert f"resumed on {ranks} rank(s) x 1 worker(s) from a checkpoint of 4 rank(s) x 2 worker(s)" in log, \
        out[where][-3000:]
    assert "approximate" not in log
    assert steps_keys(paths[where], GLOBAL_BATCH) == steps_keys(paths["straight"], GLOBAL_BATCH)
    a, c = weights(final(paths["straight"])[0]), weights(final(paths[where])[0])
    for name in ("unet", "ema"):
        diff, scale = max_diff(a[name], c[name], strict=True), largest(a[name])
        print(f"{where}: {name} differs by at most {diff:.3g} (largest magnitude {scale:.3g})")
        assert diff <= TOL[name], f"{name} differs by {diff:.3g} > {TOL[name]}"
    la, lc = losses(paths["straight"]), losses(paths[where])
    for s in range(3, STEPS + 1):
        assert abs(lc[s] - la[s]) <= TOL["loss"] * abs(la[s]), (s, la[s], lc[s])


@pytest.fixture(scope="module")
def norms(tmp_path_factory) -> Path:
    """tests/hsdp_worker.py on 4 gloo ranks (2 groups of 2), both modes in one start; its results' folder."""
    import os
    import sys

    import forked
    from test_distributed import free_port

    out = tmp_path_factory.mktemp("hsdp_norms")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(Path(__file__).parent / "hsdp_worker.py"), str(out), "device,offload"]
    res = forked.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=out,
                     timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("offload", ["device", "offload"])
def test_gradient_norms_and_clipping_on_the_2d_mesh(norms, offload):
    """4 gloo ranks, 2 groups of 2 (tests/hsdp_worker.py): the gradients, the clipped global norm and the
    norm optimizer.in_backward reports are the whole batch's on one unwrapped net, counted once per shard,
    not once per replica (a sum over all 4 ranks would be sqrt(2) too large); with the shards in CPU memory
    (distributed.fsdp_cpu_offload) too."""
    import json

    for rank in range(4):
        r = json.loads((norms / f"rank_{rank}_{offload}.json").read_text())
        assert r["mesh"] == [2, 2, "hsdp"] and r["placements"] == "(Replicate(), Shard(dim=0))"
        assert r["ref_norm"] > 0.05  # the clipping clipped
        assert r["norm"] < 1e-6 and r["clipped_grads"] < 1e-7, r
        assert r["in_backward_norm"] < 1e-6 and r["in_backward_update"] < 1e-7, r
