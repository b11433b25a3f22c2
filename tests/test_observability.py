"""Metrics the loop logs (FLOPs, MFU) and evaluation of the eval images, through a real run."""

import json
from pathlib import Path

import forked
import pytest
from conftest import train_args

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.loop import main as train

# In-process training: one intra-op thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def rows(run: Path):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def test_mfu_from_counted_flops_and_peak_override(tmp_path, tiny_pipeline, shapes_shards):
    run = Path(train(load(train_args(tmp_path, tiny_pipeline, shapes_shards, name="mfu", **{
        "experiment.peak_tflops": 0.5, "experiment.num_examples_to_see": 8, "experiment.sample_per_prompt": 0})))["run_dir"])
    r = [x for x in rows(run) if "mfu" in x][-1]
    # MFU = images/s/device x model FLOPs per image / peak, with the FLOPs counted once at start-up.
    assert r["mfu"] == pytest.approx(r["images_per_sec_per_device"] * r["model_tflops_per_image"] * 1e12 / 0.5e12)
    assert r["hfu"] > r["mfu"] > 0  # hardware FLOPs add the frozen VAE and text encoder
    assert "ETA" in (run / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", ["true", "false"])
def test_fid_of_eval_images_is_logged_with_its_step(tmp_path, tiny_pipeline, shapes_shards, asynchronous):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle on a blue background\na green square on a white background\n")
    run = Path(train(load(train_args(tmp_path, tiny_pipeline, shapes_shards, name=f"ev{asynchronous}", **{
        "experiment.num_examples_to_see": 8, "experiment.save_every": 2, "experiment.sample_per_prompt": 0,
        "experiment.num_eval_images": 4, "experiment.eval_caption_file": str(prompts),
        "evaluation.ref_images": shapes_shards, "evaluation.ref_max_images": 8,
        "evaluation.ref_stats": str(tmp_path / "ref.npz"), "evaluation.asynchronous": asynchronous})))["run_dir"])
    evals = {r["eval/step"]: r for r in rows(run) if "eval/fid" in r}  # the step whose weights were scored
    assert sorted(evals) == [2], evals  # the one export with eval images (steps 2 = last)
    assert evals[2]["eval/fid"] > 0 and evals[2]["eval/num_images"] == 4
    assert len(list((run / "eval" / "step_00000002").glob("*.png"))) == 4


def test_evaluation_needs_eval_images(tmp_path):
    base = ["experiment.name=x", "experiment.num_examples_to_see=8", "model.pretrained=/p", "dataset.params.path=x.tar"]
    with pytest.raises(ConfigError, match="num_eval_images"):
        load(base + ["evaluation.ref_images=/ref"])


def test_progress_bar_on_a_terminal_and_log_lines_otherwise(tmp_path, tiny_pipeline, shapes_shards):
    """On a terminal (a real pty here) training shows one bar redrawn in place, and the step lines go
    to train.log only; with output redirected the step lines are the progress, and there is no bar."""
    import os
    import pty
    import sys

    root = Path(__file__).resolve().parents[1]
    args = train_args(tmp_path, tiny_pipeline, shapes_shards, name="tty", **{
        "experiment.sample_per_prompt": 0, "dataset.params.resolution": 32})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    master, slave = pty.openpty()
    p = forked.popen([sys.executable, str(root / "train.py"), *args], stdin=slave, stdout=slave, stderr=slave,
                     env=env, cwd=tmp_path)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(timeout=300) == 0
    os.close(master)
    screen = b"".join(chunks).decode(errors="replace")
    assert "\rtrain:" in screen and "8/8" in screen and "img/s" in screen  # the bar, redrawn in place
    assert "step 3/8 loss" not in screen  # not scrolled as log lines
    assert "step 3/8 loss" in (tmp_path / "runs" / "tty" / "train.log").read_text()  # the log keeps them
    res = forked.run([sys.executable, str(root / "train.py"), *args, "experiment.name=piped"],
                     capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0 and "step 3/8 loss" in res.stdout and "\r" not in res.stdout
