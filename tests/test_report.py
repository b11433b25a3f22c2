"""The run report (sd_training.report): report.html written at every export of a real tiny run, opened in
headless Chromium (Debian's package; scripts/ci_install_browser.sh) and checked on the screenshot; the
metrics-to-panels logic on synthetic metrics.jsonl files; the export hook's failures; the CLIs."""

import base64
import importlib.util
import io
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import train_args
from PIL import Image

from sd_training.configure import load
from sd_training.report import refresh_after_export, write_report
from sd_training.report.series import panels, read_metrics, smooth

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # in-process training of a tiny model
MATPLOTLIB_BLUE = (31, 119, 180)  # the first series' colour (C0) of every panel


def write_jsonl(path: Path, rows: list, tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


# -- metrics -> panels ------------------------------------------------------------------------------
def test_smoothing_is_a_trailing_mean():
    assert smooth([1.0, 2.0, 3.0, 4.0, 5.0], 1) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert smooth([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert smooth([3.0, 0.0, 3.0, 6.0], 3) == [3.0, 1.5, 2.0, 3.0]  # the first points average what there is


def test_resumed_steps_keep_the_last_value_and_bad_lines_are_skipped(tmp_path, caplog):
    rows = [{"step": s, "loss": 10.0 + s, "lr": 0.1} for s in range(1, 7)]
    rows += [{"step": 5, "loss": 1.5}, {"step": 6, "loss": 1.6}]  # a resume at step 4 logs 5 and 6 again
    rows += [{"step": 7, "loss": None}, {"step": 3, "loss": None}]  # non-finite (logged as null)
    rows += [{"step": 8, "eval/step": 4, "eval/fid": 90.0}, {"step": 8, "samples": "samples/step_00000008.png"}]
    path = write_jsonl(tmp_path / "metrics.jsonl", rows, tail='{"step": 9, "loss": 0.')  # cut by a kill
    with caplog.at_level(logging.WARNING):
        m = read_metrics(path)
    assert m["loss"] == [(1, 11.0), (2, 12.0), (4, 14.0), (5, 1.5), (6, 1.6)]  # step 3's null replaced its value
    assert m["eval/fid"] == [(4, 90.0)] and "samples" not in m
    assert "metrics.jsonl:13 is not JSON" in caplog.text


def test_panels_follow_the_keys_present(tmp_path):
    rows = [{"step": s, "loss": 1.0 / s, "loss_q0": 0.5, "loss_q3": 2.0, "lr": 1e-4, "grad_norm": 2.0,
             "data/source/laion/share": 0.75, "data/source/cc12m/share": 0.25, "data/skipped_total": 3}
            for s in range(1, 101)]
    m = read_metrics(write_jsonl(tmp_path / "m.jsonl", rows))
    got = {p.spec.name: p for p in panels(m)}
    assert list(got) == ["loss", "loss_by_timestep", "learning_rate", "sources", "grad_norm"]  # no val, MFU, memory
    assert [s.label for s in got["loss_by_timestep"].series][0].startswith("t in quartile 0")
    assert len(got["loss_by_timestep"].series) == 2  # q1, q2 never logged: left out of the panel
    assert sorted(s.label for s in got["sources"].series) == ["cc12m", "laion"]
    loss = got["loss"]
    assert loss.window == 5 and loss.series[0].smoothed == smooth(loss.series[0].values, 5)  # 100 points / 20
    assert got["learning_rate"].series[0].smoothed is None and got["learning_rate"].window == 1
    assert {p.spec.name for p in panels(m, window=1)} == set(got)
    assert panels({}) == []


def test_loss_by_timestep_quartile_over_two_ranks(tmp_path):
    """loss_q0..q3 are reduced as sums and counts (gloo, 2 processes): a rank without a sample in a quartile
    does not pull its mean to 0, and a quartile with no sample at all is not logged."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_quartiles_on_rank, args=(port, tmp_path), nprocs=2, start_method="fork")
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        # q0: rank 0's two samples (1, 3) and rank 1's one (5); q1: rank 1 only; q2: nobody; q3: rank 0 only.
        assert got == pytest.approx({"loss_q0": 3.0, "loss_q1": 4.0, "loss_q3": 8.0})


def _quartiles_on_rank(rank, port, out):
    import torch
    import torch.distributed as dist

    from sd_training.outputs.metrics import quartile_losses

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        sums = {0: ([4.0, 0.0, 0.0, 8.0], [2.0, 0.0, 0.0, 1.0]), 1: ([5.0, 4.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0])}[rank]
        got = quartile_losses(torch.tensor(sums[0]), torch.tensor(sums[1]))
        (out / f"{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


# -- a real run's report in a real browser ----------------------------------------------------------------
@pytest.fixture(scope="module")
def report_run(tmp_path_factory, tiny_pipeline, shapes_shards):
    """6 steps of a tiny run (bf16 autocast on the CPU, a loader worker, a 3:1 mixture of two sources,
    validation, MFU against a stated peak), exports and sample grids at steps 3 and 6."""
    from sd_training.loop import main as train

    pytest.importorskip("matplotlib")
    tmp = tmp_path_factory.mktemp("report")
    half_a = shapes_shards.replace("{000000..000003}", "{000000..000001}")
    half_b = shapes_shards.replace("{000000..000003}", "{000002..000003}")
    sources = f"[{{path: '{half_a}', name: a, weight: 3}}, {{path: '{half_b}', name: b}}]"
    args = [a for a in train_args(tmp, tiny_pipeline, shapes_shards, name="rep", **{"experiment.report": "true"})
            if not a.startswith("dataset.params.path=")]
    args += [f"dataset.params.sources={sources}", "system.workers=1", "model.mixed_precision=bf16",
             "experiment.num_examples_to_see=24", "experiment.save_every=3", "dataset.params.resolution=32",
             "experiment.sample_resolution=32", "experiment.peak_tflops=0.05", f"validation.path={shapes_shards}",
             "validation.num_batches=1"]
    out = train(load(args))
    assert out["step"] == 6
    return Path(out["run_dir"])


def test_the_run_writes_a_self_contained_report_at_every_export(report_run):
    run = report_run
    assert (run / "train.log").read_text().count("run report") == 2  # refreshed at steps 3 and 6
    page = (run / "report.html").read_text()
    for external in ("http://", "https://", "<script", "<link", "@import", "url("):  # offline-readable
        assert external not in page, external
    uris = re.findall(r'src="data:(image/(?:png|jpeg));base64,([^"]+)"', page)
    assert len(uris) == len(re.findall(r"<img ", page)) >= 12
    for _, data in uris:
        Image.open(io.BytesIO(base64.b64decode(data))).verify()  # every embedded image decodes
    names = set(re.findall(r'class="plot" data-name="(\w+)"', page))
    assert names == {"loss", "loss_by_timestep", "validation_loss", "learning_rate", "throughput", "mfu",
                     "data_wait", "sources", "grad_norm", "nonfinite"}
    assert {p.stem for p in (run / "report").glob("*.png")} == names  # the PNGs beside it
    assert re.findall(r'class="grid[^"]*" data-step="(\d+)"', page) == ["3", "6"]  # side by side, in order
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last_loss = [r["loss"] for r in rows if "loss" in r][-1]
    for cell in ("<td>6 of 6</td>", "<td>24</td>", "<td>bf16 autocast</td>", f"<td>{last_loss:.4g} at step 6</td>",
                 "config.yaml</summary>", "a red circle on a blue background"):
        assert cell in page, cell


PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.querySelectorAll('img')].map(im => { const r = im.getBoundingClientRect();
    return {cls: im.className, key: im.dataset.name || im.dataset.step, decoded: im.naturalWidth > 0,
            x: r.left + window.scrollX, y: r.top + window.scrollY, w: r.width, h: r.height}; });
  const pre = document.createElement('pre'); pre.id = 'probe'; pre.style.display = 'none';
  pre.textContent = JSON.stringify({images: imgs, height: document.documentElement.scrollHeight});
  document.body.appendChild(pre);
});
</script></body>"""


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.geteuid() == 0:
            pytest.fail("chromium is missing although this runs as root: scripts/test.sh installs it with "
                        "scripts/ci_install_browser.sh (run that)")
        pytest.skip("no chromium and not root to install it: sudo scripts/ci_install_browser.sh")
    return exe


def browse(page: str, folder: Path, name: str) -> tuple[list[dict], np.ndarray]:
    """Open ``page`` in headless Chromium: the layout and decode state of every <img> (a probe script added
    to a copy of the page, read back with --dump-dom), then a screenshot of the whole page at that layout."""
    exe, html_path = chromium(), folder / f"{name}.html"
    html_path.write_text(page.replace("</body>", PROBE))
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1",
             f"--user-data-dir={folder / 'chromium-profile'}"]
    dom = subprocess.run([*flags, "--window-size=1500,1000", "--dump-dom", html_path.as_uri()], capture_output=True,
                         text=True, timeout=120)
    probe = re.search(r'<pre id="probe"[^>]*>(.*?)</pre>', dom.stdout, re.S)
    assert probe, f"chromium --dump-dom gave no probe (rc {dom.returncode}): {dom.stderr[-2000:]}"
    layout = json.loads(probe.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    shot = folder / f"{name}.png"
    res = subprocess.run([*flags, f"--window-size=1500,{layout['height'] + 20}", f"--screenshot={shot}",
                          html_path.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.is_file(), f"no screenshot (rc {res.returncode}): {res.stderr[-2000:]}"
    return layout["images"], np.asarray(Image.open(shot).convert("RGB"), dtype=np.int16)


def painted(img: dict, shot: np.ndarray) -> str | None:
    """Why the image's box on the screenshot is not a drawn plot / sample grid (None: it is)."""
    if not img["decoded"]:
        return "not decoded"
    x, y, w, h = (round(img[k]) for k in ("x", "y", "w", "h"))
    box = shot[y + 1 : y + h - 1, x + 1 : x + w - 1]  # inside the 1 px border
    if box.size == 0 or box.shape[0] < h - 2 or box.shape[1] < w - 2:
        return f"box {w}x{h} at ({x}, {y}) outside the screenshot {shot.shape[1]}x{shot.shape[0]}"
    if img["cls"] == "plot":
        curve = (np.abs(box - np.array(MATPLOTLIB_BLUE)).sum(axis=2) < 60).sum()
        ink = (box.sum(axis=2) < 600).mean()
        return None if curve >= 100 and ink > 0.01 else f"no curve drawn ({curve} curve pixels, {ink:.3f} ink)"
    colours = len(np.unique(box.reshape(-1, 3), axis=0))
    return None if box.std() > 10 and colours > 50 else f"blank grid (std {box.std():.1f}, {colours} colours)"


def test_the_report_renders_in_a_headless_browser(report_run, tmp_path):
    page = (report_run / "report.html").read_text()
    images, shot = browse(page, tmp_path, "report")
    assert len(images) == 12 and {i["cls"].split()[0] for i in images} == {"plot", "grid"}
    failures = {i["key"]: painted(i, shot) for i in images if painted(i, shot)}
    assert not failures, failures
    # The check bites: the same page with the loss plot and the first grid broken (valid base64, not an
    # image) is caught on exactly those two.
    broken = re.sub(r'(data-name="loss" [^>]*src="data:image/png;base64,)[^"]+', r"\1" + "QUJD" * 50, page, count=1)
    broken = re.sub(r'(data-step="3" [^>]*src="data:image/\w+;base64,)[^"]+', r"\1" + "QUJD" * 50, broken, count=1)
    images, shot = browse(broken, tmp_path, "broken")
    assert {i["key"]: painted(i, shot) for i in images if painted(i, shot)} == {"loss": "not decoded", "3": "not decoded"}
    # ... and a page whose plot is decoded but blank (a white PNG) is caught on its pixels.
    buf = io.BytesIO()
    Image.new("RGB", (700, 320), "white").save(buf, "PNG")
    white = base64.b64encode(buf.getvalue()).decode()
    blank = re.sub(r'(data-name="grad_norm" [^>]*src="data:image/png;base64,)[^"]+', r"\1" + white, page, count=1)
    images, shot = browse(blank, tmp_path, "blank")
    assert [k for k in (i["key"] for i in images if painted(i, shot))] == ["grad_norm"]


# -- the hook and the CLIs --------------------------------------------------------------------------------
def test_the_export_hook_never_raises(tmp_path, tiny_pipeline, shapes_shards, monkeypatch, caplog):
    from sd_training.families.registry import DEFAULT_FAMILY, FAMILIES

    family = FAMILIES[DEFAULT_FAMILY]
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"experiment.report": "true"}))
    run = tmp_path / "runs" / "run"
    run.mkdir(parents=True)
    write_jsonl(run / "metrics.jsonl", [{"step": s, "loss": 1.0, "images_seen": 4 * s} for s in range(1, 4)])
    (run / "report").write_text("a file where the report's folder goes")  # drawing fails
    with caplog.at_level(logging.WARNING):
        refresh_after_export(cfg, run, family, world_size=1)
    assert "report.html) could not be written, training goes on" in caplog.text and not (run / "report.html").exists()
    (run / "report").unlink()
    caplog.clear()
    refresh_after_export(load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"experiment.report": "false"})),
                         run, family, world_size=1)
    assert not (run / "report.html").exists()  # experiment.report=false: nothing written
    monkeypatch.setattr("sd_training.report._warned_missing", False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            refresh_after_export(cfg, run, family, world_size=1)
    assert caplog.text.count("pip install 'sd-training[plots]'") == 1  # one warning per process
    assert "experiment.report=false" in caplog.text and not (run / "report.html").exists()


def test_report_cli_on_a_run_folder(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "copied_run"
    run.mkdir()
    (run / "config.yaml").write_text("experiment: {name: copied_run, num_examples_to_see: 80}\n"
                                     "model: {family: auto, mixed_precision: 'no'}\n")
    write_jsonl(run / "metrics.jsonl", [{"step": s, "loss": 2.0 / s, "lr": 1e-4, "images_seen": 8 * s,
                                         "nonfinite_steps": 0} for s in range(1, 7)])
    (run / "samples").mkdir()
    Image.new("RGB", (1024, 512), "red").save(run / "samples" / "step_00000006.png")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "report.py"), str(run)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(run / "report.html")
    page = (run / "report.html").read_text()
    assert "<td>6 of 10</td>" in page and "<td>8</td>" in page  # global batch = images_seen / step
    assert "fp32 (no autocast)" in page and 'data-step="6"' in page
    thumb = re.search(r'data-step="6" [^>]*src="data:image/png;base64,([^"]+)"', page).group(1)
    assert Image.open(io.BytesIO(base64.b64decode(thumb))).size == (640, 320)  # downscaled before embedding
    # plot_metrics.py --report writes the same page (in this process: one start-up of torch is enough);
    # a folder that is no run is refused.
    (run / "report.html").unlink()
    assert _script("plot_metrics").main([str(run), "--report"]) == run / "report.html"
    assert (run / "report.html").read_text().count("<img ") == page.count("<img ")
    with pytest.raises(SystemExit, match="is not a run folder"):
        _script("report").main([str(tmp_path / "nothing")])
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        write_report(tmp_path / "nothing")


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
