"""Training from latent shards (``dataset.type=latents``): batches equal the online encoding of the same
images, a training step on them equals one on online latents, text embeddings and caption dropout,
posterior sampling that replays on resume, bad members counted, and the config checks."""

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_precompute, train_args
from data_fixtures import make_cfg, take, tokenizer, write_tar
from helpers import ready_trainer

from sd_training.data import DatasetConfigError, build_train_loader, validate_dataset_config
from sd_training.data.latents import EMPTY_TEXT_FILE, INFO_FILE, npy_bytes
from sd_training.data.transforms import unit_range

ROOT = Path(__file__).resolve().parents[1]
RES = 32  # 4x4 latents: the tiny models run fast and every block still runs


pytestmark = pytest.mark.usefixtures("one_thread")


precompute = run_precompute


@pytest.fixture(scope="module")
def latent_dir(tmp_path_factory, tiny_pipeline, shapes_shards):
    """The shapes shards (4 x 32 real JPEGs) precomputed in fp32, mean and std, with text embeddings."""
    out = tmp_path_factory.mktemp("latents") / "out"
    precompute(["--input", shapes_shards, "--pipeline", str(tiny_pipeline), "--output", str(out), "--resolution", str(RES),
                "--dtype", "fp32", "--text-embeddings", "--batch-size", "16", "--workers", "0", "--no-progress"])
    return out


@pytest.fixture(scope="module")
def models(tiny_pipeline):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    vae = AutoencoderKL.from_pretrained(tiny_pipeline, subfolder="vae").eval()
    te = CLIPTextModel.from_pretrained(tiny_pipeline, subfolder="text_encoder").eval()
    return vae, te


def image_loader(shards, **params):
    return build_train_loader(make_cfg(shards, resolution=RES, **params), tokenizer=tokenizer(), rank=0, world_size=1, seed=3)


def latent_loader(path, **params):
    cfg = make_cfg(str(path), type="latents", resolution=RES, **params)
    return build_train_loader(cfg, tokenizer=tokenizer(), rank=0, world_size=1, seed=3)


@torch.no_grad()
def online_mean(vae, pixel_values):
    return vae.encode(unit_range(pixel_values)).latent_dist.mean * vae.config.scaling_factor


def test_mean_latents_equal_the_online_encoding_of_the_same_images(latent_dir, shapes_shards, models):
    vae, _ = models
    lat = latent_loader(latent_dir, latent_sampling="mean")
    assert lat.latent_scaling_factor == vae.config.scaling_factor
    for a, b in zip(take(lat, 6), take(image_loader(shapes_shards), 6)):  # finite mode, same seed: same order
        assert a["keys"] == b["keys"] and a["captions"] == b["captions"]
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert "pixel_values" not in a and a["latents"].dtype == torch.float32
        torch.testing.assert_close(a["latents"], online_mean(vae, b["pixel_values"]), rtol=0, atol=2e-6)
    stats = lat.stats()
    assert stats["samples_seen"] == 24 and stats["skipped_total"] == 0


