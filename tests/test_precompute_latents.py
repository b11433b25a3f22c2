"""scripts/precompute_latents.py on real tar shards: readable output, resume (a rerun does no work, a
killed run's .tmp is ignored), refused setting changes, failed input shards, and a 2-rank split that
writes every shard exactly once with the same bytes as one rank."""

import io
import json
import os
import socket
import sys
import tarfile
from pathlib import Path

import forked
import numpy as np
import pytest
from conftest import run_precompute

from sd_training.data.synthetic import write_shapes_shards

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "precompute_latents.py"
FAST = ["--resolution", "32", "--batch-size", "8", "--workers", "0", "--no-progress"]


pytestmark = pytest.mark.usefixtures("one_thread")


precompute = run_precompute


def members(path):
    """{member name: bytes} of a tar (tar headers, e.g. mtimes, left out)."""
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def tars(folder):
    return sorted(p.name for p in Path(folder).glob("*.tar"))


@pytest.fixture
def small(tmp_path):
    """4 real shards x 4 generated JPEGs."""
    return write_shapes_shards(str(tmp_path / "in"), n_samples=16, n_shards=4, size=48, seed=1)


def test_shapes_shards_become_readable_latent_shards(tmp_path, tiny_pipeline, shapes_shards):
    out = tmp_path / "out"
    # Defaults: fp16 storage; here one posterior sample per image, decoded by 2 worker processes.
    summary = precompute(["--input", shapes_shards, "--pipeline", str(tiny_pipeline), "--output", str(out),
                          "--store", "sample", "--resolution", "32", "--batch-size", "16", "--workers", "2", "--no-progress"])
    assert summary["complete"] and summary["samples"] == 128 and not summary["shards_failed"]
    src_dir = Path(shapes_shards).parent
    assert tars(out) == tars(src_dir)  # one output shard per input shard, same basename
    info = json.loads((out / "latents_info.json").read_text())
    assert info["count"] == 128 and info["complete"] and info["latent_store"] == "sample"
    assert info["latent_scaling_factor"] == 0.18215 and info["resolution"] == 32 and info["latent_shape"] == [4, 4, 4]
    assert json.loads((out / "sizes.json").read_text()) == json.loads((src_dir / "sizes.json").read_text())
    for name in tars(out):
        src, dst = members(src_dir / name), members(out / name)
        keys = sorted({n.split(".")[0] for n in src})
        assert sorted({n.split(".")[0] for n in dst}) == keys
        for k in keys:
            assert dst[f"{k}.txt"] == src[f"{k}.txt"]  # the caption, unmodified
            meta = json.loads(dst[f"{k}.json"])
            # The metadata as it was, plus the scaling factor, the store and the crop's size conditioning
            # (the 64 px shapes resized to 32: the whole image, no crop).
            assert meta == {**json.loads(src[f"{k}.json"]), "latent_scaling_factor": 0.18215, "latent_store": "sample",
                            "original_size": [64, 64], "crop_top_left": [0, 0], "target_size": [32, 32]}
            z = np.load(io.BytesIO(dst[f"{k}.latents.npy"]))
            assert z.dtype == np.float16 and z.shape == (4, 4, 4) and np.isfinite(z).all()
            assert f"{k}.text.npy" not in dst
    assert not list(out.glob("*.tmp*"))


