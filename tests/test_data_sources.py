"""Parquet, CSV, local folders (flat and metadata layouts), classification datasets, http(s) shards."""

from __future__ import annotations

import functools
import http.server
import json
import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_fixtures import all_keys, jpeg_bytes, loader, take, write_shards, write_tar

from sd_training.data import DatasetConfigError

_IMAGENET = os.path.join(os.path.dirname(__file__), "..", "scripts", "metadata", "imagenet_idx_to_prompt.json")


def _colour(i):
    return (i * 20 % 256, 80, 160)


def test_parquet_bytes_hf_struct_and_paths(tmp_path):
    n = 24
    table = pa.table(
        {
            "key": [f"p{i:03d}" for i in range(n)],
            "jpg": [jpeg_bytes(40, 32, _colour(i)) for i in range(n)],
            "caption": [f"parquet caption {i}" for i in range(n)],
            "width": list(range(n)),
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=5)  # 5 row groups: 5+5+5+5+4
    batches = take(loader(str(tmp_path / "a.parquet"), type="parquet", batch_size=4, shuffle_buffer=1), 6)
    keys = all_keys(batches)
    assert sorted(keys) == [f"p{i:03d}" for i in range(n)]
    assert all(c == f"parquet caption {int(k[1:])}" for b in batches for k, c in zip(b["keys"], b["captions"]))
    # Metadata columns reach the filters.
    batches = take(loader(str(tmp_path), type="parquet", batch_size=4, shuffle_buffer=1, filters={"width": "<8"}), 2)
    assert sorted(all_keys(batches)) == [f"p{i:03d}" for i in range(8)]

    # Hugging Face Image struct, and image paths relative to the table's folder.
    (tmp_path / "imgs").mkdir()
    for i in range(8):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(jpeg_bytes(40, 40, _colour(i)))
    hf = pa.table({"image": [{"bytes": jpeg_bytes(), "path": None}] * 8, "text": [f"hf {i}" for i in range(8)]})
    pq.write_table(hf, tmp_path / "hf.parquet", row_group_size=2)
    b = take(loader(str(tmp_path / "hf.parquet"), type="parquet", batch_size=8, shuffle_buffer=1), 1)[0]
    assert sorted(b["captions"]) == [f"hf {i}" for i in range(8)]
    paths = pa.table({"filepath": [f"imgs/{i}.jpg" for i in range(8)], "title": [f"path {i}" for i in range(8)]})
    pq.write_table(paths, tmp_path / "paths.parquet", row_group_size=2)
    b = take(loader(str(tmp_path / "paths.parquet"), type="parquet", batch_size=8, shuffle_buffer=1), 1)[0]
    assert sorted(b["captions"]) == [f"path {i}" for i in range(8)]


def test_parquet_errors_name_the_column(tmp_path):
    pq.write_table(pa.table({"pixels": [b"x"], "words": ["y"]}), tmp_path / "t.parquet")
    with pytest.raises(DatasetConfigError, match="image_column.*columns: \\['pixels', 'words'\\]"):
        loader(str(tmp_path / "t.parquet"), type="parquet", resampled=True)
    with pytest.raises(DatasetConfigError, match="caption_column='nope'"):
        loader(str(tmp_path / "t.parquet"), type="parquet", image_column="pixels", caption_column="nope", resampled=True)


def test_csv_paths_quoted_newlines_and_chunks(tmp_path):
    (tmp_path / "imgs").mkdir()
    rows = ["filepath,title,score"]
    for i in range(30):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(jpeg_bytes(36, 36, _colour(i)))
        title = f'"csv, caption\nnumber {i}"' if i % 7 == 0 else f"csv caption {i}"
        rows.append(f"imgs/{i}.jpg,{title},{i}")
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    ld = loader(str(tmp_path / "d.csv"), type="CSV", batch_size=5, shuffle_buffer=1, samples_per_shard=4,
                filters={"score": ">=10"})
    assert len(ld.plan.units) == 8  # 30 rows in chunks of 4
    batches = take(ld, 4)
    caps = sorted(c for b in batches for c in b["captions"])
    assert len(caps) == 20 and "csv, caption\nnumber 14" in caps and "csv caption 29" in caps
    assert ld.stats()["filter/score/pass_rate"] == pytest.approx(20 / 30)

    # TSV, images given by an absolute path and an explicit column choice.
    lines = ["img\tcap"] + [f"{tmp_path / 'imgs' / f'{i}.jpg'}\tt{i}" for i in range(6)]
    (tmp_path / "e.tsv").write_text("\n".join(lines) + "\n")
    b = take(loader(str(tmp_path / "e.tsv"), type="CSV", image_column="img", caption_column="cap", batch_size=6,
                    shuffle_buffer=1), 1)[0]
    assert sorted(b["captions"]) == [f"t{i}" for i in range(6)]


def test_folder_flat_layout(tmp_path):
    (tmp_path / "images" / "sub").mkdir(parents=True)
    (tmp_path / "captions" / "sub").mkdir(parents=True)
    for i in range(6):
        rel = f"sub/{i}" if i % 2 else f"{i}"
        (tmp_path / "images" / f"{rel}.{'png' if i == 3 else 'jpg'}").write_bytes(jpeg_bytes(40, 40, _colour(i)))
        if i != 5:
            (tmp_path / "captions" / f"{rel}.txt").write_text(f"flat {i}\n")
    ld = loader(str(tmp_path), type="folder", batch_size=5, shuffle_buffer=1)
    b = take(ld, 1)[0]
    assert sorted(b["captions"]) == [f"flat {i}" for i in range(5)]  # 5 has no caption: skipped, counted
    assert ld.stats()["skipped/missing_caption"] == 1


def test_folder_metadata_layout_with_seed000_tag_controls(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "metadata" / "a").mkdir(parents=True)
    entries = {
        0: {"tags": ["oc", "solo", "high res", "artist:lulu"], "score": 250},  # kept: 250 + 100 (solo)
        1: {"tags": ["oc", "animated"], "score": 900},  # blacklisted
        2: {"tags": ["duo", "monochrome"], "score": 210},  # 210 + 100 - 75 = 235 >= 200: kept
        3: {"tags": ["sketch"], "score": 240},  # 240 - 75 = 165 < 200
        4: {"tags": ["oc"], "score": 40},  # below abs_min_score
        5: {"tags": ["princess luna", "solo"], "score": 3300},
    }
    for i, e in entries.items():
        (tmp_path / "images" / f"{i}.jpg").write_bytes(jpeg_bytes(40, 40, _colour(i)))
        (tmp_path / "metadata" / "a" / f"{i}.json").write_text(json.dumps({**e, "path": f"images/{i}.jpg"}))
    (tmp_path / "metadata" / "a" / "9.json").write_text("{broken")
    kw = {
        "tags.blacklist_tags": ["animated"],
        "tags.non_caption_tags": ["high res"],
        "tags.replacements": {"princess luna": "luna", "artist:": "by=", ":": "=", " ": "_"},
        "tags.tag_separator": " ",
        "tags.abs_min_score": 50,
        "tags.min_score": 200,
        "tags.tag_bonus_scores": {"solo": 100, "duo": 100, "monochrome": -75, "sketch": -75},
        "tags.score_tags": [3200, 1600, 800, 200],
    }
    ld = loader(str(tmp_path), type="folder", batch_size=3, shuffle_buffer=1, samples_per_shard=100, **kw)
    b1, b2 = take(ld, 2)  # one unit of 7 files read in order: epoch 0, then epoch 1 up to file 5
    for b in (b1, b2):
        assert b["captions"] == ["oc solo by=lulu scr200", "duo monochrome scr200", "luna solo scr3200"]
    st = ld.stats()
    assert st["skipped/blacklisted_tag"] == 2 and st["skipped/score_below_min"] == 2
    assert st["skipped/score_below_abs_min"] == 2 and st["skipped/bad_json"] == 1
    # consider_every_nth: every 2nd json in sorted order (0, 2, 4, 9 -> 0 and 2 survive the rules).
    ld = loader(str(tmp_path), type="folder", batch_size=2, shuffle_buffer=1, consider_every_nth=2,
                samples_per_shard=100, **kw)
    assert sorted(take(ld, 1)[0]["captions"]) == sorted(["oc solo by=lulu scr200", "duo monochrome scr200"])


def test_classification_with_idx_to_prompt(tmp_path):
    samples = [{"__key__": "bad", "jpg": jpeg_bytes(), "cls": "banana"}]
    samples += [{"__key__": f"c{i}", "jpg": jpeg_bytes(), "cls": str(i * 100)} for i in range(8)]
    path = write_tar(str(tmp_path / "cls.tar"), samples)
    ld = loader(path, batch_size=8, shuffle_buffer=1, idx_to_prompt="imagenet_idx_to_prompt.json")
    b = take(ld, 1)[0]
    with open(_IMAGENET) as fh:
        names = json.load(fh)
    assert b["captions"] == [names[str(i * 100)] for i in range(8)]
    assert b["captions"][0] == "a photo of a tench"
    assert ld.stats()["skipped/bad_cls"] == 1
    ld = loader(path, batch_size=2, shuffle_buffer=1, idx_to_prompt={0: ["zero a", "zero b"], 100: "hundred"})
    b = take(ld, 1)[0]
    assert b["captions"][0] in ("zero a", "zero b") and b["captions"][1] == "hundred"


def test_shipped_imagenet_mapping_matches_the_scripts_copy():
    from sd_training.data.captions import PACKAGE_METADATA, load_idx_to_prompt

    shipped = (PACKAGE_METADATA / "imagenet_idx_to_prompt.json").read_text()
    with open(_IMAGENET) as fh:
        assert fh.read() == shipped
    m = load_idx_to_prompt(_IMAGENET)
    assert len(m) == 1000 and m[207] == ("a photo of a Golden Retriever",)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_http_shards(tmp_path):
    pattern = write_shards(str(tmp_path), [4, 4])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/" + os.path.basename(pattern)
        ld = loader(url, batch_size=4, shuffle_buffer=1)
        assert sorted(all_keys(take(ld, 2))) == [f"s{i:05d}" for i in range(8)]
        # A shard that is not there (404) is skipped and counted; the run continues on the others.
        missing = f"http://127.0.0.1:{server.server_port}/part-{{0000..0002}}.tar"
        ld = loader(missing, batch_size=4, shuffle_buffer=1)
        take(ld, 4)
        assert ld.stats()["skipped/shard_unreachable"] >= 1
    finally:
        server.shutdown()


def test_csv_of_image_urls(tmp_path):
    (tmp_path / "web").mkdir()
    for i in range(5):
        (tmp_path / "web" / f"{i}.jpg").write_bytes(jpeg_bytes(40, 40, _colour(i)))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(tmp_path / "web")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        rows = ["url,caption"] + [f"{base}/{i}.jpg,web {i}" for i in range(5)] + [f"{base}/gone.jpg,gone"]
        (tmp_path / "urls.csv").write_text("\n".join(rows) + "\n")
        ld = loader(str(tmp_path / "urls.csv"), type="CSV", batch_size=5, shuffle_buffer=1, io_timeout=5,
                    samples_per_shard=100)
        b = take(ld, 1)[0]
        assert sorted(b["captions"]) == [f"web {i}" for i in range(5)]
        take(ld, 1)
        assert ld.stats()["skipped/image_unreadable"] >= 1  # the 404 image
    finally:
        server.shutdown()