def test_a_training_step_on_latent_shards_equals_one_on_online_latents(latent_dir, shapes_shards, tiny_pipeline, tmp_path):
    """The issue's check: the loss and gradients of Trainer.micro_step from shard latents (and stored text
    embeddings) equal those from latents encoded online from the same images (posterior mean)."""
    from sd_training.configure import load

    # The same config loads with the latent source: the schema and validation know dataset.type=latents.
    load(train_args(tmp_path, tiny_pipeline, str(latent_dir), name="l", **{
        "dataset.type": "latents", "dataset.params.resolution": RES, "dataset.params.latent_sampling": "mean",
        "dataset.params.text_embeddings": "true"}))
    t = ready_trainer(load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"dataset.params.resolution": RES})))
    shard = next(iter(latent_loader(latent_dir, latent_sampling="mean", text_embeddings=True)))
    image = next(iter(image_loader(shapes_shards)))
    assert shard["keys"] == image["keys"]
    g = torch.Generator().manual_seed(0)
    fixed = {"noise": torch.randn(shard["latents"].shape, generator=g), "timesteps": torch.randint(0, 1000, (4,), generator=g)}
    online = {"latents": online_mean(t.models.vae, image["pixel_values"]), "input_ids": image["input_ids"], **fixed}

    def step(batch):
        t.optimizer.zero_grad(set_to_none=True)
        loss, *_ = t.micro_step(batch, sync=True)
        return loss, {n: p.grad.clone() for n, p in t.net.named_parameters() if p.grad is not None}

    loss_online, grads_online = step(online)
    for extra in ({}, {"encoder_hidden_states": shard["encoder_hidden_states"]}):
        loss, grads = step({"latents": shard["latents"], "input_ids": shard["input_ids"], **fixed, **extra})
        torch.testing.assert_close(loss, loss_online, rtol=1e-5, atol=1e-6)
        assert grads.keys() == grads_online.keys()
        for n in grads:
            torch.testing.assert_close(grads[n], grads_online[n], rtol=1e-4, atol=1e-6)


def test_text_embeddings_and_caption_dropout(latent_dir, shapes_shards, models):
    _, te = models
    from sd_training.families.components.clip import encode_text

    empty = np.load(latent_dir / EMPTY_TEXT_FILE)
    lat = take(latent_loader(latent_dir, text_embeddings=True, caption_dropout=0.5), 4)
    img = take(image_loader(shapes_shards, caption_dropout=0.5), 4)
    captions = [c for b in lat for c in b["captions"]]
    assert 0 < captions.count("") < len(captions)
    for a, b in zip(lat, img):
        assert a["captions"] == b["captions"]  # dropout hits the same samples as on the image path
        with torch.no_grad():
            online = encode_text(te, a["input_ids"])
        torch.testing.assert_close(a["encoder_hidden_states"], online, rtol=0, atol=1e-5)
        for i, c in enumerate(a["captions"]):
            if c == "":
                assert torch.equal(a["encoder_hidden_states"][i], torch.from_numpy(empty))


def test_posterior_samples_are_per_sample_per_epoch_and_replay_on_resume(latent_dir):
    mean = {k: v for b in take(latent_loader(latent_dir, latent_sampling="mean"), 40) for k, v in zip(b["keys"], b["latents"])}
    from sd_training.data.sources import iter_tar_samples
    from sd_training.data.stats import Stats

    std = {}
    for name in sorted(os.listdir(latent_dir)):
        if name.endswith(".tar"):
            for m in iter_tar_samples(str(latent_dir / name), 10, Stats()):
                std[m["__key__"]] = torch.from_numpy(np.load(io.BytesIO(m["latents.npy"]))[4:])
    batches = take(latent_loader(latent_dir), 64)  # two epochs of 128 samples (epochs overlap in the shuffle buffer)
    eps = {}
    for b in batches:
        for k, z, e in zip(b["keys"], b["latents"], b["epochs"]):
            eps[(k, e)] = (z - mean[k]) / std[k]
    assert len(eps) == 256
    all_eps = torch.stack(list(eps.values()))
    assert abs(all_eps.mean().item()) < 0.05 and abs(all_eps.std().item() - 1) < 0.05  # N(0, 1) noise
    assert not torch.allclose(eps[("00000000", 0)], eps[("00000000", 1)])  # a new draw each epoch
    # Resume: the same draws after a restore as without one.
    first = latent_loader(latent_dir)
    head = take(first, 5)
    state = first.state_dict()
    second = latent_loader(latent_dir)
    second.load_state_dict(state)
    for a, b in zip(take(second, 3), batches[5:8]):
        assert a["keys"] == b["keys"] and torch.equal(a["latents"], b["latents"])
    assert all(torch.equal(a["latents"], b["latents"]) for a, b in zip(head, batches[:5]))


