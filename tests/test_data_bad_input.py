"""Bad input never crashes a run: each case is a real tar file; the sample/shard is skipped and counted."""

from __future__ import annotations

import functools
import http.server
import os
import socket
import threading

import pytest
from data_fixtures import all_keys, jpeg_bytes, loader, simple_samples, take, write_shards, write_tar


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _good(i):
    return {"__key__": f"good{i}", "jpg": jpeg_bytes(), "txt": f"good {i}", "json": {"n": i}}


BAD = [
    ({"__key__": "corrupt", "jpg": b"\xff\xd8\xff\xe0 this is not a jpeg", "txt": "x"}, "corrupt_image"),
    ({"__key__": "truncjpg", "jpg": jpeg_bytes(64, 64)[:200], "txt": "x"}, "corrupt_image"),
    ({"__key__": "empty", "jpg": b"", "txt": "x"}, "empty_image"),
    ({"__key__": "nocap", "jpg": jpeg_bytes()}, "missing_caption"),
    ({"__key__": "noimg", "txt": "only a caption"}, "missing_image"),
    ({"__key__": "badjson", "jpg": jpeg_bytes(), "txt": "x", "json": b"{not json"}, "bad_json"),
    ({"__key__": "latin1", "jpg": jpeg_bytes(), "txt": "caf\xe9".encode("latin-1")}, "bad_caption_encoding"),
]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.faults
def test_bad_samples_are_skipped_and_counted_by_reason(tmp_path, workers):
    samples = []
    for i, (bad, _) in enumerate(BAD):
        samples += [_good(2 * i), bad, _good(2 * i + 1)]
    write_tar(str(tmp_path / "mixed-0.tar"), samples[: len(samples) // 2])
    write_tar(str(tmp_path / "mixed-1.tar"), samples[len(samples) // 2 :])
    ld = loader(str(tmp_path / "mixed-{0..1}.tar"), workers=workers, batch_size=7, shuffle_buffer=1)
    batches = take(ld, 2)  # exactly the 14 good samples of epoch 0
    assert sorted(all_keys(batches)) == sorted(f"good{i}" for i in range(14))
    st = ld.stats()
    for _, reason in BAD:
        assert st[f"skipped/{reason}"] >= 1, reason
    assert st["skipped/corrupt_image"] == 2
    assert st["skipped_total"] == len(BAD)


@pytest.mark.faults
def test_truncated_tar_keeps_the_complete_samples(tmp_path):
    path = write_tar(str(tmp_path / "t-0.tar"), simple_samples(6))
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) * 2 // 3])  # cut inside a later member
    write_tar(str(tmp_path / "t-1.tar"), simple_samples(3, start=100))
    ld = loader(str(tmp_path / "t-{0..1}.tar"), batch_size=2, shuffle_buffer=1)
    batches = take(ld, 8)
    epoch0 = [k for b in batches for k, e in zip(b["keys"], b["epochs"]) if e == 0]
    kept = sorted(k for k in epoch0 if k < "s00100")
    assert 2 <= len(kept) < 6 and kept == [f"s{i:05d}" for i in range(len(kept))]  # the complete prefix
    assert sorted(k for k in epoch0 if k >= "s00100") == ["s00100", "s00101", "s00102"]
    assert ld.stats()["skipped/shard_truncated"] >= 1


def test_empty_and_garbage_shards(tmp_path):
    open(tmp_path / "g-0.tar", "wb").close()  # 0 bytes
    (tmp_path / "g-1.tar").write_bytes(os.urandom(3000))  # not a tar
    write_tar(str(tmp_path / "g-2.tar"), simple_samples(4))
    ld = loader(str(tmp_path / "g-{0..2}.tar"), batch_size=4, shuffle_buffer=1)
    assert sorted(all_keys(take(ld, 3))) == sorted(3 * [f"s{i:05d}" for i in range(4)])
    assert ld.stats()["skipped/shard_unreadable"] >= 2


def test_missing_shard_and_failing_pipe_and_unreachable_host(tmp_path):
    pattern = write_shards(str(tmp_path), [4, 4])
    os.remove(str(tmp_path / "part-0001.tar"))
    good = {f"s{i:05d}" for i in range(4)}

    ld = loader(pattern, batch_size=4, shuffle_buffer=1)
    assert set(all_keys(take(ld, 3))) == good
    assert ld.stats()["skipped/shard_missing"] >= 1

    ld = loader("pipe:cat " + pattern, batch_size=4, shuffle_buffer=1)  # cat exits 1 on the missing file
    assert set(all_keys(take(ld, 3))) == good
    assert ld.stats()["skipped/shard_unreadable"] >= 1

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = s.getsockname()[1]
        url = f"http://127.0.0.1:{{{server.server_port}/part-0000.tar,{dead}/x.tar}}"
        ld = loader(url, batch_size=4, shuffle_buffer=1, io_timeout=2)
        assert set(all_keys(take(ld, 3))) == good
        assert ld.stats()["skipped/shard_unreachable"] >= 1
    finally:
        server.shutdown()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_source_without_any_valid_sample_stops_naming_it(tmp_path, workers):
    good = write_shards(str(tmp_path / "ok"), [4, 4, 4, 4])
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    for k in range(2):
        write_tar(str(bad_dir / f"b-{k}.tar"), [{"__key__": f"x{k}{i}", "jpg": b"garbage", "txt": "x"} for i in range(40)])
    bad = str(bad_dir / "b-{0..1}.tar")
    with pytest.raises(RuntimeError, match=r"dataset source '.*b-\{0\.\.1\}\.tar' yields no valid sample.*corrupt_image"):
        take(loader(f"{good}::{bad}", batch_size=4, workers=workers, resampled=True, shuffle_buffer=2), 400)
    # Filters that reject everything: same clear stop, naming the filter in the counts.
    with pytest.raises(RuntimeError, match=r"yields no valid sample.*filter:n"):
        take(loader(good, batch_size=4, filters={"n": ">1"}, resampled=True), 10)


def test_filter_on_missing_or_null_field_fails_the_filter_without_crashing(tmp_path):
    samples = [
        {"__key__": "a", "jpg": jpeg_bytes(), "txt": "a", "json": {"w": 600}},
        {"__key__": "b", "jpg": jpeg_bytes(), "txt": "b", "json": {"w": None}},
        {"__key__": "c", "jpg": jpeg_bytes(), "txt": "c", "json": {"h": 600}},
        {"__key__": "d", "jpg": jpeg_bytes(), "txt": "d"},
        {"__key__": "e", "jpg": jpeg_bytes(), "txt": "e", "json": {"w": "wide"}},
        {"__key__": "f", "jpg": jpeg_bytes(), "txt": "f", "json": {"w": 512}},
    ]
    path = write_tar(str(tmp_path / "f.tar"), samples)
    ld = loader(path, batch_size=2, shuffle_buffer=1, filters={"w": ">=512"}, workers=2, resampled=True)
    for b in take(ld, 5):
        assert set(b["keys"]) <= {"a", "f"}
    assert ld.stats()["filter/w/pass_rate"] == pytest.approx(2 / 6, abs=0.1)


@pytest.mark.faults
def test_a_stalled_pipe_shard_is_killed_skipped_and_counted(tmp_path):
    """``pipe:`` shards get a read-inactivity timeout: a command that stops sending (a hung download)
    is killed and its shard skipped, and the run goes on with the others."""
    import time

    pattern = write_shards(str(tmp_path), [4, 4])
    os.remove(tmp_path / "part-0001.tar")
    os.mkfifo(tmp_path / "part-0001.tar")  # `cat` of a FIFO nobody writes to waits forever: a hung download
    good = {f"s{i:05d}" for i in range(4)}
    t0 = time.time()
    ld = loader(f"pipe:cat {pattern}", batch_size=4, shuffle_buffer=1, io_timeout=1, resampled=False)
    assert set(all_keys(take(ld, 2))) == good
    assert ld.stats()["skipped/shard_stalled"] >= 1
    assert time.time() - t0 < 30  # not the 60 s of the stalled command


@pytest.mark.faults
def test_oversized_tar_members_are_skipped_before_they_are_read(tmp_path):
    """A decompression bomb: a gzip shard of a few hundred KB holding a 200 MB member. The member is
    skipped from its header (counted); the reader never holds it in memory."""
    import gzip
    import io
    import tarfile
    import tracemalloc

    path = tmp_path / "bomb-0.tar.gz"
    with gzip.open(path, "wb", compresslevel=1) as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        for i, s in enumerate([_good(0), None, _good(1)]):
            if s is None:
                info = tarfile.TarInfo("bomb.jpg")
                info.size = 200 * 2**20
                tar.addfile(info, io.BytesIO(bytes(info.size)))
                info = tarfile.TarInfo("bomb.txt")
                info.size = 4
                tar.addfile(info, io.BytesIO(b"boom"))
                continue
            for ext in ("jpg", "txt"):
                data = s[ext] if isinstance(s[ext], bytes) else s[ext].encode()
                info = tarfile.TarInfo(f"{s['__key__']}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    assert path.stat().st_size < 2 * 2**20
    tracemalloc.start()
    try:
        ld = loader(str(path), batch_size=2, shuffle_buffer=1, max_member_bytes=16 * 2**20, resampled=False)
        assert sorted(all_keys(take(ld, 1))) == ["good0", "good1"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    st = ld.stats()
    assert st["skipped/member_too_large"] == 1 and st["skipped/missing_image"] == 1  # bomb.txt alone is left
    assert peak < 64 * 2**20, peak


@pytest.mark.faults
def test_csv_with_a_huge_caption_or_an_unclosed_quote_gets_a_clear_error(tmp_path):
    from sd_training.data import DatasetConfigError

    img = tmp_path / "a.jpg"
    img.write_bytes(jpeg_bytes())
    big = tmp_path / "big.csv"
    big.write_text("image,caption\na.jpg," + "word " * 40000 + "\na.jpg,short\n")
    ld = loader(str(big), batch_size=2, shuffle_buffer=1, resampled=False, **{"type": "CSV"})
    assert len(take(ld, 1)[0]["captions"]) == 2  # a 200 KB caption is read, not a bare _csv.Error
    bad = tmp_path / "open.csv"
    bad.write_text('image,caption\na.jpg,"a caption whose quote never closes\na.jpg,next row\na.jpg,third\n')
    with pytest.raises(DatasetConfigError, match=r"open\.csv: the record starting at line 2 spans 3 lines to the end "
                                                 r"of the file: an unclosed quote"):
        loader(str(bad), batch_size=2, **{"type": "CSV"})
    multi = tmp_path / "multi.csv"
    multi.write_text('image,caption\na.jpg,"two\nlines"\na.jpg,one line\n')
    ld = loader(str(multi), batch_size=2, shuffle_buffer=1, resampled=False, **{"type": "CSV"})
    assert sorted(take(ld, 1)[0]["captions"]) == ["one line", "two\nlines"]


@pytest.mark.faults
def test_csv_image_paths_outside_the_dataset_root_are_refused_unless_allowed(tmp_path):
    """A CSV must not make the trainer read arbitrary files: '..' and absolute paths outside
    image_root (or the CSV's folder) are skipped and counted unless the key allows them."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "in.jpg").write_bytes(jpeg_bytes())
    (tmp_path / "secret.jpg").write_bytes(jpeg_bytes(colour=(0, 0, 255)))
    csv_path = data / "list.csv"
    csv_path.write_text(f"image,caption\nin.jpg,inside\n../secret.jpg,parent\n{tmp_path / 'secret.jpg'},absolute\n")
    ld = loader(str(csv_path), batch_size=1, shuffle_buffer=1, resampled=False, **{"type": "CSV"})
    assert [b["captions"] for b in take(ld, 2)] == [["inside"], ["inside"]]  # epoch 0, then epoch 1
    assert ld.stats()["skipped/path_outside_root"] >= 2
    ld = loader(str(csv_path), batch_size=3, shuffle_buffer=1, resampled=False, allow_paths_outside_root=True,
                **{"type": "CSV"})
    assert sorted(take(ld, 1)[0]["captions"]) == ["absolute", "inside", "parent"]
