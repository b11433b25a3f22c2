"""scripts/make_shards.py (folder / parquet / CSV -> shards) and benchmarks/bench_data.py (a tiny run)."""

from __future__ import annotations

import json
import os
import sys
import tarfile

import forked
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_fixtures import jpeg_bytes, loader, png_bytes, take

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    out = forked.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr + out.stdout
    return out


def _members(tar_path):
    with tarfile.open(tar_path) as t:
        return sorted(m.name for m in t.getmembers())


def test_make_shards_from_a_folder_then_train_on_them(tmp_path):
    src = tmp_path / "src"
    (src / "images").mkdir(parents=True)
    (src / "captions").mkdir()
    for i in range(7):
        data = png_bytes(30, 20) if i == 3 else jpeg_bytes(40, 30, (i * 30, 0, 0))
        (src / "images" / f"img.{i}.{'png' if i == 3 else 'jpg'}").write_bytes(data)
        (src / "captions" / f"img.{i}.txt").write_text(f"folder caption {i}")
    (src / "images" / "broken.jpg").write_bytes(b"not an image")
    (src / "captions" / "broken.txt").write_text("x")
    out = _run("scripts/make_shards.py", str(src), str(tmp_path / "shards"), "--samples-per-shard", "3", "--quiet")
    pattern = out.stdout.strip().splitlines()[-1]
    assert pattern.endswith("shard-{000000..000002}.tar")
    sizes = json.loads((tmp_path / "shards" / "sizes.json").read_text())
    assert sizes == {"shard-000000.tar": 3, "shard-000001.tar": 3, "shard-000002.tar": 1}
    assert "bad_image" in out.stdout
    members = _members(tmp_path / "shards" / "shard-000001.tar")
    assert "img_3.png" in members and "img_3.json" in members and "img_3.txt" in members
    with tarfile.open(tmp_path / "shards" / "shard-000000.tar") as t:
        meta = json.loads(t.extractfile("img_0.json").read())
    assert (meta["width"], meta["height"]) == (40, 30) and meta["source"].endswith("img.0.jpg")
    ld = loader(pattern, batch_size=6, shuffle_buffer=1, filters={"width": ">=40"})
    b = take(ld, 1)[0]  # epoch 0: the 6 images 40 px wide (the 30 px png is filtered out)
    assert sorted(b["captions"]) == [f"folder caption {i}" for i in range(7) if i != 3]
    assert ld.stats()["skipped/filter:width"] == 1


def test_make_shards_from_parquet_and_csv(tmp_path):
    table = pa.table({"image": [jpeg_bytes() for _ in range(5)], "text": [f"pq {i}" for i in range(5)], "score": list(range(5))})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    out = _run("scripts/make_shards.py", str(tmp_path / "t.parquet"), str(tmp_path / "pq"), "--samples-per-shard", "2",
               "--prefix", "pq", "--quiet")
    pattern = out.stdout.strip().splitlines()[-1]
    b = take(loader(pattern, batch_size=5, shuffle_buffer=1, filters={"score": ">=0"}), 1)[0]
    assert sorted(b["captions"]) == [f"pq {i}" for i in range(5)]

    (tmp_path / "im").mkdir()
    rows = ["path,caption"]
    for i in range(4):
        (tmp_path / "im" / f"{i}.jpg").write_bytes(jpeg_bytes())
        rows.append(f"im/{i}.jpg,csv {i}")
    rows.append("im/missing.jpg,gone")
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    out = _run("scripts/make_shards.py", str(tmp_path / "d.csv"), str(tmp_path / "csv"), "--quiet",
               "--max-side", "16")
    pattern = out.stdout.strip().splitlines()[-1]
    assert "bad_image" in out.stdout
    ld = loader(pattern, batch_size=4, shuffle_buffer=1)
    b = take(ld, 1)[0]
    assert sorted(b["captions"]) == [f"csv {i}" for i in range(4)]


@pytest.mark.slow
def test_benchmark_runs_and_writes_its_json(tmp_path):
    out_json = tmp_path / "bench.json"
    _run("benchmarks/bench_data.py", "--samples", "40", "--repeats", "1", "--out", str(out_json),
         "--work-dir", str(tmp_path / "w"), "--workers", "0,2")
    result = json.loads(out_json.read_text())
    for case in ("reject_0", "reject_90", "reject_0_workers_2", "reject_90_workers_2"):
        r = result["results"][case]
        assert r["ours_samples_per_s"] > 0 and r["naive_samples_per_s"] > 0
        assert r["ratio"] == pytest.approx(r["ours_samples_per_s"] / r["naive_samples_per_s"], rel=1e-6)
        assert r["ours_samples_out"] == r["naive_samples_out"]
    # Skipping the decode of rejected samples must show even on 40 samples (CPU time: robust to a busy machine).
    assert result["results"]["reject_90"]["ratio_cpu"] > 1.5
