"""Checkpoints written before the checkpoint manager existed still resume.

``fixtures/checkpoints_38e592a/`` holds step 4 of two runs written by the code of commit 38e592a (the
Trainer that saved and resumed by itself), bf16 with EMA, a 2-level UNet from ``run.yaml`` on the tiny
pipeline and the session's shapes shards (the same generator arguments as ``conftest.shapes_shards``):

- ``one_process``: full tensors (unet.pt, ema.pt, optimizer.pt ...), batch 4 on one process;
- ``fsdp2``: DCP shards (sharded/, ema_meta.pt) written by 2 ranks under fsdp, batch 2 per rank.

Their config.yaml names the pipeline, the shards and the run folder by relative paths, so the test runs
from a scratch folder that has them at those paths. Regenerate (only if the format changes on purpose):
run train.py at the old commit with tests/fixtures/checkpoints_38e592a/run.yaml and the overrides of
``ARGS`` (experiment.checkpoint_every=2, 8 steps), then keep checkpoints/step_00000004.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_resume import assert_same

from sd_training import distributed
from sd_training.configure import load
from sd_training.loop import Trainer
from sd_training.loop import main as train

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoints_38e592a"
ARGS = [
    f"config={FIXTURE / 'run.yaml'}", "experiment.log_dir=runs", "experiment.num_examples_to_see=32",
    "experiment.save_every=1000", "experiment.checkpoint_every=2", "experiment.keep_last_checkpoints=10",
    "experiment.log_every=1", "experiment.sample_steps=2", "experiment.sample_per_prompt=1",
    "experiment.sample_prompts=[a]", "system.workers=0", "system.device=cpu", "model.pretrained=pipeline",
    "dataset.params.path=shapes/shapes-{000000..000003}.tar", "dataset.params.resolution=64", "wandb.mode=disabled",
    "optimizer.params.learning_rate=1e-3", "lr_scheduler.params.warmup_length=2", "model.use_ema=true",
    "model.mixed_precision=bf16",
]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def scratch(tmp_path, monkeypatch, tiny_pipeline, shapes_shards):
    """A folder with the fixture runs under runs/, the pipeline and shards at the paths their configs name."""
    (tmp_path / "pipeline").symlink_to(tiny_pipeline)
    (tmp_path / "shapes").symlink_to(Path(shapes_shards.split("{")[0]).parent)
    for run in ("one_process", "fsdp2"):
        shutil.copytree(FIXTURE / run, tmp_path / "runs" / run)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def resumed(argv: list[str]) -> Trainer:
    t = Trainer(load(argv), distributed.setup("cpu"))
    t.setup()
    t._lock.close()  # the run folder is free again for the next run in it
    return t


def saved(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_a_full_tensor_checkpoint_of_the_old_trainer_resumes_exactly(scratch):
    ckpt = scratch / "runs" / "one_process" / "checkpoints" / "step_00000004"
    t = resumed(ARGS + ["experiment.name=one_process", "system.batch_size=4"])
    assert t.state.step == 4 and t.state.images_seen == 16
    # Every state bit for bit as the old code wrote it.
    assert_same(t.net.state_dict(), saved(ckpt / "unet.pt"))
    assert_same(t.optimizer.state_dict(), saved(ckpt / "optimizer.pt"))
    assert_same(t.ema.state_dict(), saved(ckpt / "ema.pt"))
    assert_same(t.lr_scheduler.state_dict(), saved(ckpt / "lr_scheduler.pt"))
    assert_same(t.scaler.state_dict(), saved(ckpt / "grad_scaler.pt"))
    # The data position too: the resumed run trains on the samples an uninterrupted run of today's code
    # trains on (the keys are the data's, not the floating point's), and finishes with an export.
    keys = "experiment.record_sample_keys=true"
    done = train(load(ARGS + ["experiment.name=one_process", "system.batch_size=4", keys]))
    fresh = train(load(ARGS + ["experiment.name=fresh", "system.batch_size=4", keys]))
    assert done["step"] == fresh["step"] == 8

    def steps(run):
        rows = [json.loads(line) for line in (Path(run) / "sample_keys" / "rank_0.jsonl").read_text().splitlines()]
        return {r["step"]: r["keys"] for r in rows}

    resumed_keys, fresh_keys = steps(done["run_dir"]), steps(fresh["run_dir"])
    assert sorted(resumed_keys) == [5, 6, 7, 8]
    assert all(resumed_keys[s] == fresh_keys[s] and len(resumed_keys[s]) == 4 for s in resumed_keys)
    assert (Path(done["run_dir"]) / "current_pipeline_ema" / "unet" / "config.json").exists()


@pytest.mark.slow
def test_an_fsdp_checkpoint_of_the_old_trainer_loads_into_one_process(scratch):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = scratch / "runs" / "fsdp2" / "checkpoints" / "step_00000004"
    dcp_to_torch_save(str(ckpt / "sharded"), str(scratch / "full.pt"))  # torch's own reading, the reference
    full = torch.load(scratch / "full.pt", weights_only=False)
    # The strategy may change on resume (elastic): the shards are gathered into one process.
    t = resumed(ARGS + ["experiment.name=fsdp2", "system.batch_size=2"])
    assert t.state.step == 4 and not t.strategy.sharded
    assert_same(t.net.state_dict(), full["unet"])
    assert_same(t.ema.shadow.state_dict(), full["ema"])
    names = {id(p): n for n, p in t.net.named_parameters()}
    moments = {names[id(p)]: s for g in t.optimizer.param_groups for p in g["params"]
               for s in [t.optimizer.state[p]]}
    assert_same(moments, full["optimizer"]["state"])
    assert_same(t.ema.meta_state_dict(), saved(ckpt / "ema_meta.pt"))
    assert_same(t.lr_scheduler.state_dict(), saved(ckpt / "lr_scheduler.pt"))
    assert t.loader.resumed_from  # both ranks' data positions taken over by the one process
