"""Masked loss: masks from tar members, table columns, folder sidecars and the alpha channel follow the image's
crop, bucket resize and flip onto the latent grid; a zero mask trains nothing (exact zero gradients, for the
UNet objectives and flow matching, Flux's packed patches included); bad masks are skipped and counted; a real
bf16 run with a loader worker through the webdataset pipeline.

Masks are per-sample data: nothing in them is distribution-specific (each rank's loss is its samples' mean, as
without masks), so no multi-rank run is made here; the loader test reads as each of two ranks."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import train_args
from data_fixtures import loader, take, write_tar
from PIL import Image

from sd_training.configure import load
from sd_training.data import DatasetConfigError
from sd_training.data.masks import LATENT_DOWNSAMPLE
from sd_training.data.synthetic import masked_square_sample, write_masked_shards

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = [(96, 64), (64, 96), (80, 80), (72, 56)]
# Random crops, flips and aspect buckets: every geometric path of the image pipeline.
GEOMETRY = dict(masked_loss=True, resolution=64, aspect_buckets=True, bucket_step=16, center_crop=False,
                random_flip=0.5, batch_size=2)


def red_fraction(pixels: torch.Tensor) -> np.ndarray:
    """[B, h, w]: the share of each latent cell's pixels that are the square's red."""
    px = pixels.numpy().astype(int)
    red = (px[:, 0] > 150) & (px[:, 1] < 100) & (px[:, 2] < 100)
    b, h, w = red.shape
    f = LATENT_DOWNSAMPLE
    return red.reshape(b, h // f, f, w // f, f).mean(axis=(2, 4))


def assert_aligned(batches, n_masked=None):
    """Each sample's latent-grid weight is where its image is red (to a fraction of an edge cell), and the
    square is off centre, so a mask left unflipped or cropped elsewhere would miss by whole cells."""
    seen = 0
    for b in batches:
        weight = b["loss_weight"].numpy()[:, 0]
        assert weight.shape[1:] == (b["pixel_values"].shape[2] // 8, b["pixel_values"].shape[3] // 8)
        frac = red_fraction(b["pixel_values"])
        assert np.abs(frac - weight).max() < 0.15, (b["keys"], np.abs(frac - weight).max())
        assert (frac > 0.9).any()  # the square is in view
        seen += len(b["keys"])
    return seen


def masked_samples(n, alpha=False):
    return [masked_square_sample(i, SIZES[i % len(SIZES)], seed=3, alpha=alpha) for i in range(n)]


def test_tar_masks_follow_crops_buckets_and_flips_on_two_ranks_and_a_worker(tmp_path):
    path = write_masked_shards(str(tmp_path / "wds"), 32, 4, sizes=SIZES, seed=3)
    flipped = 0
    for rank in (0, 1):
        ld = loader(path, rank=rank, world_size=2, workers=1, **GEOMETRY)
        batches = take(ld, 6)
        assert assert_aligned(batches) == 12
        stats = ld.stats()
        assert stats["samples_masked"] >= 12 and stats["skipped_total"] == 0
        assert len({tuple(b["pixel_values"].shape[2:]) for b in batches}) > 1  # several buckets
        # The same samples and crops unflipped (the flip draw is made either way): some were mirrored.
        straight = take(loader(path, rank=rank, world_size=2, workers=1, **{**GEOMETRY, "random_flip": 0.0}), 6)
        for b, s in zip(batches, straight):
            assert b["keys"] == s["keys"]
            for x, y in zip(b["pixel_values"], s["pixel_values"]):
                if not torch.equal(x, y):
                    assert torch.equal(x, y.flip(-1))
                    flipped += 1
    assert flipped >= 3


def test_table_masks_as_bytes_and_as_paths(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = masked_samples(12)
    table = pa.table({"key": [r[0] for r in rows], "image": [r[1] for r in rows], "caption": [r[2] for r in rows],
                      "mask": [r[4] for r in rows]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=4)
    assert_aligned(take(loader(str(tmp_path / "t.parquet"), type="parquet", **GEOMETRY), 5))
    # CSV: image and mask paths relative to the file's folder; a row without a mask trains everywhere.
    (tmp_path / "img").mkdir()
    lines = ["key,image,caption,mask"]
    for i, (key, data, caption, _, mask) in enumerate(rows):
        (tmp_path / "img" / f"{key}.png").write_bytes(data)
        (tmp_path / "img" / f"{key}_m.png").write_bytes(mask)
        lines.append(f"{key},img/{key}.png,{caption},{'' if i == 0 else f'img/{key}_m.png'}")
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    ld = loader(str(tmp_path / "t.csv"), type="CSV", shuffle_buffer=1, **{**GEOMETRY, "batch_size": 1})
    batches = take(ld, 12)
    unmasked = [b for b in batches if "loss_weight" not in b]
    assert [b["keys"] for b in unmasked] == [[rows[0][0]]]  # a batch without any mask carries no weight
    assert_aligned([b for b in batches if "loss_weight" in b])


def test_folder_sidecars_and_the_alpha_channel(tmp_path):
    root = tmp_path / "flat"
    root.mkdir()
    for key, data, caption, _, mask in masked_samples(12):
        (root / f"{key}.png").write_bytes(data)
        (root / f"{key}.txt").write_text(caption)
        (root / f"{key}.mask.png").write_bytes(mask)
    ld = loader(str(root), type="folder", **GEOMETRY)
    batches = take(ld, 6)
    assert_aligned(batches)
    assert not any(k.endswith(".mask") for b in batches for k in b["keys"])  # sidecars are not images
    # The alpha channel of RGBA PNGs (transparent: composited to white, and weight 0), from tar shards.
    shard = write_tar(str(tmp_path / "a.tar"), [{"__key__": k, "png": d, "txt": c}
                                                for k, d, c, _, _ in masked_samples(12, alpha=True)])
    ld = loader(shard, mask_from_alpha=True, **GEOMETRY)
    assert_aligned(take(ld, 5))
    assert ld.stats()["samples_masked"] >= 10


def test_mixed_batches_and_settings(tmp_path):
    """Samples without a mask weigh 1 beside masked ones; unmasked_weight is a floor; mask_normalize makes
    each masked sample's mean weight 1; an all-black mask weighs 0 even normalised."""
    black = io.BytesIO()
    Image.new("L", (64, 64), 0).save(black, format="PNG")
    samples = []
    for i, (key, data, caption, _, mask) in enumerate(masked_samples(8)):
        s = {"__key__": key, "png": data, "txt": caption}
        if i % 2 == 0:
            s["mask.png"] = mask if i % 4 else black.getvalue()
        if i % 4 == 0:  # the black masks' images: 64 x 64 like the mask
            s["png"] = masked_square_sample(i, 64, seed=3)[1]
        samples.append(s)
    shard = write_tar(str(tmp_path / "m.tar"), samples)
    for extra in ({}, {"unmasked_weight": 0.25}, {"mask_normalize": True}):
        batch = take(loader(shard, masked_loss=True, resolution=64, batch_size=8, shuffle_buffer=1, **extra), 1)[0]
        w = batch["loss_weight"]
        assert w.shape == (8, 1, 8, 8)
        for i, key in enumerate(batch["keys"]):
            k = int(key)
            if k % 2:
                assert torch.equal(w[i], torch.ones_like(w[i]))
            elif k % 4 == 0:
                assert torch.equal(w[i], torch.full_like(w[i], extra.get("unmasked_weight", 0.0)))
            elif "mask_normalize" in extra:
                assert w[i].mean().item() == pytest.approx(1.0, abs=1e-5) and w[i].max() > 1.5
            else:
                assert w[i].min() >= extra.get("unmasked_weight", 0.0) and 0.9 < w[i].max() <= 1.0


