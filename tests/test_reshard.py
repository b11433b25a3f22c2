"""Elastic resume of the model state: a checkpoint written by ddp or fsdp on N ranks loads into a run of
either strategy on M ranks (one process without a process group included), bit for bit: the net, every
AdamW state tensor and step, the optimizer's groups, the EMA shadow and its scalars, the LR schedule.

Each test trains 2 steps with train.py (EMA on, bf16, one loader worker) and lets it checkpoint, then
starts this file as a worker under the other strategy and rank count: it runs the Trainer's set-up
(which resumes) and rank 0 saves the full state it loaded, gathered from the shards under fsdp. The
data position is not loaded (another test's subject): only the model state is compared.

    python tests/test_reshard.py OUT.pt key=value ...     (the worker; alone or under torchrun)
"""

import os
import sys
from pathlib import Path

import forked
import pytest
import torch
from test_resume import assert_same

HERE = Path(__file__).resolve().parent
BATCH = 2  # per rank


def worker(out: str, argv: list[str]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from sd_training import distributed
    from sd_training.checkpoint import CheckpointManager
    from sd_training.configure import load
    from sd_training.loop import Trainer

    cfg = load(argv)
    info = distributed.setup(cfg.system.device, cfg.distributed.dist_backend, cfg.distributed.dist_url)
    try:
        t = Trainer(cfg, info)
        # The data position and RNG: not this test's subject.
        CheckpointManager._resume_data_and_rng = lambda self, latest: None
        t.setup()
        # Full tensors on rank 0 (collective under fsdp); a plain module's own state otherwise.
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True) if t.strategy.sharded else StateDictOptions()
        names = {id(p): n for n, p in t.net.named_parameters()}
        state = {
            "unet": get_model_state_dict(t.net, options=opts),
            "ema": get_model_state_dict(t.ema.shadow, options=opts),
            "optimizer": get_optimizer_state_dict(t.net, t.optimizer, options=opts),
            "names": [[names[id(p)] for p in g["params"]] for g in t.optimizer.param_groups],
            "plain_optimizer": None if t.strategy.sharded else t.optimizer.state_dict(),
            "ema_meta": t.ema.meta_state_dict(),
            "lr_scheduler": t.lr_scheduler.state_dict(),
            "grad_scaler": t.scaler.state_dict(),
            "step": t.state.step,
            "process_group": torch.distributed.is_initialized(),
        }
        if info.is_main:
            torch.save(state, out)
        distributed.barrier()
    finally:
        distributed.teardown()


def launch(script_args: list[str], nproc: int, cwd: Path) -> str:
    from test_distributed import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *script_args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", *script_args]
    res = forked.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)  # forked: no imports
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res.stdout + res.stderr


def run_args(tmp_path, pipeline, shards, strategy, nproc, name):
    from conftest import train_args

    return train_args(tmp_path, pipeline, shards, name=name, **{
        "experiment.num_examples_to_see": 2 * BATCH * nproc,  # 2 steps, checkpointed at the last
        "experiment.sample_per_prompt": 0, "system.batch_size": BATCH, "system.workers": 1,
        "model.use_ema": "true", "model.ema.decay": 0.9, "model.mixed_precision": "bf16",
        "distributed.strategy": strategy, "experiment.allow_config_change": "true",  # the strategy and batch change
        "dataset.params.resolution": 32,  # bf16 convolutions are ATen's slow kernels on this CPU: a quarter of 64 px's
    })


def train(tmp_path, pipeline, shards, strategy, nproc) -> Path:
    name = f"{strategy}{nproc}"
    launch([str(HERE.parent / "train.py"), *run_args(tmp_path, pipeline, shards, strategy, nproc, name)], nproc,
           tmp_path)
    folder = tmp_path / "runs" / name / "checkpoints" / "step_00000002"
    assert (folder / "COMPLETE").exists() and (folder / "sharded").is_dir() == (strategy == "fsdp")
    return folder


def resume(tmp_path, pipeline, shards, folder: Path, strategy, nproc) -> tuple[dict, str]:
    out = tmp_path / f"loaded_{strategy}{nproc}.pt"
    args = run_args(tmp_path, pipeline, shards, strategy, nproc, folder.parents[1].name)
    log = launch([str(Path(__file__).resolve()), str(out), *args], nproc, tmp_path)
    return torch.load(out, weights_only=False), log