def test_rerun_does_no_work_and_a_killed_runs_tmp_is_ignored(tmp_path, tiny_pipeline, small):
    out = tmp_path / "out"
    args = ["--input", small, "--pipeline", str(tiny_pipeline), "--output", str(out), "--text-embeddings", *FAST]
    first = precompute(args)
    assert len(first["shards_written"]) == 4 and first["complete"]
    before = {n: (os.stat(out / n).st_mtime_ns, members(out / n)) for n in tars(out)}
    again = precompute(args)
    assert again["shards_written"] == [] and again["samples"] == 0 and again["complete"]
    assert {n: (os.stat(out / n).st_mtime_ns, members(out / n)) for n in tars(out)} == before

    # A run killed mid-shard: shard 2 missing with a half-written .tmp, a stray .tmp of a finished shard.
    (out / "shapes-000002.tar").unlink()
    (out / "shapes-000002.tar.tmp").write_bytes(b"half a tar")
    (out / "shapes-000001.tar.tmp").write_bytes(b"junk")
    info = json.loads((out / "latents_info.json").read_text())
    (out / "latents_info.json").write_text(json.dumps({**info, "complete": False}))
    third = precompute(args)
    assert third["shards_written"] == ["shapes-000002.tar"] and third["samples"] == 4 and third["complete"]
    assert members(out / "shapes-000002.tar") == before["shapes-000002.tar"][1]  # deterministic output
    assert json.loads((out / "latents_info.json").read_text())["complete"]
    assert not (out / "shapes-000002.tar.tmp").exists()
    # The stray .tmp is not a shard: readers glob *.tar, and training reads the folder.
    from data_fixtures import make_cfg, take, tokenizer

    from sd_training.data import build_train_loader

    cfg = make_cfg(str(out), type="latents", resolution=32, batch_size=4, text_embeddings=True, shuffle_buffer=1)
    batches = take(build_train_loader(cfg, tokenizer=tokenizer(), rank=0, world_size=1, seed=0), 4)
    assert sorted(k for b in batches for k in b["keys"]) == [f"{i:08d}" for i in range(16)]


def test_other_settings_into_the_same_folder_are_refused(tmp_path, tiny_pipeline, small):
    def run(*extra):
        return precompute(["--input", small, "--pipeline", str(tiny_pipeline), "--output", str(tmp_path / "out"),
                           "--workers", "0", "--no-progress", *extra])

    run("--resolution", "32")
    with pytest.raises(SystemExit, match="other settings.*latent_store"):
        run("--resolution", "32", "--store", "sample")
    with pytest.raises(SystemExit, match="other settings.*resolution"):
        run("--resolution", "48")
    assert run("--resolution", "32", "--batch-size", "3")["shards_written"] == []  # provenance only: allowed


