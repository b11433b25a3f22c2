"""Checkpoints written by earlier code still resume: by 38e592a (the Trainer that saved and resumed by
itself, before the checkpoint manager) and by b27a8d6 (the checkpoint manager's format, the last commit before
the modules moved into subpackages).

``fixtures/checkpoints_<commit>/`` holds step 4 of two runs written by the code of that commit, bf16 with EMA,
a 2-level UNet from ``run.yaml`` on the tiny pipeline and the session's shapes shards (the same generator
arguments as ``conftest.shapes_shards``):

- ``one_process``: full tensors (unet.pt, ema.pt, optimizer.pt ...), batch 4 on one process;
- ``fsdp2``: DCP shards (sharded/, ema_meta.pt) written by 2 ranks under fsdp (gloo), batch 2 per rank.

38e592a's COMPLETE marker is a timestamp; b27a8d6's lists every file with its size and CRC32, which a
resume verifies. Their config.yaml names the pipeline, the shards and the run folder by relative paths, so the
test runs from a scratch folder that has them at those paths.

Regenerate (only if the format changes on purpose), from a folder holding ``pipeline/`` and ``shapes/``:

- 38e592a: run train.py at that commit with its run.yaml and the overrides of ``ARGS``
  (experiment.checkpoint_every=2, 8 steps), then keep checkpoints/step_00000004.
- b27a8d6: in a detached worktree of that commit (``git worktree add --detach DIR b27a8d6``), with
  PYTHONPATH=DIR, write ``pipeline/`` with ``families.registry.make_tiny_pipeline`` and ``shapes/`` with
  ``data.synthetic.write_shapes_shards(n_samples=128, n_shards=4, size=64, seed=0)``; run
  ``DIR/train.py config=run.yaml <ARGS> experiment.name=one_process system.batch_size=4`` and
  ``torchrun --nproc_per_node=2 DIR/train.py config=run.yaml <ARGS> experiment.name=fsdp2
  system.batch_size=2 distributed.strategy=fsdp`` (dist_backend auto: gloo on CPU), OMP_NUM_THREADS=1;
  keep each run's checkpoints/step_00000004 whole (COMPLETE included).
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_resume import assert_same

from sd_training import distributed
from sd_training.checkpoint.integrity import verify
from sd_training.checkpoint.layout import DAMAGED
from sd_training.configure import load
from sd_training.loop import Trainer
from sd_training.loop import main as train

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Each commit's fixtures, and whether its COMPLETE marker records checksums (b27a8d6) or a timestamp (38e592a).
COMMITS = {"38e592a": False, "b27a8d6": True}
ARGS = [
    "experiment.log_dir=runs", "experiment.num_examples_to_see=32",
    "experiment.save_every=1000", "experiment.checkpoint_every=2", "experiment.keep_last_checkpoints=10",
    "experiment.log_every=1", "experiment.sample_steps=2", "experiment.sample_per_prompt=1",
    "experiment.sample_prompts=[a]", "system.workers=0", "system.device=cpu", "model.pretrained=pipeline",
    "dataset.params.path=shapes/shapes-{000000..000003}.tar", "dataset.params.resolution=64", "wandb.mode=disabled",
    "optimizer.params.learning_rate=1e-3", "lr_scheduler.params.warmup_length=2", "model.use_ema=true",
    "model.mixed_precision=bf16",
]
pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Scratch:
    path: Path  # the folder the test runs in
    args: list[str]  # ARGS with the commit's run.yaml
    checksums: bool  # whether the commit's COMPLETE markers record checksums


@pytest.fixture(params=list(COMMITS))
def scratch(request, tmp_path, monkeypatch, tiny_pipeline, shapes_shards) -> Scratch:
    """A folder with one commit's fixture runs under runs/, the pipeline and shards at the paths their configs
    name."""
    fixture = FIXTURES / f"checkpoints_{request.param}"
    (tmp_path / "pipeline").symlink_to(tiny_pipeline)
    (tmp_path / "shapes").symlink_to(Path(shapes_shards.split("{")[0]).parent)
    for run in ("one_process", "fsdp2"):
        shutil.copytree(fixture / run, tmp_path / "runs" / run)
    monkeypatch.chdir(tmp_path)
    return Scratch(tmp_path, [f"config={fixture / 'run.yaml'}", *ARGS], COMMITS[request.param])


def assert_marker_as_written(ckpt: Path, checksums: bool, ranks: int) -> None:
    """The fixture's COMPLETE marker is its commit's: a timestamp (nothing to verify), or every file with its
    size and CRC32 for each of the ranks that wrote it, which the files still match."""
    marker = verify(ckpt)
    if not checksums:
        assert marker is None
        return
    assert marker["ranks"] == ranks and all("crc32" in rec for rec in marker["files"].values())
    assert {f"rank_{r}.pt" for r in range(ranks)} | {"train_state.json", "config.yaml"} <= set(marker["files"])


def resumed(argv: list[str]) -> Trainer:
    t = Trainer(load(argv), distributed.setup("cpu"))
    t.setup()
    t._lock.close()  # the run folder is free again for the next run in it
    return t


def saved(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_a_full_tensor_checkpoint_of_older_code_resumes_exactly(scratch):
    ckpt = scratch.path / "runs" / "one_process" / "checkpoints" / "step_00000004"
    assert_marker_as_written(ckpt, scratch.checksums, ranks=1)
    t = resumed(scratch.args + ["experiment.name=one_process", "system.batch_size=4"])
    assert t.state.step == 4 and t.state.images_seen == 16 and not (ckpt / DAMAGED).exists()
    # Every state bit for bit as the old code wrote it.
    assert_same(t.net.state_dict(), saved(ckpt / "unet.pt"))
    assert_same(t.optimizer.state_dict(), saved(ckpt / "optimizer.pt"))
    assert_same(t.ema.state_dict(), saved(ckpt / "ema.pt"))
    assert_same(t.lr_scheduler.state_dict(), saved(ckpt / "lr_scheduler.pt"))
    assert_same(t.scaler.state_dict(), saved(ckpt / "grad_scaler.pt"))
    # The data position too: the resumed run trains on the samples an uninterrupted run of today's code
    # trains on (the keys are the data's, not the floating point's), and finishes with an export.
    keys = "experiment.record_sample_keys=true"
    done = train(load(scratch.args + ["experiment.name=one_process", "system.batch_size=4", keys]))
    fresh = train(load(scratch.args + ["experiment.name=fresh", "system.batch_size=4", keys]))
    assert done["step"] == fresh["step"] == 8

    def steps(run):
        rows = [json.loads(line) for line in (Path(run) / "sample_keys" / "rank_0.jsonl").read_text().splitlines()]
        return {r["step"]: r["keys"] for r in rows}

    resumed_keys, fresh_keys = steps(done["run_dir"]), steps(fresh["run_dir"])
    assert sorted(resumed_keys) == [5, 6, 7, 8]
    assert all(resumed_keys[s] == fresh_keys[s] and len(resumed_keys[s]) == 4 for s in resumed_keys)
    assert (Path(done["run_dir"]) / "current_pipeline_ema" / "unet" / "config.json").exists()


@pytest.mark.slow
def test_an_fsdp_checkpoint_of_older_code_loads_into_one_process(scratch):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = scratch.path / "runs" / "fsdp2" / "checkpoints" / "step_00000004"
    assert_marker_as_written(ckpt, scratch.checksums, ranks=2)
    dcp_to_torch_save(str(ckpt / "sharded"), str(scratch.path / "full.pt"))  # torch's own reading, the reference
    full = torch.load(scratch.path / "full.pt", weights_only=False)
    # The strategy may change on resume (elastic): the shards are gathered into one process.
    t = resumed(scratch.args + ["experiment.name=fsdp2", "system.batch_size=2"])
    assert t.state.step == 4 and not t.strategy.sharded and not (ckpt / DAMAGED).exists()
    assert_same(t.net.state_dict(), full["unet"])
    assert_same(t.ema.shadow.state_dict(), full["ema"])
    names = {id(p): n for n, p in t.net.named_parameters()}
    moments = {names[id(p)]: s for g in t.optimizer.param_groups for p in g["params"]
               for s in [t.optimizer.state[p]]}
    assert_same(moments, full["optimizer"]["state"])
    assert_same(t.ema.meta_state_dict(), saved(ckpt / "ema_meta.pt"))
    assert_same(t.lr_scheduler.state_dict(), saved(ckpt / "lr_scheduler.pt"))
    assert t.loader.resumed_from  # both ranks' data positions taken over by the one process