def test_worker_processes_and_exact_resume(latent_dir):
    straight = take(latent_loader(latent_dir, workers=2, text_embeddings=True, caption_dropout=0.3), 6)
    first = latent_loader(latent_dir, workers=2, text_embeddings=True, caption_dropout=0.3)
    take(first, 3)
    resumed = latent_loader(latent_dir, workers=2, text_embeddings=True, caption_dropout=0.3)
    resumed.load_state_dict(first.state_dict())
    for a, b in zip(take(resumed, 3), straight[3:]):
        assert a["keys"] == b["keys"] and a["captions"] == b["captions"]
        assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["encoder_hidden_states"], b["encoder_hidden_states"])
    assert resumed.stats()["samples_seen"] == 24


def _good(key, store="mean_std", caption="a caption", text=True):
    arr = np.ones((8, 4, 4), np.float16) if store == "mean_std" else np.ones((4, 4, 4), np.float16)
    s = {"__key__": key, "latents.npy": npy_bytes(arr), "txt": caption,
         "json": {"latent_store": store, "latent_scaling_factor": 0.18215}}
    if text:
        s["text.npy"] = npy_bytes(np.zeros((77, 64), np.float16))
    return s


def test_bad_members_are_skipped_and_counted(tmp_path):
    bad = [
        {**_good("a0"), "latents.npy": b"not an npy file"},
        {**_good("a1"), "latents.npy": npy_bytes(np.ones((8, 4), np.float16))},  # wrong rank
        {**_good("a2"), "latents.npy": npy_bytes(np.full((8, 4, 4), np.nan, np.float32))},
        {**_good("a3"), "latents.npy": npy_bytes(np.ones((7, 4, 4), np.float32))},  # odd channels for mean_std
        {**_good("a4"), "json": {"latent_store": "nonsense"}},
        {k: v for k, v in _good("a5").items() if k != "latents.npy"},
        {**_good("a6"), "text.npy": b"garbage"},
        {k: v for k, v in _good("a7").items() if k != "text.npy"},
    ]
    write_tar(str(tmp_path / "bad.tar"), bad + [_good(f"g{i}") for i in range(8)])
    lat = build_train_loader(make_cfg(str(tmp_path / "bad.tar"), type="latents", resolution=32, text_embeddings=True,
                                      shuffle_buffer=1), tokenizer=tokenizer(), rank=0, world_size=1, seed=0)
    batches = take(lat, 2)
    assert sorted(k for b in batches for k in b["keys"]) == [f"g{i}" for i in range(8)]
    s = lat.stats()
    assert s["skipped/bad_latents"] == 5 and s["skipped/missing_latents"] == 1
    assert s["skipped/bad_text_embedding"] == 1 and s["skipped/missing_text_embedding"] == 1
    assert s["skipped_total"] == 8
    assert lat.latent_scaling_factor is None  # no latents_info.json next to this shard


def test_per_sample_empty_captions_replace_dropped_captions(tmp_path):
    """Shards whose text reads each sample's references (Qwen-Image-Edit: ``empty_text: per_sample``) hold each
    sample's own empty caption: a dropped caption reads that sample's ``KEY.empty.text.npy`` (no folder-wide
    empty.text.npy is needed), and a sample without one is skipped and counted."""
    from sd_training.data.latents import EMPTY_TEXT_MEMBER, FORMAT, FORMAT_VERSION, PER_SAMPLE

    samples = [{**_good(f"g{i}"), EMPTY_TEXT_MEMBER: npy_bytes(np.full((77, 64), i, np.float16))} for i in range(4)]
    write_tar(str(tmp_path / "edit.tar"), [_good("no_empty")] + samples)
    info = {"format": FORMAT, "version": FORMAT_VERSION, "resolution": 32, "latent_store": "mean_std",
            "latent_scaling_factor": 0.18215, "latent_channels": 4, "text_embeddings": True, "text_shape": [77, 64],
            "text_dtype": "float16", "empty_text_file": None, "empty_text": PER_SAMPLE, "complete": True}
    (tmp_path / INFO_FILE).write_text(json.dumps(info))
    lat = build_train_loader(make_cfg(str(tmp_path / "edit.tar"), type="latents", text_embeddings=True,
                                      caption_dropout=1.0, shuffle_buffer=1), tokenizer=tokenizer(), rank=0,
                             world_size=1, seed=0)
    (batch,) = take(lat, 1)
    assert batch["captions"] == [""] * 4
    for key, states in zip(batch["keys"], batch["encoder_hidden_states"]):
        assert torch.equal(states, torch.full((77, 64), float(key[1:])))
    assert lat.stats()["skipped/missing_text_embedding"] == 1


