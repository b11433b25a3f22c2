"""WebDataset path end to end on real tar shards: batches, determinism, distribution, resume, stats."""

from __future__ import annotations

import json
import os
import tarfile
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from data_fixtures import (
    all_keys,
    assert_same_batches,
    loader,
    make_cfg,
    png_bytes,
    take,
    tokenizer,
    webp_bytes,
    write_shards,
    write_tar,
)
from omegaconf import OmegaConf

from sd_training.data import DatasetConfig, DatasetConfigError, build_train_loader
from sd_training.data.synthetic import COLOURS, SHAPES, write_shapes_shards
from sd_training.data.transforms import unit_range


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_shapes_shards(str(tmp_path_factory.mktemp("shapes")), n_samples=48, n_shards=8, size=64, seed=0)


def test_shapes_dataset_is_real_and_deterministic(tmp_path):
    pat_a = write_shapes_shards(str(tmp_path / "a"), 12, 3, size=48, seed=3)
    write_shapes_shards(str(tmp_path / "b"), 12, 3, size=48, seed=3)
    assert pat_a.endswith("shapes-{000000..000002}.tar")
    sizes = json.loads((tmp_path / "a" / "sizes.json").read_text())
    assert sizes == {"shapes-000000.tar": 4, "shapes-000001.tar": 4, "shapes-000002.tar": 4}
    for name in sizes:
        with tarfile.open(tmp_path / "a" / name) as ta, tarfile.open(tmp_path / "b" / name) as tb:
            ma = {m.name: ta.extractfile(m).read() for m in ta.getmembers()}
            mb = {m.name: tb.extractfile(m).read() for m in tb.getmembers()}
        assert ma == mb
        for member, data in ma.items():
            if member.endswith(".json"):
                meta = json.loads(data)
                caption = ma[member.replace(".json", ".txt")].decode()
                assert meta["shape"] in SHAPES and meta["colour"] in COLOURS
                article = "an" if meta["background"] == "orange" else "a"  # "on an orange background"
                assert caption.endswith(f"{meta['colour']} {meta['shape']} on {article} {meta['background']} background")
                assert (meta["width"], meta["height"]) == (48, 48)


def test_batches_have_the_contracted_types_and_content(shapes):
    tok = tokenizer()
    batches = take(loader(shapes, resolution=32, batch_size=4), 6)
    for b in batches:
        # Bytes leave the workers; the consumer scales them on its device (unit_range).
        assert b["pixel_values"].shape == (4, 3, 32, 32) and b["pixel_values"].dtype == torch.uint8
        unit = unit_range(b["pixel_values"])
        assert unit.dtype == torch.float32 and unit.min() >= -1.0 and unit.max() <= 1.0
        assert torch.equal(unit, b["pixel_values"].float() / 127.5 - 1)  # the formula the float path used
        assert b["input_ids"].shape == (4, tok.model_max_length) and b["input_ids"].dtype == torch.int64
        assert isinstance(b["captions"], list) and len(b["captions"]) == 4
        assert not any(k.startswith("_") for k in b)
        expected = tok(b["captions"], padding="max_length", truncation=True, max_length=77, return_tensors="pt")
        assert torch.equal(b["input_ids"], expected.input_ids)
        # The pixels are the captioned picture: the centre is the shape's colour (JPEG, so approximately).
        for img, cap in zip(b["pixel_values"], b["captions"]):
            colour = cap.split()[1]
            centre = img[:, 14:18, 14:18].float().mean(dim=(1, 2)).numpy()
            assert np.abs(centre - np.array(COLOURS[colour])).max() < 40, (cap, centre)