def saved_state(folder: Path, names: list[list[str]]) -> dict:
    """The checkpoint's model state as full tensors, the optimizer's keyed by parameter name."""
    from sd_training.checkpoint import Checkpointer

    shared, _, train_state = Checkpointer.load(folder, 0)
    out = {"lr_scheduler": shared["lr_scheduler"], "grad_scaler": shared["grad_scaler"], "step": train_state["step"]}
    if (folder / "sharded").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(folder / "sharded", folder.parent / "full.pt")
        full = torch.load(folder.parent / "full.pt", weights_only=False)
        return {**out, "unet": full["unet"], "ema": full["ema"], "optimizer": full["optimizer"],
                "ema_meta": shared["ema_meta"]}
    osd = shared["optimizer"]
    by_index = dict(zip([i for g in osd["param_groups"] for i in g["params"]], sum(names, [])))
    named = {"state": {by_index[i]: s for i, s in osd["state"].items()},
             "param_groups": [{**g, "params": n} for g, n in zip(osd["param_groups"], names)]}
    ema = shared["ema"]
    return {**out, "unet": shared["unet"], "ema": ema["shadow"], "optimizer": named, "plain_optimizer": osd,
            "ema_meta": {"decay": ema["decay"], "num_updates": ema["num_updates"]}}


def check_loaded(folder: Path, loaded: dict) -> None:
    saved = saved_state(folder, loaded["names"])
    # The state moved in 2 steps, and the EMA is not the net: equality below is the checkpoint's, not the init's.
    assert saved["optimizer"]["state"] and saved["ema_meta"]["num_updates"] == 2
    assert any(not torch.equal(saved["unet"][k], saved["ema"][k]) for k in saved["unet"])
    for key in ("unet", "ema", "optimizer", "ema_meta", "lr_scheduler", "grad_scaler", "step"):
        assert_same(saved[key], loaded[key], key)
    if loaded["plain_optimizer"] is not None and "plain_optimizer" in saved:  # ddp to ddp: as saved, index-keyed
        assert_same(saved["plain_optimizer"], loaded["plain_optimizer"], "plain_optimizer")


pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def ddp_checkpoint(tmp_path_factory, tiny_pipeline, shapes_shards):
    tmp = tmp_path_factory.mktemp("ddp")
    return tmp, train(tmp, tiny_pipeline, shapes_shards, "ddp", 2)


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory, tiny_pipeline, shapes_shards):
    tmp = tmp_path_factory.mktemp("fsdp")
    return tmp, train(tmp, tiny_pipeline, shapes_shards, "fsdp", 2)


CASES = {  # (checkpoint's strategy, this run's strategy, ranks): the line the resume logs
    ("ddp", "fsdp", 3): "resumed a ddp checkpoint of 2 ranks under fsdp on 3 ranks: model, optimizer and EMA sharded "
                        "from full tensors",
    ("ddp", "ddp", 1): "resumed a ddp checkpoint of 2 ranks in one process: model, optimizer and EMA loaded as full",
    ("fsdp", "ddp", 2): "resumed an fsdp checkpoint of 2 ranks under ddp on 2 ranks: model, optimizer and EMA "
                        "gathered from DCP shards",
    ("fsdp", "fsdp", 3): "resumed an fsdp checkpoint of 2 ranks under fsdp on 3 ranks: model, optimizer and EMA "
                         "resharded by DCP",
    ("fsdp", "fsdp", 1): "resumed an fsdp checkpoint of 2 ranks in one process: model, optimizer and EMA gathered "
                         "from DCP shards",
}


@pytest.mark.parametrize("source, strategy, nproc", list(CASES), ids=[f"{a}2-{b}{n}" for a, b, n in CASES])
def test_checkpoint_resumes_under_another_strategy_and_rank_count_bit_for_bit(request, tiny_pipeline, shapes_shards,
                                                                              source, strategy, nproc):
    """ddp -> fsdp on 3 ranks (uneven shards), fsdp -> ddp, fsdp 2 -> fsdp 3 (DCP reshards) and both layouts
    into one process without a process group (fsdp asked for there runs the plain module)."""
    line = CASES[source, strategy, nproc]
    tmp, folder = request.getfixturevalue(f"{source}_checkpoint")
    loaded, log = resume(tmp, tiny_pipeline, shapes_shards, folder, strategy, nproc)
    assert loaded["process_group"] == (nproc > 1)
    assert line in log, log[-3000:]
    check_loaded(folder, loaded)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2:])