def test_a_missing_input_shard_fails_alone_and_is_retried(tmp_path, tiny_pipeline, small):
    out = tmp_path / "out"
    moved = Path(small).parent / "shapes-000003.tar"
    moved.rename(moved.with_suffix(".bak"))
    args = ["--input", small, "--pipeline", str(tiny_pipeline), "--output", str(out), *FAST]
    summary = precompute(args)
    assert summary["shards_failed"] == ["shapes-000003.tar"] and len(summary["shards_written"]) == 3
    assert not summary["complete"] and not json.loads((out / "latents_info.json").read_text())["complete"]
    moved.with_suffix(".bak").rename(moved)
    assert precompute(args)["shards_written"] == ["shapes-000003.tar"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_write_every_shard_once_with_the_same_bytes_as_one(tmp_path, tiny_pipeline, small):
    common = ["--input", small, "--pipeline", str(tiny_pipeline), "--store", "sample", *FAST]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", str(SCRIPT), "--output", str(tmp_path / "two"), *common]
    res = forked.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    wrote = [line.split(" wrote ")[1].split()[0] for line in res.stderr.splitlines() if " wrote shapes-" in line]
    by_rank = {r: [line for line in res.stderr.splitlines() if f"rank {r} wrote shapes-" in line] for r in (0, 1)}
    assert sorted(wrote) == [f"shapes-{i:06d}.tar" for i in range(4)]  # every shard exactly once
    assert len(by_rank[0]) == len(by_rank[1]) == 2  # shard i on rank i % 2
    info = json.loads((tmp_path / "two" / "latents_info.json").read_text())
    assert info["complete"] and info["count"] == 16
    one = precompute(["--output", str(tmp_path / "one"), *common])
    assert one["complete"]
    for name in tars(tmp_path / "one"):  # posterior draws are seeded per shard and sample, not per rank
        assert members(tmp_path / "two" / name) == members(tmp_path / "one" / name)


def test_reference_latents_are_the_encoding_of_the_cropped_references(tmp_path, tiny_pipeline):
    """Edit pairs (--references 2): each reference's stored latents are the VAE's encoding of the reference the
    image path crops (through its target's crop), in the target's units; the latent reader gives them as
    reference_latents, each reference's posterior drawn from its own generator after the target's (whose
    draws are those of a run without references); shards with fewer references than the run asks are refused."""
    import torch
    from data_fixtures import make_cfg, take, tokenizer
    from diffusers import AutoencoderKL

    from sd_training.data import DatasetConfigError, build_train_loader
    from sd_training.data.latent_checks import check_latents_match
    from sd_training.data.synthetic import write_edit_shards
    from sd_training.data.transforms import unit_range

    shards = write_edit_shards(str(tmp_path / "in"), 8, 2, size=(48, 32), references=2, seed=0)
    out = tmp_path / "out"
    summary = precompute(["--input", shards, "--pipeline", str(tiny_pipeline), "--output", str(out),
                          "--references", "2", "--dtype", "fp32", *FAST])
    assert summary["complete"] and summary["samples"] == 8 and not summary["skipped"]
    info = json.loads((out / "latents_info.json").read_text())
    assert info["references"] == 2 and info["reference_crop"] == "aligned"
    assert info["bytes_per_sample"]["references"] == 2 * info["bytes_per_sample"]["latents"]
    dst = members(out / tars(out)[0])
    assert {n.split(".", 1)[1] for n in dst} == {"latents.npy", "ref.latents.npy", "ref2.latents.npy", "txt", "json"}

    def build(typ=None, **params):
        kw = dict(type=typ) if typ else {}
        cfg = make_cfg(shards if typ is None else str(out), resolution=32, batch_size=4, shuffle_buffer=1,
                       **kw, **params)
        return build_train_loader(cfg, tokenizer=tokenizer(), rank=0, world_size=1, seed=3)

    vae = AutoencoderKL.from_pretrained(tiny_pipeline, subfolder="vae").eval()

    @torch.no_grad()
    def mean_of(pixels):
        return vae.encode(unit_range(pixels)).latent_dist.mean * vae.config.scaling_factor

    images = take(build(references=2, center_crop=True, random_flip=0.0), 2)
    stored = take(build("latents", references=2, latent_sampling="mean"), 2)
    for img, lat in zip(images, stored):
        assert img["keys"] == lat["keys"] and lat["reference_latents"].shape == (4, 2, 4, 4, 4)
        torch.testing.assert_close(lat["latents"], mean_of(img["pixel_values"]), rtol=0, atol=2e-6)
        for k in range(2):
            torch.testing.assert_close(lat["reference_latents"][:, k], mean_of(img["reference_values"][:, k]),
                                       rtol=0, atol=2e-6)
    @torch.no_grad()
    def std_of(pixels):
        return vae.encode(unit_range(pixels)).latent_dist.std * vae.config.scaling_factor

    # Posterior samples: the targets' as without references; each reference's unit noise its own.
    drawn, plain = take(build("latents", references=2), 2), take(build("latents"), 2)
    for d, p, m, img in zip(drawn, plain, stored, images):
        assert torch.equal(d["latents"], p["latents"]) and "reference_latents" not in p
        stds = [std_of(img["pixel_values"]), *(std_of(img["reference_values"][:, k]) for k in range(2))]
        samples = [d["latents"], *d["reference_latents"].unbind(1)]
        means = [m["latents"], *m["reference_latents"].unbind(1)]
        eps = [(x - mu) / sd for x, mu, sd in zip(samples, means, stds)]
        assert all(0.5 < e.std() < 1.5 for e in eps)  # standard normal draws
        assert all(not torch.allclose(eps[a], eps[b], atol=0.1) for a in range(3) for b in range(a + 1, 3))
    with pytest.raises(DatasetConfigError, match="references=3 but the latent shards .* hold 2 reference latents"):
        build("latents", references=3)
    ld = build("latents", references=2)
    ld.proc.refs.count = 3  # as a run asking for more than the shards hold
    with pytest.raises(DatasetConfigError, match="2 reference latents per sample"):
        check_latents_match(ld, vae)