def test_bad_masks_are_skipped_counted_and_named(tmp_path, caplog):
    key, data, caption, _, mask = masked_square_sample(0, (96, 64), seed=3)
    small = io.BytesIO()
    Image.new("L", (48, 32), 255).save(small, format="PNG")
    good = [{"__key__": f"g{i}", "png": data, "txt": caption, "mask.png": mask} for i in range(6)]
    shard = write_tar(str(tmp_path / "bad.tar"), [
        {"__key__": "wrong_size", "png": data, "txt": caption, "mask.png": small.getvalue()},
        {"__key__": "not_an_image", "png": data, "txt": caption, "mask.png": b"this is no png"},
        *good])
    with caplog.at_level("WARNING", logger="sd_training.data"):
        ld = loader(shard, masked_loss=True, resolution=32, batch_size=2, shuffle_buffer=1)
        batches = take(ld, 3)
    assert sorted(k for b in batches for k in b["keys"]) == sorted(s["__key__"] for s in good)
    stats = ld.stats()
    assert stats["skipped/mask_size_mismatch"] == 1 and stats["skipped/corrupt_mask"] == 1
    text = caplog.text
    assert "bad.tar sample 'wrong_size'" in text and "the mask is 48x32 px, the image 96x64" in text
    assert "bad.tar sample 'not_an_image'" in text


