"""Weighted mixtures of sources (dataset.params.sources): shares of the selected samples, per-source
filters and counters, finite sources that restart or drop out, and exact resume (issue 14)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from data_fixtures import loader, take, write_shards

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.data import DatasetConfigError


def quality(i: int) -> bytes:
    return json.dumps({"q": i % 10}).encode()


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """'big': 8 shards x 30 (keys s00000..), a filter keeps 1 in 10; 'small': 3 shards x 20 (keys s10000..)."""
    root = tmp_path_factory.mktemp("mix")
    big = write_shards(str(root / "big"), [30] * 8, meta=quality, prefix="big")
    small = write_shards(str(root / "small"), [20] * 3, meta=quality, prefix="small", start=10000)
    return big, small


def mixture(two_sources, big_weight=3.0, small_weight=1.0, small_exhausted="restart", **params):
    big, small = two_sources
    sources = [
        {"path": big, "name": "big", "weight": big_weight, "filters": {"q": "< 1"}},
        {"path": small, "name": "small", "weight": small_weight, "exhausted": small_exhausted},
    ]
    params.setdefault("shuffle_buffer", 4)
    params.setdefault("batch_size", 8)
    return loader(f"{big}::{small}", sources=sources, **params)


def source_of(key: str) -> str:
    return "small" if int(key[1:]) >= 10000 else "big"


@pytest.mark.parametrize("resampled, workers", [(False, 0), (True, 2)])
def test_shares_of_selected_samples_follow_the_weights_whatever_the_rejection_rate(two_sources, resampled, workers):
    """'big' loses 90% of its samples to its filter and still makes 75% of the batches; its filter does not
    touch 'small' (whose samples would fail it 9 times in 10)."""
    ld = mixture(two_sources, resampled=resampled, workers=workers)
    batches = take(ld, 250)  # 2000 samples
    keys = [k for b in batches for k in b["keys"]]
    counts = Counter(source_of(k) for k in keys)
    assert abs(counts["big"] / len(keys) - 0.75) < 0.01, counts
    assert all(int(k[1:]) % 10 == 0 for k in keys if source_of(k) == "big")  # big's own filter
    assert any(int(k[1:]) % 10 for k in keys if source_of(k) == "small")  # ... not applied to small
    # Over every window of 20 batches (160 samples) the share holds within 2 samples per reader.
    for start in range(0, 250, 20):
        window = [source_of(k) for b in batches[start:start + 20] for k in b["keys"]]
        assert abs(window.count("big") / len(window) - 0.75) <= 2 * max(1, workers) / len(window) + 0.01
    st = ld.stats()
    assert st["source/big/samples_seen"] == counts["big"] and st["source/small/samples_seen"] == counts["small"]
    assert abs(st["source/big/share"] - 0.75) < 0.01
    assert st["source/big/skipped/filter:q"] >= 8 * st["source/big/accepted"]
    assert "source/small/skipped/filter:q" not in st


def test_a_dropping_source_is_read_exactly_once_and_counted(two_sources):
    """'small' (60 samples) leaves the mixture when read once: every one of its samples is read exactly
    once, the counters say so, and the rest of the stream is 'big'."""
    ld = mixture(two_sources, small_weight=3.0, big_weight=1.0, small_exhausted="drop", shuffle_buffer=1)
    batches = take(ld, 40)
    keys = [k for b in batches for k in b["keys"]]
    small = [k for k in keys if source_of(k) == "small"]
    assert sorted(small) == [f"s{10000 + i:05d}" for i in range(60)]
    st = ld.stats()
    assert st["source/small/samples_read"] == 60 and st["source/small/dropped"] == 1
    assert all(source_of(k) == "big" for k in keys[-100:])


@pytest.mark.parametrize("workers", [0, 2])
def test_mixture_resumes_exactly(two_sources, workers):
    kw = dict(workers=workers, resampled=False, small_exhausted="drop", small_weight=2.0)
    ref = [b["keys"] for b in take(mixture(two_sources, **kw), 30)]
    first = mixture(two_sources, **kw)
    head = [b["keys"] for b in take(first, 12)]
    state = first.state_dict()
    again = mixture(two_sources, **kw)
    again.load_state_dict(state)
    assert head + [b["keys"] for b in take(again, 18)] == ref
    assert again.stats()["source/big/samples_seen"] + again.stats()["source/small/samples_seen"] == 30 * 8


def test_mixture_positions_move_to_another_rank_count(two_sources):
    """4 canonical readers on 1 rank, then on 2 ranks: the run's micro-batches are unchanged."""
    kw = dict(canonical_readers=4, resampled=True)
    ref = [b["keys"] for b in take(mixture(two_sources, **kw), 20)]
    one = mixture(two_sources, **kw)
    head = [b["keys"] for b in take(one, 8)]
    two = [mixture(two_sources, rank=r, world_size=2, **kw) for r in range(2)]
    for ld in two:
        ld.load_state_dict([one.state_dict()])
    its = [iter(ld) for ld in two]
    assert head + [next(its[m % 2])["keys"] for m in range(12)] == ref