def test_png_webp_and_key_order(tmp_path):
    samples = [
        {"__key__": "a", "png": png_bytes(), "txt": "png one"},
        {"__key__": "b", "webp": webp_bytes(), "txt": "webp one"},
        {"__key__": "c", "png": png_bytes(mode="RGBA"), "txt": "rgba one"},
        {"__key__": "d", "jpg": webp_bytes(colour=(0, 0, 0)), "png": png_bytes(colour=(255, 255, 255)), "txt": "both"},
    ]
    path = write_tar(str(tmp_path / "one.tar"), samples)
    b = take(loader(path, batch_size=4, shuffle_buffer=1, resampled=True), 1)[0]
    assert b["keys"] == ["a", "b", "c", "d"]
    px = b["pixel_values"].float()
    assert px[0, 1].mean() > 190 and px[1, 2].mean() > 190  # green png, blue webp
    assert px[2].mean() > 100  # RGBA composited on white, not black
    assert px[3].mean() < 5  # 'jpg' comes first in image_keys (its bytes are a webp: the format is sniffed)
    b2 = take(loader(path, batch_size=4, shuffle_buffer=1, resampled=True, image_keys="png;jpg;webp"), 1)[0]
    assert b2["pixel_values"][3].float().mean() > 250


def test_same_seed_same_batches_other_seed_other_batches(shapes):
    for workers in (0, 2):
        a = take(loader(shapes, seed=1, workers=workers, resampled=True), 5)
        b = take(loader(shapes, seed=1, workers=workers, resampled=True), 5)
        c = take(loader(shapes, seed=2, workers=workers, resampled=True), 5)
        assert_same_batches(a, b)
        assert all_keys(a) != all_keys(c)


def test_workers_and_ranks_read_disjoint_shards_in_finite_mode(tmp_path):
    # Uneven shards (sizes 1..9), 2 ranks x 2 workers: every sample exactly once in epoch 0, and every
    # rank keeps producing batches (an infinite stream: no rank runs dry at an epoch end).
    sizes = [5, 1, 9, 3, 7, 2, 8, 4, 6, 3]
    pattern = write_shards(str(tmp_path), sizes)
    total = sum(sizes)
    seen = []
    for rank in range(2):
        batches = take(loader(pattern, rank=rank, world_size=2, workers=2, batch_size=2, shuffle_buffer=1), 40)
        assert len(batches) == 40
        for b in batches:
            seen += [k for k, e in zip(b["keys"], b["epochs"]) if e == 0]
    assert sorted(seen) == sorted(f"s{i:05d}" for i in range(total))


def test_finite_epochs_are_reshuffled_and_cover_everything(tmp_path):
    pattern = write_shards(str(tmp_path), [4] * 6)
    batches = take(loader(pattern, batch_size=4, shuffle_buffer=1), 18)  # 3 epochs of 24 samples
    by_epoch = {}
    for b in batches:
        for k, e in zip(b["keys"], b["epochs"]):
            by_epoch.setdefault(e, []).append(k)
    assert sorted(by_epoch) == [0, 1, 2]
    for e in range(3):
        assert sorted(by_epoch[e]) == [f"s{i:05d}" for i in range(24)]
    assert by_epoch[0] != by_epoch[1]  # shard order differs per epoch (seed + epoch)


def test_brace_and_double_colon_sources(tmp_path):
    a = write_shards(str(tmp_path / "a"), [3, 3], prefix="a")
    b = write_shards(str(tmp_path / "b"), [3], prefix="b", start=6)
    batches = take(loader(f"{a}::{b}", batch_size=3, shuffle_buffer=1), 3)
    assert len(set(all_keys(batches))) == 9
    # A folder of .tar files (img2dataset's output layout) is a source too.
    batches = take(loader(str(tmp_path / "a"), batch_size=3, shuffle_buffer=1), 2)
    assert sorted(all_keys(batches)) == [f"s{i:05d}" for i in range(6)]


def test_pipe_source(tmp_path):
    pattern = write_shards(str(tmp_path), [4, 4])
    pipe = "pipe:cat " + pattern
    batches = take(loader(pipe, batch_size=4, shuffle_buffer=1, workers=0), 2)
    assert sorted(all_keys(batches)) == [f"s{i:05d}" for i in range(8)]