def test_exif_turned_images_take_masks_as_shown(tmp_path):
    """A PNG stored turned with EXIF orientation 6 (shown 90 degrees clockwise): its mask is of the picture as
    shown, and lands where the shown picture is red; a mask of the stored (unturned) size is refused with a hint."""
    samples = []
    for i in range(8):
        key, data, caption, _, mask = masked_square_sample(i, (96, 64), seed=5)
        shown = Image.open(io.BytesIO(data))
        exif = Image.Exif()
        exif[0x0112] = 6
        buf = io.BytesIO()
        shown.transpose(Image.Transpose.ROTATE_90).save(buf, format="PNG", exif=exif)  # stored turned back
        bad = Image.open(io.BytesIO(mask)).transpose(Image.Transpose.ROTATE_90)  # the stored picture's size
        m = io.BytesIO()
        bad.save(m, format="PNG")
        samples.append({"__key__": key, "png": buf.getvalue(), "txt": caption,
                        "mask.png": mask if i < 6 else m.getvalue()})
    shard = write_tar(str(tmp_path / "exif.tar"), samples)
    ld = loader(shard, shuffle_buffer=1, **{**GEOMETRY, "batch_size": 3})
    assert_aligned(take(ld, 2))
    assert all(b.shape[2:] == (48, 80) for b in [x["pixel_values"] for x in take(ld, 2)])  # shown landscape
    ld = loader(shard, shuffle_buffer=1, **{**GEOMETRY, "batch_size": 1})
    take(ld, 7)  # the 7th batch, of the next epoch, carries the counts of the last two samples' skips
    assert ld.stats()["skipped/mask_size_mismatch"] == 2


def test_the_autoencoder_stage_refuses_masked_loss(tmp_path, tiny_pipeline, shapes_shards):
    from sd_training.config import ConfigError

    with pytest.raises(ConfigError, match="autoencoder stage .* has no masked loss"):
        load(train_args(tmp_path, tiny_pipeline, shapes_shards, model__train_target="vae",
                        dataset__params__masked_loss="true"))


@pytest.mark.parametrize("override, message", [
    ({"type": "latents", "masked_loss": True}, "latent shards store no mask"),
    ({"mask_from_alpha": True}, "only applies with dataset.params.masked_loss=true"),
    ({"unmasked_weight": 0.1}, "only applies with dataset.params.masked_loss=true"),
    ({"masked_loss": True, "mask_column": "m"}, "mask_column='m' does not apply to dataset.type=WebDataset"),
    ({"masked_loss": True, "unmasked_weight": 1.5}, "unmasked_weight"),
])
def test_config_refuses_what_cannot_work(tmp_path, override, message):
    shard = write_tar(str(tmp_path / "x.tar"), [{"__key__": "a", "png": masked_square_sample(0, 32)[1], "txt": "x"}])
    with pytest.raises(DatasetConfigError, match=message):
        loader(shard, **override)


def test_a_table_without_the_mask_column_is_named(tmp_path):
    (tmp_path / "t.csv").write_text("image,caption\na.png,x\n")
    with pytest.raises(DatasetConfigError, match="mask_column='mask'.*columns: \\['image', 'caption'\\]"):
        loader(str(tmp_path / "t.csv"), type="CSV", masked_loss=True)


