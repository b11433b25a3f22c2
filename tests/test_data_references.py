"""Edit training's paired samples, the data side (sd_training/data/references.py): references read from tar
members, parquet/CSV columns and folder sidecars stay pixel-aligned with their targets through random crops,
aspect buckets and flips (with loader workers), or are resized on their own (center); bad pairs are skipped
and counted by reason; filters, mixtures, masked loss and exact resume work on paired streams; the targets'
random draws are those of a run without references."""

import io
import json
from collections import Counter

import numpy as np
import pytest
import torch
from data_fixtures import loader, take, write_tar
from PIL import Image, ImageDraw

from sd_training.data import DatasetConfigError
from sd_training.data.synthetic import COLOURS, edit_sample, read_shape_image, write_edit_shards

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = [(96, 64), (64, 96), (80, 80), (72, 56)]
# Random crops, flips and aspect buckets: every geometric path of the image pipeline.
GEOMETRY = dict(resolution=64, aspect_buckets=True, bucket_step=16, center_crop=False, random_flip=0.5, batch_size=2,
                references=1)
MARKER = (220, 30, 30)


def marker_pair(index: int, scale: int = 1):
    """(key, target PNG, reference PNG, caption): the same off-centre red marker square on two backgrounds
    (the reference ``scale`` times the target's size, so only fractions of the crop box can align them)."""
    rng = np.random.default_rng([7, index])
    w, h = SIZES[index % len(SIZES)]
    side = int(min(w, h) * 0.3)
    x0, y0 = int(rng.integers(0, w // 2 - side // 2)), int(rng.integers(0, h - side))  # left half: flips show

    def picture(background, s):
        img = Image.new("RGB", (w * s, h * s), background)
        ImageDraw.Draw(img).rectangle([x0 * s, y0 * s, (x0 + side) * s - 1, (y0 + side) * s - 1], fill=MARKER)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()

    return f"p{index:03d}", picture(COLOURS["white"], 1), picture(COLOURS["green"], scale), f"pair {index}"


def marker(pixels: torch.Tensor) -> np.ndarray:
    """bool [B, H, W]: where uint8 [B, 3, H, W] pixels are the marker's red."""
    px = pixels.numpy().astype(int)
    return (px[:, 0] > 150) & (px[:, 1] < 100) & (px[:, 2] < 100)


def assert_aligned(batches) -> int:
    """Each reference's marker covers the pixels its target's does (bicubic edges aside)."""
    seen = 0
    for b in batches:
        refs = b["reference_values"]
        assert refs.dtype == torch.uint8 and refs.shape[0] == len(b["keys"])
        assert refs.shape[2:] == b["pixel_values"].shape[1:]
        target, ref = marker(b["pixel_values"]), marker(refs[:, 0])
        for t, r, key in zip(target, ref, b["keys"]):
            assert t.sum() > 20, key  # the marker is in view
            assert (t ^ r).sum() <= 0.25 * t.sum(), (key, (t ^ r).sum(), t.sum())
        seen += len(b["keys"])
    return seen


def flipped_count(path, batches, **params) -> int:
    """How many samples of ``batches`` came out mirrored: the same stream without flips gives the same keys
    and crops (the flip draw is made either way)."""
    straight = take(loader(path, **{**params, "random_flip": 0.0}), len(batches))
    n = 0
    for b, s in zip(batches, straight):
        assert b["keys"] == s["keys"]
        for x, y, rx, ry in zip(b["pixel_values"], s["pixel_values"], b["reference_values"], s["reference_values"]):
            if not torch.equal(x, y):
                assert torch.equal(x, y.flip(-1)) and torch.equal(rx, ry.flip(-1))  # flipped together
                n += 1
    return n


def test_tar_pairs_stay_aligned_through_crops_buckets_and_flips_with_two_workers(tmp_path):
    pairs = [marker_pair(i, scale=1 + i % 2) for i in range(16)]
    for k in range(2):
        write_tar(str(tmp_path / f"m-{k}.tar"), [{"__key__": key, "png": t, "ref.png": r, "txt": c}
                                                 for key, t, r, c in pairs[k::2]])
    path = str(tmp_path / "m-{0..1}.tar")
    params = dict(workers=2, **GEOMETRY)
    batches = take(loader(path, **params), 8)
    assert assert_aligned(batches) == 16
    assert len({tuple(b["pixel_values"].shape[2:]) for b in batches}) > 1  # several buckets
    assert flipped_count(path, batches, **params) >= 3


def test_table_pairs_as_bytes_lists_and_paths(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pairs = [marker_pair(i) for i in range(12)]
    # parquet: a binary column, then Hugging Face's {bytes, path} struct in one list-valued column
    table = pa.table({"key": [p[0] for p in pairs], "image": [p[1] for p in pairs], "caption": [p[3] for p in pairs],
                      "reference": [p[2] for p in pairs]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=3)
    assert assert_aligned(take(loader(str(tmp_path / "t.parquet"), type="parquet", workers=2, **GEOMETRY), 6)) == 12
    listed = pa.table({"key": [p[0] for p in pairs], "image": [p[1] for p in pairs], "caption": [p[3] for p in pairs],
                       "reference": [[{"bytes": p[2], "path": None}] for p in pairs]})
    pq.write_table(listed, tmp_path / "l.parquet", row_group_size=3)
    assert assert_aligned(take(loader(str(tmp_path / "l.parquet"), type="parquet", **GEOMETRY), 6)) == 12
    # CSV: paths relative to the table's folder, in the columns reference and reference2
    (tmp_path / "img").mkdir()
    lines = ["key,image,caption,reference,reference2"]
    for key, target, ref, caption in pairs:
        (tmp_path / "img" / f"{key}.png").write_bytes(target)
        (tmp_path / "img" / f"{key}_r.png").write_bytes(ref)
        lines.append(f"{key},img/{key}.png,{caption},img/{key}_r.png,img/{key}_r.png")
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    batches = take(loader(str(tmp_path / "t.csv"), type="CSV", workers=2, **{**GEOMETRY, "references": 2}), 6)
    assert assert_aligned(batches) == 12
    assert all(torch.equal(b["reference_values"][:, 0], b["reference_values"][:, 1]) for b in batches)


def test_folder_sidecars_are_references_not_images(tmp_path):
    root = tmp_path / "flat"
    root.mkdir()
    for key, target, ref, caption in (marker_pair(i, scale=2) for i in range(12)):
        (root / f"{key}.png").write_bytes(target)
        (root / f"{key}.txt").write_text(caption)
        (root / f"{key}.ref.jpg").write_bytes(_jpeg(Image.open(io.BytesIO(ref))))
    ld = loader(str(root), type="folder", workers=2, **GEOMETRY)
    batches = take(ld, 6)
    assert assert_aligned(batches) == 12
    assert not any(".ref" in k for b in batches for k in b["keys"])  # sidecars are not images of the set
    # Without references the same folder's sidecars are images of their own (no caption: skipped and counted)
    plain = loader(str(root), type="folder", **{**GEOMETRY, "references": 0})
    take(plain, 2)
    assert plain.stats()["skipped/missing_caption"] >= 1


def _jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def test_references_draw_no_random_number(edit_shards):
    """The targets, captions and order of a paired stream are those of the same shards read without references;
    each reference's shape sits where its target's does."""
    params = dict(resolution=32, center_crop=False, random_flip=0.5, batch_size=4, caption_dropout=0.3, workers=2)
    paired, plain = take(loader(edit_shards, references=1, **params), 6), take(loader(edit_shards, **params), 6)
    for a, b in zip(paired, plain):
        assert a["keys"] == b["keys"] and a["captions"] == b["captions"]
        assert torch.equal(a["pixel_values"], b["pixel_values"]) and "reference_values" not in b
        for key, target, ref in zip(a["keys"], a["pixel_values"], a["reference_values"][:, 0]):
            pair = edit_sample(int(key), 32, 0)
            shape_t, shape_r = off(target, "blue"), off(ref, pair.backgrounds[0])
            assert (shape_t & shape_r).sum() > 0.7 * (shape_t | shape_r).sum(), key  # the shape, in both


def off(picture: torch.Tensor, background: str) -> np.ndarray:
    """bool [H, W]: the pixels of a uint8 [3, H, W] picture whose nearest palette colour is not ``background``."""
    px = picture.permute(1, 2, 0).numpy().astype(float)[..., None, :]
    nearest = np.argmin(((px - np.array(list(COLOURS.values()), float)) ** 2).sum(-1), axis=-1)
    return nearest != list(COLOURS).index(background)


def test_center_references_are_resized_on_their_own(tmp_path):
    """reference_crop=center: a reference of another aspect is cover-resized and centre-cropped to its target's
    size (flipped with it); aligned skips it as reference_aspect_mismatch."""
    from sd_training.data.transforms import decode_cropped, open_image

    img = Image.new("RGB", (40, 80), COLOURS["green"])
    ImageDraw.Draw(img).rectangle([0, 0, 39, 19], fill=MARKER)  # a top band: the centre crop cuts most of it
    ref = _jpeg(img)
    samples = [{"__key__": f"c{i}", "jpg": _jpeg(Image.new("RGB", (64, 48), COLOURS["white"])), "ref.jpg": ref,
                "txt": "x"} for i in range(4)]
    shard = write_tar(str(tmp_path / "c.tar"), samples)
    batch = take(loader(shard, resolution=32, references=1, reference_crop="center", batch_size=4), 1)[0]
    h, w = batch["pixel_values"].shape[2:]
    want = decode_cropped(open_image(ref), w, h, center_crop=True, flip=False, rng=None).pixels
    for r in batch["reference_values"][:, 0]:
        assert torch.equal(r.permute(1, 2, 0), torch.from_numpy(np.array(want)))
    aligned = loader(shard, resolution=32, references=1, batch_size=2)
    with pytest.raises(RuntimeError, match="reference_aspect_mismatch"):
        take(aligned, 1)


def test_bad_pairs_are_skipped_counted_and_named(tmp_path, caplog):
    key, target, ref, caption = marker_pair(0)
    other = marker_pair(1)[2]  # 64 x 96: not the 96 x 64 target's aspect
    good = [{"__key__": f"g{i}", "png": target, "ref.png": ref, "txt": caption} for i in range(6)]
    shard = write_tar(str(tmp_path / "bad.tar"), [
        {"__key__": "no_ref", "png": target, "txt": caption},
        {"__key__": "broken_ref", "png": target, "ref.png": b"this is no png", "txt": caption},
        {"__key__": "other_aspect", "png": target, "ref.png": other, "txt": caption},
        *good])
    with caplog.at_level("WARNING", logger="sd_training.data"):
        ld = loader(shard, references=1, resolution=32, batch_size=2, shuffle_buffer=1)
        batches = take(ld, 3)
    assert sorted(k for b in batches for k in b["keys"]) == sorted(s["__key__"] for s in good)
    stats = ld.stats()
    assert (stats["skipped/missing_reference"], stats["skipped/corrupt_reference"],
            stats["skipped/reference_aspect_mismatch"]) == (1, 1, 1)
    for name in ("no_ref", "broken_ref", "other_aspect"):
        assert f"bad.tar sample '{name}'" in caplog.text
    assert "reference ref is 64x96 px, its target 96x64" in caplog.text
    # Tables: a path that cannot be read, and one outside the table's folder
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "t.png").write_bytes(target)
    (tmp_path / "d" / "r.png").write_bytes(ref)
    (tmp_path / "d" / "t.csv").write_text("key,image,caption,reference\n" + "\n".join(
        [f"k{i},t.png,c,r.png" for i in range(4)] + ["gone,t.png,c,nothing.png", "outside,t.png,c,../x.png"]) + "\n")
    with caplog.at_level("WARNING", logger="sd_training.data"):
        ld = loader(str(tmp_path / "d" / "t.csv"), type="CSV", references=1, resolution=32, batch_size=4,
                    shuffle_buffer=1)
        assert sorted(take(ld, 1)[0]["keys"]) == ["k0", "k1", "k2", "k3"]
    stats = ld.stats()
    assert stats["skipped/reference_unreadable"] == 1 and stats["skipped/path_outside_root"] == 1
    assert "sample 'gone'" in caplog.text and "nothing.png" in caplog.text
    with pytest.raises(DatasetConfigError, match="reference_column='ref'"):
        loader(str(tmp_path / "d" / "t.csv"), type="CSV", references=1, reference_column="ref")


def background_of(picture: torch.Tensor) -> str:
    """The colour name of a uint8 [3, H, W] picture's border (its background, wherever the shape is)."""
    return read_shape_image(picture.permute(1, 2, 0).numpy())["background"]


def test_filters_mixtures_and_masked_loss_on_paired_data(tmp_path):
    a = write_edit_shards(str(tmp_path / "a"), 16, 2, size=32, seed=0, prefix="a")
    b = write_edit_shards(str(tmp_path / "b"), 16, 2, size=32, seed=1, prefix="b", references=2)
    keep = {"circle", "square"}
    sources = [{"path": a, "name": "a", "weight": 1, "filters": {"shape": "in [circle, square]"}},
               {"path": b, "name": "b", "weight": 1}]
    ld = loader(f"{a}::{b}", sources=sources, references=1, resolution=32, batch_size=4, workers=2, resampled=True)
    ld.proc.preview = True  # batches name each sample's source
    seen = Counter()
    for batch in take(ld, 6):
        assert batch["reference_values"].shape == (4, 1, 3, 32, 32)
        for key, source, target, ref in zip(batch["keys"], batch["sources"], batch["pixel_values"],
                                            batch["reference_values"][:, 0]):
            pair = edit_sample(int(key), 32, {"a": 0, "b": 1}[source])
            assert source == "b" or pair.shape in keep  # the filter of source a
            assert background_of(target) == "blue" and background_of(ref) == pair.backgrounds[0], (source, key)
            seen[source] += 1
    assert seen["a"] and seen["b"]
    assert ld.stats()["skipped/filter:shape"] > 0
    # Masked loss weighs the target; references come along unchanged.
    masks = [{"__key__": f"m{i}", "png": marker_pair(i)[1], "ref.png": marker_pair(i)[2], "txt": "x",
              "mask.png": _mask_of(marker_pair(i)[1])} for i in range(4)]
    shard = write_tar(str(tmp_path / "m.tar"), masks)
    batch = take(loader(shard, masked_loss=True, **{**GEOMETRY, "batch_size": 4, "aspect_buckets": False}), 1)[0]
    weight = batch["loss_weight"][:, 0]
    red = marker(batch["pixel_values"]).reshape(4, 8, 8, 8, 8).mean(axis=(2, 4))
    assert np.abs(red - weight.numpy()).max() < 0.15
    assert_aligned([batch])


def _mask_of(png: bytes) -> bytes:
    px = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    buf = io.BytesIO()
    Image.fromarray(((px[..., 1] < 100) * 255).astype(np.uint8), "L").save(buf, format="PNG")
    return buf.getvalue()


def assert_same_pairs(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a["keys"] == b["keys"] and a["epochs"] == b["epochs"]
        assert torch.equal(a["pixel_values"], b["pixel_values"])
        assert torch.equal(a["reference_values"], b["reference_values"])


def test_a_paired_stream_resumes_exactly_and_on_another_rank_count(edit_shards):
    kw = dict(references=1, resolution=32, center_crop=False, random_flip=0.5, batch_size=3, shuffle_buffer=5,
              seed=3, canonical_readers=4)
    straight = take(loader(edit_shards, workers=2, **kw), 8)
    first = loader(edit_shards, workers=2, **kw)
    head = take(first, 4)  # an even count: the micro-batches so far split over 2 ranks
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint holds it
    again = loader(edit_shards, workers=2, **kw)
    again.load_state_dict(state)
    assert_same_pairs(head + take(again, 4), straight)
    # Elastic: the 4 readers of 1 rank x 2 workers continue on 2 ranks x 1 worker, the same micro-batches.
    two = [loader(edit_shards, rank=r, world_size=2, workers=1, **kw) for r in range(2)]
    for ld in two:
        ld.load_state_dict([state])
    its = [iter(ld) for ld in two]
    try:
        assert_same_pairs(head + [next(its[m % 2]) for m in range(4)], straight)
    finally:
        for it in its:
            it.close()


def test_latent_pairs_missing_or_bad_reference_latents_are_skipped(tmp_path):
    from sd_training.data.latents import npy_bytes

    def sample(key, *refs):
        s = {"__key__": key, "latents.npy": npy_bytes(np.ones((8, 4, 4), np.float16)), "txt": "c",
             "json": {"latent_store": "mean_std"}}
        s.update({name: npy_bytes(arr) for name, arr in zip(("ref.latents.npy", "ref2.latents.npy"), refs)})
        return s

    good = np.full((8, 4, 4), 2, np.float16)
    shard = write_tar(str(tmp_path / "lat.tar"), [
        sample("no_ref"), sample("one_ref", good), sample("wrong_shape", good, np.ones((8, 2, 2), np.float16)),
        *(sample(f"g{i}", good, good) for i in range(4))])
    ld = loader(shard, type="latents", references=2, batch_size=4, shuffle_buffer=1, latent_sampling="mean")
    batch = take(ld, 1)[0]
    assert sorted(batch["keys"]) == ["g0", "g1", "g2", "g3"]
    assert batch["reference_latents"].shape == (4, 2, 4, 4, 4) and (batch["reference_latents"] == 2).all()
    stats = ld.stats()
    assert stats["skipped/missing_reference"] == 2 and stats["skipped/bad_reference_latents"] == 1
