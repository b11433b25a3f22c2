"""Latent shards for 16-channel VAEs with a shift factor (stored as ``(latent - shift) * scale``, as the
SD3 / Flux pipelines decode them) and text states stored in bfloat16 (uint16 bit patterns, read back
exactly); ``latents_info.json``'s new fields, the refusal of shards made with another shift factor, and
folders written before these fields still loading."""

import copy
import io
import json
import shutil
import tarfile

import numpy as np
import pytest
import torch
from conftest import run_precompute
from data_fixtures import make_cfg, take, tokenizer

from sd_training.data import DatasetConfigError, build_train_loader
from sd_training.data.latent_checks import check_latents_match
from sd_training.data.latents import EMPTY_TEXT_FILE, INFO_FILE, from_stored, to_stored
from sd_training.data.synthetic import write_shapes_shards
from sd_training.data.transforms import unit_range

pytestmark = pytest.mark.usefixtures("one_thread")

RES = 32
SHIFT, SCALE = 0.0609, 1.5305  # SD3's VAE factors


@pytest.fixture(scope="module")
def shifted_pipeline(tiny_pipeline, tmp_path_factory):
    """The tiny SD pipeline with its VAE swapped for a 16-channel one with a shift factor."""
    from diffusers import AutoencoderKL

    out = tmp_path_factory.mktemp("shifted") / "pipeline"
    shutil.copytree(tiny_pipeline, out)
    conf = dict(AutoencoderKL.load_config(out / "vae"))
    conf = {k: v for k, v in conf.items() if not k.startswith("_")}
    conf.update(latent_channels=16, shift_factor=SHIFT, scaling_factor=SCALE)
    torch.manual_seed(0)
    shutil.rmtree(out / "vae")
    AutoencoderKL(**conf).save_pretrained(out / "vae")
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shapes_shards(str(tmp_path_factory.mktemp("in")), n_samples=8, n_shards=2, size=48, seed=1)


@pytest.fixture(scope="module")
def bf16_dir(shifted_pipeline, shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("lat") / "out"
    run_precompute(["--input", shards, "--pipeline", str(shifted_pipeline), "--output", str(out), "--resolution",
                    str(RES), "--dtype", "fp32", "--text-embeddings", "--text-dtype", "bf16", "--batch-size", "8",
                    "--workers", "0", "--no-progress"])
    return out


def loader(path, **params):
    cfg = make_cfg(str(path), type="latents", resolution=RES, **params)
    return build_train_loader(cfg, tokenizer=tokenizer(), rank=0, world_size=1, seed=3)


def image_loader(shards):
    return build_train_loader(make_cfg(shards, resolution=RES), tokenizer=tokenizer(), rank=0, world_size=1, seed=3)


def test_bf16_bits_round_trip_as_torch_rounds():
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 100
    x[:3] = [1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0]  # ties: to even
    bits = to_stored(x, "bfloat16")
    assert bits.dtype == np.uint16
    want = torch.from_numpy(x).bfloat16().float().numpy()
    assert np.array_equal(from_stored(bits, "bfloat16"), want)
    assert from_stored(x.astype(np.float16), None).dtype == np.float32  # older folders: the array's own dtype
    with pytest.raises(ValueError, match="uint16"):
        from_stored(x, "bfloat16")


def test_shifted_16_channel_latents_and_bf16_text(bf16_dir, shards, shifted_pipeline):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    from sd_training.families.components.clip import encode_text

    info = json.loads((bf16_dir / INFO_FILE).read_text())
    assert info["latent_shift_factor"] == SHIFT and info["latent_scaling_factor"] == SCALE
    assert info["latent_channels"] == 16 and info["latent_shape"] == [32, 4, 4] and info["text_dtype"] == "bfloat16"
    # fp32 mean_std latents: 32 x 4 x 4 x 4 bytes; bf16 text: 77 x 64 x 2 bytes
    assert info["bytes_per_sample"] == {"latents": 32 * 16 * 4, "text": 77 * 64 * 2}
    with tarfile.open(next(bf16_dir.glob("*.tar"))) as tar:
        text = next(m for m in tar.getmembers() if m.name.endswith(".text.npy"))
        assert np.load(io.BytesIO(tar.extractfile(text).read())).dtype == np.uint16
    assert np.load(bf16_dir / EMPTY_TEXT_FILE).dtype == np.uint16

    vae = AutoencoderKL.from_pretrained(shifted_pipeline, subfolder="vae").eval()
    te = CLIPTextModel.from_pretrained(shifted_pipeline, subfolder="text_encoder").eval()
    lat = loader(bf16_dir, latent_sampling="mean", text_embeddings=True)
    check_latents_match(lat, vae)  # the VAE that made them
    for a, b in zip(take(lat, 2), take(image_loader(shards), 2)):
        assert a["keys"] == b["keys"]
        with torch.no_grad():
            mean = vae.encode(unit_range(b["pixel_values"])).latent_dist.mean
            states = encode_text(te, a["input_ids"])
        # As the SD3 / Flux pipelines decode: latents / scaling_factor + shift_factor
        torch.testing.assert_close(a["latents"], (mean - SHIFT) * SCALE, rtol=0, atol=1e-5)
        assert a["encoder_hidden_states"].dtype == torch.float32
        assert torch.equal(a["encoder_hidden_states"], states.bfloat16().float())  # bf16, exactly

    other = copy.deepcopy(vae)
    other.register_to_config(shift_factor=0.1159)
    with pytest.raises(DatasetConfigError, match=rf"{INFO_FILE}\).*shift factor 0.0609 \(the run's VAE: 0.1159.*Re-run"):
        check_latents_match(lat, other)
    other.register_to_config(shift_factor=None)
    with pytest.raises(DatasetConfigError, match=r"shift factor 0.0609 \(the run's VAE: 0.0"):
        check_latents_match(lat, other)


def test_folders_without_the_new_fields_still_load(bf16_dir, tmp_path):
    """A folder written before latent_shift_factor / text_dtype / bytes_per_sample (fp16 text, no shift)."""
    from diffusers import AutoencoderKL

    old = tmp_path / "old"
    shutil.copytree(bf16_dir, old)
    info = json.loads((old / INFO_FILE).read_text())
    for key in ("latent_shift_factor", "text_dtype", "bytes_per_sample"):
        del info[key]
    (old / INFO_FILE).write_text(json.dumps(info))
    # The text arrays as fp16 .npy, as before
    np.save(old / EMPTY_TEXT_FILE, from_stored(np.load(old / EMPTY_TEXT_FILE), "bfloat16").astype(np.float16))
    for path in old.glob("*.tar"):
        with tarfile.open(path) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        with tarfile.open(path, "w") as tar:
            for name, data in members.items():
                if name.endswith(".text.npy"):
                    buf = io.BytesIO()
                    np.save(buf, from_stored(np.load(io.BytesIO(data)), "bfloat16").astype(np.float16))
                    data = buf.getvalue()
                member = tarfile.TarInfo(name)
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    batch = take(loader(old, text_embeddings=True), 1)[0]
    assert batch["encoder_hidden_states"].dtype == torch.float32 and batch["latents"].shape[1] == 16
    unshifted = AutoencoderKL(latent_channels=16, scaling_factor=SCALE)  # no shift: as the old folder says
    check_latents_match(loader(old), unshifted)