# ------------------------------------------------------------------------------------------------ the loss

def grads(module):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


def pair_and_alone(loss_of, module, weight_pair):
    """Gradients of the mean loss of a batch [zero-masked sample, plain sample], and of the plain one alone."""
    module.zero_grad()
    loss_of([0, 1], weight_pair).backward()
    pair = grads(module)
    module.zero_grad()
    loss_of([1], None).backward()
    alone = grads(module)
    module.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        zero = loss_of([0], weight_pair[:1])
    zero.backward()
    assert zero.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads(module))  # exactly nothing from the masked sample
    for a, b in zip(pair, alone):  # the batch mean halves the plain sample's gradient: nothing else is in it
        assert (2 * a - b).norm() <= 1e-5 * b.norm() + 1e-12, ((2 * a - b).norm(), b.norm())
    assert any(torch.count_nonzero(g) for g in alone)


def zero_then_ones(h, w):
    weight = torch.ones(2, 1, h, w)
    weight[0] = 0
    return weight


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction", "min_snr"])
def test_a_zero_mask_trains_nothing_unet_objectives(tiny_pipeline, kind):
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from sd_training.families.components.ddpm import ObjectiveConfig, diffusion_loss

    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline / "unet")
    sched = DDPMScheduler.from_pretrained(tiny_pipeline / "scheduler")
    cfg = ObjectiveConfig(loss_weighting="min_snr" if kind == "min_snr" else "none")
    if kind == "v_prediction":
        sched = DDPMScheduler.from_config(sched.config, prediction_type="v_prediction")
        cfg.prediction_type = "v_prediction"
    g = torch.Generator().manual_seed(0)
    latents, states = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 64, generator=g)
    seeds = torch.tensor([11, 12])

    def loss_of(idx, weight):
        return diffusion_loss(unet, sched, latents[idx], states[idx], cfg, sample_seeds=seeds[idx], loss_weight=weight)[0]

    pair_and_alone(loss_of, unet, zero_then_ones(8, 8))