@pytest.mark.parametrize("resampled", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_exactly(tmp_path, resampled, workers):
    pattern = write_shards(str(tmp_path), [7, 5, 9, 6, 8, 4])
    kw = dict(batch_size=3, shuffle_buffer=6, workers=workers, resampled=resampled, random_flip=0.5,
              center_crop=False, caption_dropout=0.3)
    n, k = 16, 7
    straight = take(loader(pattern, seed=5, **kw), n)

    first = loader(pattern, seed=5, **kw)
    it = iter(first)
    head = [next(it) for _ in range(k)]
    state = first.state_dict()
    stats_at_k = first.stats()
    del it  # the "crash"
    torch.save(state, tmp_path / "state.pt")
    restored = loader(pattern, seed=5, **kw)
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    tail = take(restored, n - k)
    assert_same_batches(straight, head + tail)
    assert restored.stats()["samples_seen"] == n * 3
    assert stats_at_k["samples_seen"] == k * 3


def test_state_dict_describes_consumed_batches_not_prefetched_ones(shapes):
    ld = loader(shapes, workers=2, batch_size=2, resampled=True)
    it = iter(ld)
    next(it)
    next(it)
    next(it)
    sd = ld.state_dict()
    assert sd["batches"] == 3 and sorted(sd["reader_states"]) == ["0", "1"]
    assert sd["reader_states"]["0"]["batches"] == 2 and sd["reader_states"]["1"]["batches"] == 1
    assert ld.stats()["samples_seen"] == 6


def test_stats_aggregate_across_workers(tmp_path):
    pattern = write_shards(str(tmp_path), [6] * 4, meta=lambda i: {"q": i % 3})
    for workers in (0, 2):
        ld = loader(pattern, workers=workers, batch_size=2, filters={"q": "<=1"}, shuffle_buffer=1)
        take(ld, 8)  # 16 samples kept of 24 per epoch
        st = ld.stats()
        assert st["samples_seen"] == 16
        assert st["filter/q/checked"] == st["samples_read"]
        assert st["filter/q/passed"] == st["filter/q/checked"] - st["skipped/filter:q"]
        assert 0.5 < st["filter/q/pass_rate"] < 0.8


def test_too_few_shards_for_readers_is_an_error_with_numbers(tmp_path):
    pattern = write_shards(str(tmp_path), [4, 4, 4])
    with pytest.raises(DatasetConfigError, match=r"3 units .* 2 rank\(s\) x 2 worker\(s\) = 4 readers"):
        loader(pattern, world_size=2, rank=0, workers=2, resampled=False)
    loader(pattern, world_size=2, rank=0, workers=2, resampled=True)  # resampled: a warning only


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetConfigError, match="none of the 3 shard"):
        loader(str(tmp_path / "nope-{0..2}.tar"))


def test_start_up_looks_at_a_few_shards_not_all_of_a_huge_path(tmp_path, monkeypatch, caplog):
    """200,000 shards named, the first and the last present: start-up asks the filesystem about at most
    STAT_SAMPLE of them (on every rank), warns about the missing ones it saw, and still builds."""
    import os

    import sd_training.data as data

    write_shards(str(tmp_path), [4, 4])  # part-0000.tar, part-0001.tar: renamed the first and the last
    first = tmp_path / "shards-000000.tar"
    os.rename(tmp_path / "part-0000.tar", first)
    os.rename(tmp_path / "part-0001.tar", tmp_path / "shards-199999.tar")
    calls = []
    exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: calls.append(p) or exists(p))
    sources = data.build_sources("WebDataset", make_cfg(str(tmp_path / "shards-{000000..199999}.tar")).params)
    assert len(sources[0].units) == 200_000
    with caplog.at_level("WARNING"):
        data._check_local_units("WebDataset", sources)
    assert len([c for c in calls if str(c).endswith(".tar")]) == data.STAT_SAMPLE
    assert "30 of the 32 shards looked at (of 200000)" in caplog.text
    first.unlink()
    (tmp_path / f"shards-{199999:06d}.tar").unlink()
    with pytest.raises(DatasetConfigError, match="none of the 200000 shard.*looked at 32"):
        data._check_local_units("WebDataset", sources)


def test_distributed_ranks_never_share_a_batch(shapes):
    a = take(loader(shapes, rank=0, world_size=2, workers=1, resampled=False, batch_size=3), 4)
    b = take(loader(shapes, rank=1, world_size=2, workers=1, resampled=False, batch_size=3), 4)
    assert not set(all_keys(a)) & set(all_keys(b))