def test_sample_stores_and_aspect_shapes_make_their_own_batches(tmp_path):
    # One posterior sample per image (store=sample), two latent sizes: batches never mix shapes.
    samples = [_good(f"s{i}", store="sample", text=False) for i in range(8)]
    for i in range(4):
        samples.append({**_good(f"w{i}", store="sample", text=False),
                        "latents.npy": npy_bytes(np.full((4, 4, 6), 2.0, np.float32))})
    write_tar(str(tmp_path / "s.tar"), samples)
    batches = take(build_train_loader(make_cfg(str(tmp_path / "s.tar"), type="latents", resolution=32, shuffle_buffer=1),
                                      tokenizer=tokenizer(), rank=0, world_size=1, seed=0), 3)
    shapes = sorted(tuple(b["latents"].shape) for b in batches)
    assert shapes == [(4, 4, 4, 4), (4, 4, 4, 4), (4, 4, 4, 6)]
    wide = next(b for b in batches if b["latents"].shape[-1] == 6)
    assert torch.equal(wide["latents"], torch.full((4, 4, 4, 6), 2.0))  # stored samples are used as they are


def test_config_checks(latent_dir, tmp_path):
    def bad(match, **params):
        with pytest.raises(DatasetConfigError, match=match):
            cfg = make_cfg(str(latent_dir), **{"type": "latents", "resolution": RES, **params})
            validate_dataset_config(cfg)
            build_train_loader(cfg, tokenizer=tokenizer(), rank=0, world_size=1, seed=0)

    bad(r"random_flip=0.5 does not apply to dataset.type=latents", random_flip=0.5)
    bad(r"aspect_buckets=True does not apply", aspect_buckets=True)
    bad(r"latent_sampling='median'.*sample or mean", latent_sampling="median")
    bad(r"shuffle_tags changes the caption", text_embeddings=True, shuffle_tags=0.5)
    bad(r"idx_to_prompt changes the caption", text_embeddings=True, idx_to_prompt={0: "a cat"})
    bad(r"resolution=64 but the latent shards .* were made at 32", resolution=64)
    with pytest.raises(DatasetConfigError, match="latent_sampling='mean' does not apply to dataset.type=WebDataset"):
        validate_dataset_config(make_cfg(str(latent_dir), latent_sampling="mean"))
    # Settings the shards cannot serve.
    info = json.loads((latent_dir / INFO_FILE).read_text())
    other = tmp_path / "copy"
    other.mkdir()
    for name in info["shards"]:
        (other / name).write_bytes((latent_dir / name).read_bytes())
    (other / INFO_FILE).write_text(json.dumps({**info, "latent_store": "sample", "text_embeddings": False}))
    for match, params in [("hold one posterior sample.*--store mean_std", {"latent_sampling": "mean"}),
                          ("hold none: re-run .* --text-embeddings", {"text_embeddings": True})]:
        with pytest.raises(DatasetConfigError, match=match):
            build_train_loader(make_cfg(str(other), type="latents", resolution=RES, **params), tokenizer=tokenizer(),
                               rank=0, world_size=1, seed=0)
    (other / INFO_FILE).unlink()
    with pytest.raises(DatasetConfigError, match="caption_dropout with text_embeddings needs"):
        build_train_loader(make_cfg(str(other), type="latents", resolution=RES, text_embeddings=True, caption_dropout=0.1),
                           tokenizer=tokenizer(), rank=0, world_size=1, seed=0)