def test_flow_matching_zero_mask_and_flux_packing(flux_pipeline, sd3_pipeline, shapes_shards, tmp_path):
    """SD3's transformer through flow_loss, and the Flux family's own loss (latents packed into 2x2 patches
    for the transformer, unpacked for the loss): a zero mask trains nothing. Then the packing itself: with the
    left half of the mask zero, the loss has no gradient on the packed tokens of the left half."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from sd_training.families.components import flow_matching
    from sd_training.families import registry as families
    from sd_training.families.components.packing import pack, unpack
    from sd_training.families.options import FlowMatchingConfig

    net = SD3Transformer2DModel.from_pretrained(sd3_pipeline / "transformer")
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(sd3_pipeline / "scheduler")
    c = net.config
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, c.in_channels, 8, 8, generator=g)
    states, pooled = torch.randn(2, 7, c.joint_attention_dim, generator=g), torch.randn(2, c.pooled_projection_dim, generator=g)
    seeds = torch.tensor([5, 6])

    def sd3_loss(idx, weight):
        def predict(noisy, t):
            return net(hidden_states=noisy, timestep=t, encoder_hidden_states=states[idx], pooled_projections=pooled[idx],
                       return_dict=False)[0]
        return flow_matching.flow_loss(predict, latents[idx], FlowMatchingConfig(), sched, sample_seeds=seeds[idx],
                                       loss_weight=weight)[0]

    pair_and_alone(sd3_loss, net, zero_then_ones(8, 8))

    cfg = load(train_args(tmp_path, flux_pipeline, shapes_shards, **{"dataset.params.resolution": 32,
                                                                     "model.t5.max_length": 16}))
    family = families.create(cfg, torch.device("cpu"), 0, True)
    tok, tok_2 = family.tokenizers
    captions = ["a red circle", "a blue square"]
    batch = {
        "pixel_values": torch.rand(2, 3, 32, 32, generator=g) * 2 - 1,
        "input_ids": tok(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids,
        "input_ids_2": tok_2(captions, padding="max_length", max_length=16, truncation=True, return_tensors="pt").input_ids,
        "sample_seeds": torch.tensor([7, 8]),
    }

    def flux_loss(idx, weight):
        b = {k: v[idx] for k, v in batch.items()}
        if weight is not None:
            b["loss_weight"] = weight
        return family.loss(family.net, b, torch.autocast("cpu", enabled=False)).loss

    pair_and_alone(flux_loss, family.net, zero_then_ones(4, 4))

    h = w = 8
    latents = torch.randn(1, 16, h, w, generator=g)
    tokens = pack(torch.randn(1, 16, h, w, generator=g)).requires_grad_(True)  # [1, (h/2)(w/2), 64]
    weight = torch.ones(1, 1, h, w)
    weight[..., : w // 2] = 0
    loss = flow_matching.flow_loss(lambda noisy, t: unpack(tokens, h, w), latents, FlowMatchingConfig(), sched,
                                   sample_seeds=[3], loss_weight=weight)[0]
    loss.backward()
    per_token = tokens.grad[0].abs().sum(-1).reshape(h // 2, w // 2)  # row-major patches, as Flux packs them
    assert torch.count_nonzero(per_token[:, : w // 4]) == 0 and bool((per_token[:, w // 4:] > 0).all())


# ------------------------------------------------------------------------------------------ real training

def unet_state(folder):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(folder).state_dict()


def mask_shards(folder: Path, value: int) -> str:
    """Two tar shards of 8 squares each, every mask a plain ``value`` (0: black, 255: white)."""
    samples = []
    for i in range(16):
        key, data, caption, _, _ = masked_square_sample(i, 64, seed=1)
        m = io.BytesIO()
        Image.new("L", (64, 64), value).save(m, format="PNG")
        samples.append({"__key__": key, "png": data, "txt": caption, "mask.png": m.getvalue()})
    folder.mkdir()
    write_tar(str(folder / "a.tar"), samples[:8])
    write_tar(str(folder / "b.tar"), samples[8:])
    return str(folder / "{a,b}.tar")


def bf16_run(tmp_path, pipeline, name, path, masked):
    """3 steps of 4 in bf16 autocast with one loader worker; (the exported UNet's state, the logged losses)."""
    from sd_training.loop import main as train

    over = {"model.mixed_precision": "bf16", "system.workers": 1, "experiment.num_examples_to_see": 12,
            "system.batch_size": 4, "optimizer.params.weight_decay": 0.0}
    if masked:
        over["dataset.params.masked_loss"] = "true"
    out = train(load(train_args(tmp_path, pipeline, path, name=name, **over)))
    rows = [json.loads(line) for line in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return unet_state(Path(out["run_dir"]) / "current_pipeline" / "unet"), [r["loss"] for r in rows if "loss" in r]


def test_bf16_run_with_a_worker_on_black_masks_trains_nothing(tmp_path, tiny_pipeline):
    """Through the real loader (tar shards, one worker process) and the Trainer in bf16 autocast: shards whose
    masks are all black leave the UNet exactly as it was (weight decay off: zero gradients, zero Adam steps)."""
    before = unet_state(tiny_pipeline / "unet")
    after, losses = bf16_run(tmp_path, tiny_pipeline, "zero", mask_shards(tmp_path / "black", 0), True)
    assert losses == [0.0, 0.0, 0.0]
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.slow
def test_bf16_run_on_white_masks_equals_the_run_without_masked_loss(tmp_path, tiny_pipeline):
    """All-white masks weigh exactly 1: the run trains bit for bit as the same shards without masked loss."""
    before = unet_state(tiny_pipeline / "unet")
    white = mask_shards(tmp_path / "white", 255)
    ones, ones_losses = bf16_run(tmp_path, tiny_pipeline, "ones", white, True)
    plain, plain_losses = bf16_run(tmp_path, tiny_pipeline, "plain", white, False)
    assert ones_losses == plain_losses and all(x > 0 for x in plain_losses)
    assert all(torch.equal(ones[k], plain[k]) for k in plain)
    assert any(not torch.equal(plain[k], before[k]) for k in before)
