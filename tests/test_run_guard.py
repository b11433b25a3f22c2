"""A run folder holds one run: a lock against a second one, no new run on top of an old run's
checkpoints, no silent config change on resume, every step logged once after a resume."""

import json
import os
import sys
from pathlib import Path

import forked
import pytest
from helpers import args_with

from sd_training.checkpoint import complete_steps
from sd_training.checkpoint.resume_config import config_changes
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.loop import main as train
from sd_training.run.run_dir import lock_run_folder

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.faults]


args = args_with({"experiment.num_examples_to_see": 4 * 4, "experiment.checkpoint_every": 2,
                  "experiment.save_every": 100, "experiment.sample_per_prompt": 0, "dataset.params.resolution": 32},
                 name="g")


def metric_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_a_second_run_in_the_same_folder_is_refused_naming_the_first(tmp_path, tiny_pipeline, shapes_shards):
    run = tmp_path / "runs" / "g"
    held = lock_run_folder(run)  # the "first run": this test process
    try:
        res = forked.run([sys.executable, str(ROOT / "train.py"), *args(tmp_path, tiny_pipeline, shapes_shards)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 2, res.stderr[-3000:]
        assert f"is in use by host {os.uname().nodename} pid {os.getpid()}" in res.stderr
        assert "another experiment.name" in res.stderr
        assert not (run / "checkpoints").exists()
    finally:
        held.close()
    train(load(args(tmp_path, tiny_pipeline, shapes_shards)))  # released: the folder is usable again
    assert complete_steps(run / "checkpoints") == [2, 4]


def test_a_new_run_never_lands_on_an_old_runs_checkpoints(tmp_path, tiny_pipeline, shapes_shards):
    run = tmp_path / "runs" / "g"
    train(load(args(tmp_path, tiny_pipeline, shapes_shards)))
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(ConfigError, match=r"holds checkpoints of an earlier run \(steps 2\.\.4\).*start_fresh=true"):
        train(load(args(tmp_path, tiny_pipeline, shapes_shards, **{"experiment.resume": "false"})))
    assert complete_steps(run / "checkpoints") == [2, 4]  # nothing deleted
    train(load(args(tmp_path, tiny_pipeline, shapes_shards, **{
        "experiment.resume": "false", "experiment.start_fresh": "true", "experiment.num_examples_to_see": 4 * 2})))
    aside = [p for p in run.parent.iterdir() if p.name.startswith("g.old-")]
    assert len(aside) == 1 and complete_steps(aside[0] / "checkpoints") == [2, 4]
    assert set(before) - {".lock"} <= {p.name for p in aside[0].iterdir()}
    assert complete_steps(run / "checkpoints") == [2] and metric_steps(run) == [1, 2]


def test_resume_refuses_a_changed_objective_and_applies_a_new_learning_rate(tmp_path, tiny_pipeline, shapes_shards):
    run = tmp_path / "runs" / "g"
    train(load(args(tmp_path, tiny_pipeline, shapes_shards, **{"experiment.num_examples_to_see": 4 * 2})))
    with pytest.raises(ConfigError, match=r"objective\.prediction_type: None -> v_prediction.*allow_config_change"):
        train(load(args(tmp_path, tiny_pipeline, shapes_shards, **{
            "experiment.num_examples_to_see": 4 * 4, "objective.prediction_type": "v_prediction"})))
    # A longer run (allowed, logged) with a new peak learning rate (applied, logged); constant schedule
    # after warmup so the logged LR is the peak.
    new = args(tmp_path, tiny_pipeline, shapes_shards, **{
        "experiment.num_examples_to_see": 4 * 4, "optimizer.params.learning_rate": 5e-3})
    train(load(new))
    text = (run / "train.log").read_text()
    assert "resuming with changed settings: " in text and "experiment.num_examples_to_see: 8 -> 16" in text
    assert "takes effect now: optimizer.params.learning_rate: 0.001 -> 0.005" in text
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    lr = {r["step"]: r["lr"] for r in rows}
    assert lr[2] <= 1e-3 and lr[4] > 1e-3  # the schedule continued from the new peak


def test_metrics_rows_of_the_killed_run_past_its_checkpoint_are_cut_back(tmp_path, tiny_pipeline, shapes_shards):
    run = tmp_path / "runs" / "g"
    train(load(args(tmp_path, tiny_pipeline, shapes_shards, **{"experiment.num_examples_to_see": 4 * 2})))
    with open(run / "metrics.jsonl", "a") as fh:  # steps 3 and 4 logged, then killed before checkpoint 4
        fh.write(json.dumps({"step": 3, "loss": 1.0}) + "\n" + json.dumps({"step": 4, "loss": 1.0}) + "\n{\"step\": 5, \"lo")
    train(load(args(tmp_path, tiny_pipeline, shapes_shards, **{"experiment.num_examples_to_see": 4 * 4})))
    assert metric_steps(run) == [1, 2, 3, 4]


def test_config_changes_sorts_keys_into_free_applied_and_refused():
    saved = "experiment:\n  log_every: 10\nmodel:\n  use_ema: true\noptimizer:\n  params:\n    learning_rate: 0.001\nwandb:\n  api_key: <redacted>\n"
    free, applied, refused = config_changes(saved, {
        "experiment": {"log_every": 5}, "model": {"use_ema": False}, "optimizer": {"params": {"learning_rate": 0.002}},
        "wandb": {"api_key": "<redacted>"}})
    assert free == ["experiment.log_every: 10 -> 5"]
    assert applied == ["optimizer.params.learning_rate: 0.001 -> 0.002"]
    assert refused == ["model.use_ema: True -> False"]


def test_the_zero_weight_stop_limit_may_change_on_resume():
    # The zero-weight stop says "raise the limit and run the same command": the resume must accept it.
    saved = "experiment:\n  max_zero_weight_steps: 100\n"
    free, _, refused = config_changes(saved, {"experiment": {"max_zero_weight_steps": 1000}})
    assert free == ["experiment.max_zero_weight_steps: 100 -> 1000"] and not refused


def test_cutting_metrics_back_on_resume_survives_hostile_lines(tmp_path):
    # A line nested 100,000 deep (or one that is not a row) in metrics.jsonl: before, a RecursionError at resume.
    from sd_training.run.run_dir import cut_metrics_back

    path = tmp_path / "metrics.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    path.write_text("\n".join(['{"step": 1}', deep, '{"step": "abc"}', '"text"', '{"step": 3}', '{"step": 2']) + "\n")
    assert cut_metrics_back(path, 2) == 4  # the deep line, the non-numeric step, step 3, the cut line
    assert path.read_text().splitlines() == ['{"step": 1}', '"text"']