def test_shards_made_for_other_models_are_refused(latent_dir, shapes_shards, models):
    import copy

    from sd_training.data.latent_checks import StoredText, check_latents_match
    from sd_training.families.components.clip import apply_clip_skip, clip_skip_of

    def text(te, tok):  # what the SD family expects of stored text (StableDiffusion.stored_text)
        return StoredText(int(tok.model_max_length), int(te.config.hidden_size), clip_skip_of(te))

    vae, te = models
    lat = latent_loader(latent_dir, text_embeddings=True)
    assert lat.latents_info["count"] == 128
    check_latents_match(lat, vae, text(te, tokenizer()))  # the models that made them
    check_latents_match(image_loader(shapes_shards), None)  # image data: nothing to check
    other = copy.deepcopy(vae)
    other.register_to_config(scaling_factor=0.13025)
    with pytest.raises(DatasetConfigError, match=r"scaling factor 0.18215 \(the run's VAE: 0.13025\)"):
        check_latents_match(lat, other)
    with pytest.raises(DatasetConfigError, match="clip_skip 1 .*: 2"):
        check_latents_match(lat, vae, text(apply_clip_skip(copy.deepcopy(te), 2), tokenizer()))
    short = copy.deepcopy(tokenizer())
    short.model_max_length = 64
    with pytest.raises(DatasetConfigError, match=r"shape \[77, 64\] .*\[64, 64\]"):
        check_latents_match(lat, vae, text(te, short))


def test_bucketed_latent_shards_equal_the_online_encoding_of_bucketed_images(tmp_path, tiny_pipeline, models):
    """--aspect-buckets: each image is cropped to its aspect-ratio bucket before encoding, so bucketed
    training from the latent shards sees the same batches (keys, shapes, latents) as from the images."""
    from sd_training.data.synthetic import write_shapes_shards

    vae, _ = models
    shards = write_shapes_shards(str(tmp_path / "in"), n_samples=36, n_shards=3, seed=2,
                                 sizes=[(96, 48), (48, 96), (64, 64), (80, 64)])
    out = tmp_path / "out"
    precompute(["--input", shards, "--pipeline", str(tiny_pipeline), "--output", str(out), "--resolution", str(RES),
                "--aspect-buckets", "--bucket-step", "8", "--dtype", "fp32", "--batch-size", "4", "--workers", "0",
                "--no-progress"])
    info = json.loads((out / INFO_FILE).read_text())
    assert info["aspect_buckets"] == {"bucket_step": 8, "max_aspect_ratio": 2.0} and info["count"] == 36
    import tarfile

    stored = {}
    for tar_path in sorted(out.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".latents.npy"):
                    arr = np.load(io.BytesIO(tar.extractfile(m).read()))
                    stored[m.name.split(".")[0]] = torch.from_numpy(arr[: arr.shape[0] // 2])  # the mean
    shapes = set()
    for b in take(image_loader(shards, aspect_buckets=True, bucket_step=8, batch_size=3), 8):
        shapes.add(tuple(b["pixel_values"].shape[2:]))
        want = torch.stack([stored[k] for k in b["keys"]])
        torch.testing.assert_close(want, online_mean(vae, b["pixel_values"]), rtol=0, atol=2e-6)
    assert len(shapes) >= 3, shapes  # wide, tall and square buckets
    # Training from them: batches group by the stored latent's shape (its bucket), never mixed.
    for a in take(latent_loader(out, latent_sampling="mean", batch_size=3), 12):
        assert all(torch.equal(a["latents"][i], stored[k]) for i, k in enumerate(a["keys"]))
