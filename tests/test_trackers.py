"""Trackers: metrics.jsonl always; real wandb in offline mode, continuing the same run after a restart."""

import json

import pytest
from conftest import train_args

from sd_training.configure import load
from sd_training.loop import main as train
from sd_training.outputs.trackers import wandb_mode

# In-process training: one intra-op thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def test_wandb_auto_mode(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"
    assert wandb_mode("disabled") == "disabled"


@pytest.mark.slow
def test_wandb_offline_run_is_continued_after_restart(tmp_path, tiny_pipeline, shapes_shards, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args = train_args(tmp_path, tiny_pipeline, shapes_shards, name="wb", **{
        "wandb.mode": "offline", "experiment.num_examples_to_see": 16, "experiment.checkpoint_every": 2,
        "experiment.tensorboard": "true",
        "experiment.sample_per_prompt": 1})
    train(load(args))
    run = tmp_path / "runs" / "wb"
    first = json.loads((run / "checkpoints" / "step_00000004" / "train_state.json").read_text())["wandb_id"]
    assert first
    # Longer run, same directory: resumes at step 4 and logs into the same wandb run.
    train(load(args + ["experiment.num_examples_to_see=24", "dataset.params.num_examples_to_see=24"]))
    second = json.loads((run / "checkpoints" / "step_00000006" / "train_state.json").read_text())["wandb_id"]
    assert second == first
    offline_runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(p.name.endswith(first) for p in offline_runs)
    assert any(p.suffix == ".wandb" for p in offline_runs[0].iterdir())
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7))
    assert any("samples" in r for r in rows)
    # tensorboard event files hold the same loss values.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")][:4] == [1, 2, 3, 4]