def test_build_train_loader_contract_signature(shapes):
    cfg = make_cfg(shapes)
    ld = build_train_loader(cfg, tokenizer=tokenizer(), rank=0, world_size=1, seed=0)
    assert ld.steps_total == 1000 // 4
    assert ld.num_samples == 48  # from sizes.json
    assert set(ld.stats()) >= {"samples_seen", "samples_read", "skipped_total", "epoch"}
    assert os.path.basename(shapes).startswith("shapes-")


@dataclass
class _System:
    batch_size: int = 3
    workers: int = 0


@dataclass
class _Experiment:
    num_examples_to_see: int = 300


@dataclass
class _Root:
    """What the top-level config looks like to the dataset section (its interpolation targets)."""

    system: _System = field(default_factory=_System)
    experiment: _Experiment = field(default_factory=_Experiment)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)


def test_omegaconf_config_with_interpolations_and_yaml_lists(shapes):
    root = OmegaConf.structured(_Root)
    root.dataset.params.path = shapes
    root.dataset.params.resolution = 32
    root.dataset.params.filters = {"shape": ["circle", "square"], "width": ">=64"}
    ld = build_train_loader(root.dataset, tokenizer=tokenizer(), rank=0, world_size=1, seed=0)
    assert ld.plan.batch_size == 3 and ld.steps_total == 100
    for b in take(ld, 3):
        assert all(c.split()[2] in ("circle", "square") for c in b["captions"])


