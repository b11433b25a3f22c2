"""scripts/preview_data.py: a contact sheet of the training loader's first samples (after filters, buckets,
crops, flips, caption dropout) with their labels, the filters' pass-rates, mask outlines; and its JSON sidecar."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from data_fixtures import write_tar
from PIL import Image

from sd_training.data.synthetic import COLOURS, shape_sample, write_masked_shards, write_shapes_shards

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "preview_data.py"
PAD, LINE, LABEL_LINES = 6, 14, 4  # the script's layout


def run_preview(tmp_path, config: dict, *args):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "sheet.png"
    res = subprocess.run([sys.executable, str(SCRIPT), f"config={path}", "--out", str(out), *map(str, args)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout, np.asarray(Image.open(out).convert("RGB")), json.loads(out.with_suffix(".json").read_text())


def base_config(**params):
    return {"experiment": {"name": "preview", "num_examples_to_see": 100}, "model": {"pretrained": "not-loaded"},
            "system": {"batch_size": 2}, "dataset": {"params": {"resolution": 64, "shuffle_buffer": 4, **params}}}


def test_mixture_with_a_filter_buckets_flips_and_dropout(tmp_path):
    square = write_shapes_shards(str(tmp_path / "sq"), 24, 3, size=64, seed=0, prefix="sq")
    wide = write_shapes_shards(str(tmp_path / "wide"), 16, 2, seed=0, prefix="wide", sizes=[(96, 64), (64, 96)])
    keep = {"circle", "square"}
    passing = sum(shape_sample(i, 64, 0)[3]["shape"] in keep for i in range(24))
    assert 0 < passing < 24
    config = base_config(aspect_buckets=True, bucket_step=16, center_crop=False, random_flip=0.5, caption_dropout=0.5,
                         sources=[{"path": square, "name": "squares", "weight": 1,
                                   "filters": {"shape": "in [circle, square]"}},
                                  {"path": wide, "name": "wide", "weight": 1}])
    stdout, png, meta = run_preview(tmp_path, config, "--n", 7, "--cols", 3, "--tile", 64, "--scan-units", "all")
    # Pass-rates over every unit: the filter's exact count, printed and in the sidecar.
    row = next(r for r in meta["scan"]["rows"] if r["source"] == "squares")
    assert (row["filter"], row["checked"], row["passed"]) == ("shape", 24, passing)
    assert f"filter shape in [circle, square]: {passing} of 24 pass ({passing / 24:.1%})" in stdout
    wide_scan = next(s for s in meta["scan"]["sources"] if s["name"] == "wide")
    assert (wide_scan["read"], wide_scan["accepted"], wide_scan["units_scanned"]) == (16, 16, 2)
    # The layout: 3 columns, 3 rows of cells under the header; the two cells after the 7th are empty.
    cell_w, cell_h = 64 + 2 * PAD, 64 + 2 + LABEL_LINES * LINE + 2 * PAD
    head = meta["header_height"]
    assert png.shape == (head + 3 * cell_h, 3 * cell_w, 3) and meta["n"] == len(meta["tiles"]) == 7
    for slot in (7, 8):
        x, y = (slot % 3) * cell_w, head + (slot // 3) * cell_h
        assert (png[y:y + cell_h, x:x + cell_w] == 255).all()
    assert (png[:head] < 100).any()  # the header's text
    tiles = meta["tiles"]
    assert {t["source"] for t in tiles} == {"squares", "wide"}
    assert any(t["dropped"] for t in tiles) and not all(t["dropped"] for t in tiles)
    for i, t in enumerate(tiles):
        assert t["cell"] == [(i % 3) * cell_w, head + (i // 3) * cell_h, (i % 3 + 1) * cell_w, head + (i // 3 + 1) * cell_h]
        size = 64 if t["source"] == "squares" else [(96, 64), (64, 96)][int(t["key"]) % 2]
        _, _, caption, m = shape_sample(int(t["key"]), size, 0)
        if t["source"] == "squares":
            assert m["shape"] in keep  # only what passed the filter is shown
        assert t["caption"] == ("" if t["dropped"] else caption)
        w, h = t["bucket"]
        assert (w, h) == (64, 64) if isinstance(size, int) else (w > h) == (size[0] > size[1]) and w * h <= 64 * 64
        x0, y0, x1, y1 = t["box"]  # the picture, fitted to the tile keeping the bucket's shape
        assert max(x1 - x0, y1 - y0) == 64 and abs((x1 - x0) / (y1 - y0) - w / h) < 0.05
        corner = png[y0 + 1, x0 + 1].astype(int)  # the background, wherever the crop and flip put the shape
        assert np.abs(corner - COLOURS[m["background"]]).max() < 40, (t, corner)
        label = png[y1 + 1:t["cell"][3], t["cell"][0]:t["cell"][2]]
        assert (label < 100).any()  # text under every tile


def test_mask_outlines_with_a_worker(tmp_path):
    path = write_masked_shards(str(tmp_path / "m"), 8, 1, sizes=[(96, 64)], seed=0)
    _, png, meta = run_preview(tmp_path, base_config(path=path, masked_loss=True), "--n", 4, "--cols", 2,
                               "--workers", 1, "--scan-units", 1)
    magenta = (png[..., 0] > 230) & (png[..., 1] < 30) & (png[..., 2] > 230)
    for t in meta["tiles"]:
        assert t["masked"] and 0 < t["mask_mean"] < 0.5
        x0, y0, x1, y1 = t["box"]
        assert magenta[y0:y1, x0:x1].sum() > 20  # the square's outline
    assert magenta.sum() == sum(magenta[t["box"][1]:t["box"][3], t["box"][0]:t["box"][2]].sum() for t in meta["tiles"])


def test_latent_shards_show_false_colour_and_labels(tmp_path):
    """Latent shards preview without a decoder: their first channels in false colour, labelled the same way."""
    from data_fixtures import make_cfg

    from sd_training.data import build_train_loader
    from sd_training.data.latents import npy_bytes
    from sd_training.data.preview import NoTokens, collect_tiles

    rng = np.random.default_rng(0)
    samples = [{"__key__": f"k{i}", "latents.npy": npy_bytes(rng.standard_normal((4, 8, 6)).astype(np.float16)),
                "txt": f"caption {i}", "json": {"latent_store": "sample"}} for i in range(6)]
    shard = write_tar(str(tmp_path / "lat.tar"), samples)
    cfg = make_cfg(shard, type="latents", resolution=64, batch_size=2, caption_dropout=0.5)
    ld = build_train_loader(cfg, tokenizer=NoTokens(), rank=0, world_size=1, seed=0)
    tiles = collect_tiles(ld, 5)
    assert [t["image"].shape for t in tiles] == [(64, 48, 3)] * 5 and all(t["bucket"] == [48, 64] for t in tiles)
    assert all(t["caption"] == ("" if t["dropped"] else f"caption {t['key'][1:]}") for t in tiles)
    assert {t["source"] for t in tiles} == {shard} and len({t["key"] for t in tiles}) == 5


def test_config_errors_are_one_line(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("preview_data", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(base_config(path=str(tmp_path / "nothing-{0..3}.tar"))))
    assert script.main([f"config={path}", "dataset.params.unmasked_weight=0.5"]) == 2
    assert "config error: dataset.params.unmasked_weight=0.5 only applies with" in capsys.readouterr().err
    assert script.main([f"config={path}"]) == 2  # no shard exists: named
    assert "none of the 4 shard(s)" in capsys.readouterr().err


def test_edit_pairs_are_shown_side_by_side(tmp_path):
    """Edit pairs: each reference, then the target, in one picture (the target's bucket in the label)."""
    from sd_training.data.synthetic import edit_sample, read_shape_image, write_edit_shards

    path = write_edit_shards(str(tmp_path / "e"), 8, 2, size=64, references=2, seed=0)
    config = base_config(path=path, references=2, random_flip=0.5, center_crop=False)
    _, png, meta = run_preview(tmp_path, config, "--n", 4, "--cols", 2, "--tile", 128, "--scan-units", 1)
    for t in meta["tiles"]:
        assert t["references"] == 2 and t["bucket"] == [64, 64] and t["target_left"] == 2 * (64 + 2)
        x0, y0, x1, y1 = t["box"]  # 3 pictures of 64 px and 2 gaps of 2 px, fitted into 128 px
        assert x1 - x0 == 128 and abs((x1 - x0) / (y1 - y0) - (3 * 64 + 4) / 64) < 0.1
        pair = edit_sample(int(t["key"]), 64, 0, references=2)
        scale = (x1 - x0) / (3 * 64 + 4)
        for k, colour in enumerate([*pair.backgrounds, "blue"]):  # each picture's background, left to right
            left = x0 + round(k * 66 * scale)
            picture = png[y0 + 1:y1 - 1, left + 1:left + round(64 * scale) - 1]
            assert read_shape_image(picture)["background"] == colour, (t["key"], k, colour)
