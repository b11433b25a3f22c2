"""scripts/generate_examples.py (pipeline or checkpoint -> images, split across ranks, resumable) and
scripts/plot_metrics.py (metrics.jsonl -> PNG)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import train_args
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared 2-core machine
GEN = ["--steps", "2", "--resolution", "64", "--device", "cpu", "--no-progress"]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pixels(path):
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


@pytest.fixture
def prompts_csv(tmp_path):
    path = tmp_path / "captions.csv"
    path.write_text("url,caption\nx,a red circle on a blue background\ny,a green square on a white background\n")
    return path


def test_generate_from_pipeline_then_resume(tmp_path, tiny_pipeline, prompts_csv):
    gen = _script("generate_examples")
    out = tmp_path / "images"
    args = ["--prompts", str(prompts_csv), "--out", str(out), "--pipeline", str(tiny_pipeline), *GEN]
    written = gen.main([*args, "--num-images", "3"])
    assert [p.name for p in written] == ["000000.png", "000001.png", "000002.png"]
    assert Image.open(written[0]).size == (64, 64)
    # Image i takes prompt i % len(prompts); the prompt is written beside it.
    assert (out / "000002.txt").read_text().strip() == "a red circle on a blue background"
    assert (out / "000001.txt").read_text().strip() == "a green square on a white background"
    before = {p.name: p.stat().st_mtime_ns for p in written}
    again = gen.main([*args, "--num-images", "4"])  # an interrupted job rerun: only the missing image is made
    assert len(again) == 4
    assert {p.name: p.stat().st_mtime_ns for p in again[:3]} == before
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".png") == [f"{i:06d}.png" for i in range(4)]


def test_two_ranks_make_the_same_images_as_one(tmp_path, tiny_pipeline):
    import torch

    from sd_training.evaluation.generate import generate_images, load_pipeline

    pipe = load_pipeline(str(tiny_pipeline), torch.device("cpu"))
    prompts = ["a red circle", "a blue square", "a yellow triangle"]
    kw = dict(steps=2, resolution=64, progress=False, batch_size=2)
    one = generate_images(pipe, prompts, 5, tmp_path / "one", **kw)
    mine = [generate_images(pipe, prompts, 5, tmp_path / "two", rank=r, world_size=2, **kw) for r in (0, 1)]
    assert [p.name for p in mine[0]] == ["000000.png", "000002.png", "000004.png"]
    assert [p.name for p in mine[1]] == ["000001.png", "000003.png"]
    for p in one:
        # Same seed per image whatever the split; batching may change the last bit of a few pixels.
        assert np.abs(_pixels(p) - _pixels(tmp_path / "two" / p.name)).max() <= 2


@pytest.mark.slow
def test_generate_from_checkpoint_equals_the_exported_pipeline(tmp_path, tiny_pipeline, shapes_shards, prompts_csv):
    from sd_training.configure import load
    from sd_training.loop import main as train

    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, name="gen", **{
        "experiment.num_examples_to_see": 8, "experiment.sample_per_prompt": 0, "model.use_ema": True,
        "model.ema.decay": 0.5}))
    run = Path(train(cfg)["run_dir"])
    gen = _script("generate_examples")
    common = ["--prompts", str(prompts_csv), "--num-images", "2", *GEN]
    from_ckpt = gen.main([*common, "--out", str(tmp_path / "ckpt"), "--checkpoint", str(run)])
    from_pipe = gen.main([*common, "--out", str(tmp_path / "pipe"), "--pipeline", str(run / "current_pipeline")])
    for a, b in zip(from_ckpt, from_pipe):
        assert np.abs(_pixels(a) - _pixels(b)).max() <= 1
    ema = gen.main([*common, "--out", str(tmp_path / "ema"), "--checkpoint", str(run / "checkpoints"), "--ema"])
    ema_pipe = gen.main([*common, "--out", str(tmp_path / "ema_pipe"), "--pipeline", str(run / "current_pipeline_ema")])
    assert np.abs(_pixels(ema[0]) - _pixels(ema_pipe[0])).max() <= 1
    assert np.abs(_pixels(ema[0]) - _pixels(from_ckpt[0])).max() > 0  # EMA weights differ from the raw ones
    with pytest.raises(FileNotFoundError):
        gen.find_checkpoint(str(tmp_path))


def test_plot_metrics_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    plot = _script("plot_metrics")
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 1.0 / s, **{f"loss_q{i}": 1.0 / s + i for i in range(4)}, "lr": 1e-4 * min(s, 5) / 5,
             "images_per_sec": 100.0 + s, "images_per_sec_per_device": 50.0 + s, "grad_norm": 1.0} for s in range(1, 21)]
    rows[3]["loss"] = float("nan") and None  # a non-finite loss is logged as null
    rows.insert(10, {"step": 8, "loss": 0.5, "lr": 1e-4, "images_per_sec": 90.0})  # a resumed run logs step 8 again
    rows.append({"step": 20, "eval/step": 10, "eval/fid": 123.0, "eval/clip_score": 21.5})
    lines = [json.dumps(r) for r in rows] + ['{"step": 21, "loss": 0.0']  # a cut last line
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    m = plot.read_metrics(run / "metrics.jsonl")
    assert dict(m["loss"])[8] == 0.5 and 4 not in dict(m["loss"])
    assert m["eval/fid"] == [(10, 123.0)]
    assert [s for s, _ in m["lr"]] == list(range(1, 21))
    out = plot.main([str(run), "--smooth", "3"])
    assert out == run / "metrics.png"
    im = Image.open(out)
    assert im.format == "PNG" and im.size[0] > 500 and im.size[1] > 4 * 200  # 4 panels: loss, images/s, lr, eval
    assert np.asarray(im.convert("L")).std() > 5  # not a blank canvas
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "missing")])