def test_img2dataset_output_folder_works_as_is(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k in range(2):
        samples = [
            {"__key__": f"{k:05d}{i:04d}", "jpg": png_bytes(), "txt": f"img2dataset {k} {i}",
             "json": {"status": "success", "url": "http://x", "original_width": 800, "pwatermark": 0.1 * i}}
            for i in range(4)
        ]
        write_tar(str(tmp_path / f"{k:05d}.tar"), samples)
        pq.write_table(pa.table({"key": [s["__key__"] for s in samples]}), tmp_path / f"{k:05d}.parquet")
        (tmp_path / f"{k:05d}_stats.json").write_text(json.dumps({"successes": 4}))
    ld = loader(str(tmp_path), batch_size=2, shuffle_buffer=1, filters={"pwatermark": "<=0.15", "status": "== success"})
    batches = take(ld, 2)
    assert sorted(c for b in batches for c in b["captions"]) == [f"img2dataset {k} {i}" for k in range(2) for i in range(2)]


def test_restore_with_other_worker_count_continues_the_same_batches(tmp_path, caplog):
    """2 workers (2 canonical readers) -> 1 worker: that worker serves both readers, and the batches go on
    exactly as the 2-worker loader's would."""
    caplog.set_level("INFO")
    pattern = write_shards(str(tmp_path), [5] * 8)
    first = loader(pattern, workers=2, batch_size=2, shuffle_buffer=3)
    seen = all_keys(take(first, 6))
    state = first.state_dict()
    expected = [b["keys"] for b in take(first, 10)]
    other = loader(pattern, workers=1, batch_size=2, shuffle_buffer=3)
    other.load_state_dict(state)
    assert "exact position" in caplog.text and "approximate" not in caplog.text
    after = take(other, 10)
    assert [b["keys"] for b in after] == expected
    assert other.stats()["samples_seen"] == 12 + 20  # counters carry over
    assert not set(all_keys(after)) & set(seen)


def test_restore_with_other_canonical_readers_is_approximate_not_fatal(tmp_path, caplog):
    pattern = write_shards(str(tmp_path), [5] * 8)
    first = loader(pattern, workers=2, batch_size=2, shuffle_buffer=1)
    seen = all_keys(take(first, 6))
    state = first.state_dict()
    other = loader(pattern, workers=1, batch_size=2, shuffle_buffer=1, canonical_readers=3)
    other.load_state_dict(state)
    assert "position is approximate" in caplog.text and "canonical_readers=2 (now 3)" in caplog.text
    after = take(other, 10)
    assert len(after) == 10 and other.stats()["samples_seen"] == 12 + 20  # counters carry over
    assert len(set(all_keys(after)) - set(seen)) >= 10  # it moved on rather than starting over
    with pytest.raises(ValueError, match="version"):
        other.load_state_dict({"version": 99})


def _global_batches(loaders, n):
    """The run's micro-batches 0..n-1 from one loader per rank: micro-batch m is rank (m mod R)'s next one."""
    its = [iter(ld) for ld in loaders]
    out = []
    for m in range(n):
        b = next(its[m % len(its)])
        out.append((b["keys"], b["sample_seeds"].tolist()))
    return out


def _ranks(pattern, world, workers, resampled, readers=4):
    return [loader(pattern, rank=r, world_size=world, workers=workers, batch_size=2, shuffle_buffer=3,
                   canonical_readers=readers, resampled=resampled) for r in range(world)]


@pytest.mark.parametrize("resampled", [False, True])
def test_global_micro_batches_and_sample_seeds_do_not_depend_on_ranks_or_workers(tmp_path, resampled):
    """With the canonical readers fixed, micro-batch m of the run holds the same samples (and the same
    per-sample seeds) on 1, 2 or 4 ranks, in-process or with loader workers; the seeds are distinct."""
    pattern = write_shards(str(tmp_path), [5] * 12)
    ref = _global_batches(_ranks(pattern, 1, 0, resampled), 16)
    seeds = [s for _, ss in ref for s in ss]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    for world, workers in [(1, 2), (2, 1), (2, 2), (4, 1)]:
        assert _global_batches(_ranks(pattern, world, workers, resampled), 16) == ref, (world, workers)


@pytest.mark.parametrize("resampled", [False, True])
def test_positions_of_every_rank_move_to_another_rank_count_exactly(tmp_path, caplog, resampled):
    """2 ranks x 2 workers read 8 micro-batches; every rank's state goes to 4 ranks, then to 1 rank: the
    micro-batches that follow are the uninterrupted run's, shuffle buffers included."""
    caplog.set_level("INFO")
    pattern = write_shards(str(tmp_path), [5] * 12)
    ref = _global_batches(_ranks(pattern, 1, 0, resampled), 24)
    two = _ranks(pattern, 2, 2, resampled)
    assert _global_batches(two, 8) == ref[:8]
    four = _ranks(pattern, 4, 1, resampled)
    for ld in four:
        ld.load_state_dict([ld2.state_dict() for ld2 in two])
    assert "exact position" in caplog.text and "approximate" not in caplog.text
    assert _global_batches(four, 8) == ref[8:16]
    one = _ranks(pattern, 1, 2, resampled)
    one[0].load_state_dict([ld.state_dict() for ld in four])
    assert _global_batches(one, 8) == ref[16:24]
    assert one[0].stats()["samples_seen"] == 48  # every rank's counters, summed


def test_canonical_readers_must_split_over_the_ranks(tmp_path):
    pattern = write_shards(str(tmp_path), [5] * 12)
    with pytest.raises(DatasetConfigError, match=r"canonical_readers=4 cannot be split over 3 ranks"):
        loader(pattern, rank=0, world_size=3, canonical_readers=4)


def test_worker_batches_equal_in_process_batches_tensor_for_tensor(shapes):
    """Batches that crossed from loader workers hold the same tensors (type, dtype, shape, values) as the
    in-process ones: the small ones travel inside the pickled message, the pixels through shared memory."""
    from sd_training.data.loader import INBAND_MAX_BYTES, _from_wire, _Inband, _to_wire

    params = dict(batch_size=4, shuffle_buffer=5, canonical_readers=2, resolution=64)
    ref = take(loader(shapes, workers=0, **params), 6)
    got = take(loader(shapes, workers=2, **params), 6)
    for a, b in zip(ref, got, strict=True):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if isinstance(v, torch.Tensor):
                assert isinstance(b[k], torch.Tensor) and b[k].dtype == v.dtype and torch.equal(b[k], v), k
            else:
                assert b[k] == v, k
    wire = _to_wire({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in ref[0].items()})
    small = [k for k, v in ref[0].items() if isinstance(v, torch.Tensor) and v.nbytes <= INBAND_MAX_BYTES]
    assert {"input_ids", "sample_seeds"} <= set(small)
    assert all(isinstance(wire[k], _Inband) for k in small)
    assert isinstance(wire["pixel_values"], torch.Tensor) == (ref[0]["pixel_values"].nbytes > INBAND_MAX_BYTES)
    _from_wire(wire)
    assert all(torch.equal(wire[k], ref[0][k]) and wire[k].dtype == ref[0][k].dtype for k in small)