@pytest.mark.parametrize("entry, words", [
    ({"path": "/d/{0..1}.tar", "weight": 0}, "must be a number > 0"),
    ({"path": "/d/a.tar::/d/b.tar"}, "not a '::' list"),
    ({"path": "/d/{0..1}.tar", "wieght": 2}, r"unknown key\(s\) \['wieght'\]"),
    ({"path": "/d/{0..1}.tar", "exhausted": "stop"}, "choose restart or drop"),
    ({"path": "/d/{0..1}.tar", "filters": {"q": "~~ 3"}}, "q"),
])
def test_bad_source_entries_are_named(two_sources, entry, words):
    with pytest.raises(DatasetConfigError, match=words):
        loader("/d/{0..1}.tar", sources=[entry, {"path": two_sources[1], "name": "other"}])


def test_sources_replace_path_in_the_config():
    base = ["experiment.name=mix", "model.pretrained=/models/sd", "experiment.num_examples_to_see=10"]
    cfg = load(base + ["dataset.params.sources=[{path: '/a/{0..3}.tar', weight: 2}, {path: /b/x.tar}]"])
    assert cfg.dataset.params.path == "/a/{0..3}.tar::/b/x.tar"
    with pytest.raises(ConfigError, match="both set"):
        load(base + ["dataset.params.path=/c.tar", "dataset.params.sources=[{path: /a.tar}]"])


def test_a_source_reads_its_own_member_names(two_sources):
    """'small' is told its captions are in 'cap' members (they are in 'txt'): that source, and only that
    one, fails, with an error naming it; 'big' alone with the same setting reads fine."""
    big, small = two_sources
    entries = [{"path": big, "name": "big", "filters": {"q": "< 1"}}, {"path": small, "name": "small", "caption_key": "cap"}]
    with pytest.raises(RuntimeError, match="source 'small' yields no valid sample.*missing_caption"):
        take(loader(f"{big}::{small}", sources=entries, batch_size=8), 20)
    ok = loader(f"{big}::{small}", sources=[entries[0], {**entries[1], "caption_key": "txt"}], batch_size=8)
    assert len(take(ok, 5)) == 5


@pytest.mark.slow
@pytest.mark.distributed
def test_training_on_a_mixture_logs_each_sources_share(tmp_path, tiny_pipeline, shapes_shards):
    """train.py on 2 ranks, bf16, loader workers, a 3:1 mixture of two halves of the shapes shards."""
    from conftest import train_args
    from test_resume import finish, launch

    half_a = shapes_shards.replace("{000000..000003}", "{000000..000001}")
    half_b = shapes_shards.replace("{000000..000003}", "{000002..000003}")
    assert half_a != shapes_shards
    sources = f"[{{path: '{half_a}', name: a, weight: 3}}, {{path: '{half_b}', name: b}}]"
    args = [a for a in train_args(tmp_path, tiny_pipeline, shapes_shards, name="mix") if not a.startswith("dataset.params.path=")]
    args += [f"dataset.params.sources={sources}", "system.workers=2", "model.mixed_precision=bf16",
             "experiment.num_examples_to_see=128", "experiment.sample_per_prompt=0", "experiment.log_every=4",
             "dataset.params.resolution=32"]
    finish(launch(tmp_path, args, nproc=2))
    run = tmp_path / "runs" / "mix"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "data/source/a/share" in r][-1]
    # Selected samples (those that entered the shuffle buffers) follow the weights to within a sample per
    # reader; the 64 samples rank 0 trained on are a random draw from its buffers (binomial noise).
    a, b = last["data/source/a/accepted"], last["data/source/b/accepted"]
    assert abs(a / (a + b) - 0.75) <= 2 / (a + b), (a, b)
    assert abs(last["data/source/a/share"] - 0.75) <= 0.2 and last["data/source/b/samples_seen"] > 0
    assert "data: mixture (share of selected samples): a 75.0%" in (run / "train.log").read_text()


def test_a_pooled_position_given_to_a_mixture_is_approximate_not_fatal(two_sources, caplog):
    big, small = two_sources
    pooled = loader(f"{big}::{small}", batch_size=8, shuffle_buffer=4)
    take(pooled, 5)
    mixed = mixture(two_sources)
    mixed.load_state_dict(pooled.state_dict())
    assert "position is approximate" in caplog.text and "streams=1 (now 2)" in caplog.text
    assert len(take(mixed, 5)) == 5
