"""Captions (dropout, tag shuffling), image geometry (crop, flip, min size, fast decode), aspect buckets."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from data_fixtures import assert_same_batches, jpeg_bytes, loader, take, tokenizer, write_tar
from PIL import Image, JpegImagePlugin

from sd_training.data.buckets import assign_bucket, make_buckets
from sd_training.data.captions import CaptionAugment, shuffle_tags
from sd_training.data.synthetic import shape_sample, write_shapes_shards
from sd_training.data.transforms import decode_cropped, open_image


def _tar_of(tmp_path, n, caption="a, b, c, d, e, f", size=(40, 40), name="c.tar"):
    samples = [{"__key__": f"k{i:04d}", "jpg": jpeg_bytes(*size), "txt": caption} for i in range(n)]
    return write_tar(str(tmp_path / name), samples)


def test_caption_dropout_rate_and_empty_tokens(tmp_path):
    path = _tar_of(tmp_path, 50, caption="a red circle")
    batches = take(loader(path, batch_size=10, caption_dropout=0.3, shuffle_buffer=1), 20)
    caps = [c for b in batches for c in b["captions"]]
    assert set(caps) == {"", "a red circle"}
    assert 0.2 < caps.count("") / len(caps) < 0.4
    tok = tokenizer()
    empty = tok([""], padding="max_length", max_length=77, return_tensors="pt").input_ids[0]
    for b in batches:
        for c, ids in zip(b["captions"], b["input_ids"]):
            if c == "":
                assert torch.equal(ids, empty) and ids[0] == tok.bos_token_id and ids[1] == tok.eos_token_id


def test_tag_shuffle_keeps_the_first_n(tmp_path):
    path = _tar_of(tmp_path, 40)
    batches = take(loader(path, batch_size=10, shuffle_tags=1.0, keep_tags=2, shuffle_buffer=1), 4)
    caps = [c for b in batches for c in b["captions"]]
    for c in caps:
        parts = c.split(", ")
        assert parts[:2] == ["a", "b"] and sorted(parts) == ["a", "b", "c", "d", "e", "f"]
    assert len(set(caps)) > 5  # really shuffled
    rng = np.random.default_rng(0)
    assert shuffle_tags(["x"], 0, rng) == ["x"] and shuffle_tags([], 3, rng) == []


def test_caption_randomness_is_per_sample_and_independent_of_other_settings():
    aug = CaptionAugment(shuffle_p=0.0, keep=0, dropout=0.5)
    aug2 = CaptionAugment(shuffle_p=1.0, keep=0, dropout=0.5)
    for seed in range(30):
        a = aug("x, y, z", None, np.random.default_rng(seed))
        b = aug2("x, y, z", None, np.random.default_rng(seed))
        assert (a == "") == (b == "")  # turning shuffling on does not change which captions drop


def test_flip_and_crops(tmp_path):
    # Left half red, right half blue, 80x40: the centre crop of the 40x40 resize keeps both halves.
    img = Image.new("RGB", (80, 40), (255, 0, 0))
    img.paste((0, 0, 255), (40, 0, 80, 40))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    path = write_tar(str(tmp_path / "f.tar"), [{"__key__": f"k{i}", "png": buf.getvalue(), "txt": "x"} for i in range(16)])
    plain = take(loader(path, batch_size=16, resolution=32, shuffle_buffer=1), 1)[0]["pixel_values"]
    flipped = take(loader(path, batch_size=16, resolution=32, random_flip=1.0, shuffle_buffer=1), 1)[0]["pixel_values"]
    assert torch.equal(flipped, torch.flip(plain, dims=[3]))
    assert plain[0, 0, :, :8].float().mean() > 242 and plain[0, 2, :, -8:].float().mean() > 242  # red left, blue right
    random = take(loader(path, batch_size=16, resolution=32, center_crop=False, shuffle_buffer=1), 1)[0]["pixel_values"]
    red_share = ((random[:, 0] > 127).float().mean(dim=(1, 2))).numpy()
    assert red_share.std() > 0.05  # different crop offsets per sample
    half = take(loader(path, batch_size=16, resolution=32, random_flip=0.5, shuffle_buffer=1), 1)[0]["pixel_values"]
    n_flipped = sum(bool(torch.equal(h, f)) for h, f in zip(half, flipped))
    assert 3 <= n_flipped <= 13


def test_min_size_skips_small_sources_before_decoding(tmp_path):
    samples = [{"__key__": f"s{i}", "jpg": jpeg_bytes(30 + 10 * (i % 4), 80), "txt": "x"} for i in range(8)]
    path = write_tar(str(tmp_path / "m.tar"), samples)
    ld = loader(path, batch_size=4, min_size=50, shuffle_buffer=1)
    b = take(ld, 1)[0]
    assert sorted(b["keys"]) == ["s2", "s3", "s6", "s7"]
    assert ld.stats()["skipped/too_small"] == 4


def test_fast_decode_uses_jpeg_draft_and_matches_full_decode(monkeypatch):
    _, data, _, _ = shape_sample(1, (1024, 768), seed=0)
    calls = []
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size, *a, **kw):
        calls.append(size)
        return original(self, mode, size, *a, **kw)

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    fast = decode_cropped(open_image(data), 256, 256, center_crop=True, flip=False, rng=None, fast_decode=True).pixels
    assert calls == [(341, 256)]  # asked for the cover size; libjpeg decodes at 1/2 (512x384)
    full = decode_cropped(open_image(data), 256, 256, center_crop=True, flip=False, rng=None, fast_decode=False).pixels
    assert len(calls) == 1 and fast.shape == full.shape == (256, 256, 3)
    assert np.abs(fast.astype(int) - full.astype(int)).mean() < 3.0
    # How much faster it is: benchmarks/bench_data.py (a timed assertion here would be noise on a shared CPU).


def test_buckets_have_equal_area_and_bounded_ratio():
    buckets = make_buckets(512, 64, 2.0)
    assert (512, 512) in buckets
    for w, h in buckets:
        assert w % 64 == 0 and h % 64 == 0
        assert 0.85 * 512 * 512 <= w * h <= 512 * 512
        assert max(w / h, h / w) <= 2.0
    assert assign_bucket(1000, 1000, buckets) == (512, 512)
    wide = assign_bucket(1600, 900, buckets)
    assert wide[0] > wide[1] and abs(wide[0] / wide[1] - 16 / 9) < 0.2
    assert assign_bucket(900, 1600, buckets) == wide[::-1]


def test_aspect_bucketed_batches_never_mix_buckets_and_resume_exactly(tmp_path):
    sizes = [(96, 64), (64, 96), (64, 64), (128, 64), (80, 80)]
    pattern = write_shapes_shards(str(tmp_path), n_samples=60, n_shards=6, seed=1, sizes=sizes)
    kw = dict(resolution=64, bucket_step=16, aspect_buckets=True, batch_size=3, shuffle_buffer=5, workers=2)
    ld = loader(pattern, seed=3, **kw)
    batches = take(ld, 12)
    shapes = set()
    for b in batches:
        shape = tuple(b["pixel_values"].shape[2:])
        shapes.add(shape)
        assert b["pixel_values"].shape[0] == 3
    assert (64, 64) in shapes and any(h > w for h, w in shapes) and any(w > h for h, w in shapes)
    st = ld.stats()
    assert sum(v for k, v in st.items() if k.startswith("bucket/")) == 36
    # Resume with partially filled buckets in the saved state.
    first = loader(pattern, seed=3, **kw)
    it = iter(first)
    head = [next(it) for _ in range(5)]
    state = first.state_dict()
    assert any(st["buckets"] for st in state["reader_states"].values())
    del it
    again = loader(pattern, seed=3, **kw)
    again.load_state_dict(state)
    assert_same_batches(batches, head + take(again, 7))


def test_bucketed_positions_move_from_one_rank_to_two_with_partly_filled_buckets(tmp_path):
    """4 canonical readers on 1 rank x 2 workers, then on 2 ranks x 1 worker: partly filled buckets travel
    with their readers, and the run's micro-batches go on as on one rank."""
    sizes = [(96, 64), (64, 96), (64, 64), (128, 64), (80, 80)]
    pattern = write_shapes_shards(str(tmp_path), n_samples=80, n_shards=8, seed=1, sizes=sizes)
    kw = dict(resolution=64, bucket_step=16, aspect_buckets=True, batch_size=3, shuffle_buffer=4, seed=3,
              canonical_readers=4)
    ref = take(loader(pattern, workers=2, **kw), 14)
    one = loader(pattern, workers=2, **kw)
    head = take(one, 6)
    state = one.state_dict()
    assert any(st["buckets"] for st in state["reader_states"].values())
    two = [loader(pattern, rank=r, world_size=2, workers=1, **kw) for r in range(2)]
    for ld in two:
        ld.load_state_dict([state])
    its = [iter(ld) for ld in two]
    tail = [next(its[m % 2]) for m in range(8)]  # micro-batch m of the run: rank m mod 2's next one
    assert_same_batches(ref, head + tail)


def test_16_bit_greyscale_is_rescaled_not_clipped_to_white():
    """A 16-bit PNG at half grey must train as mid grey (PIL's plain convert clips it to white)."""
    import io

    import numpy as np
    from PIL import Image

    from sd_training.data.transforms import decode_cropped, open_image

    buf = io.BytesIO()
    Image.fromarray(np.full((16, 16), 32768, dtype=np.uint16)).save(buf, format="PNG")
    img = open_image(buf.getvalue())
    assert img.mode.startswith("I")
    out = decode_cropped(img, 16, 16, center_crop=True, flip=False, rng=None).pixels
    assert out.shape == (16, 16, 3) and abs(int(out.mean()) - 128) <= 1


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied(orientation):
    """A camera JPEG stored sideways with an EXIF orientation trains as it is shown: the red top half
    of the picture as shown is on top after decoding, at the shown aspect ratio."""
    import io

    import numpy as np
    from PIL import Image

    from sd_training.data.transforms import _TRANSPOSES, decode_cropped, open_image

    shown = np.zeros((64, 32, 3), dtype=np.uint8)  # portrait as shown: red top half, blue bottom half
    shown[:32, :, 0] = 255
    shown[32:, :, 2] = 255
    stored = Image.fromarray(shown)
    inverse = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}
    stored = stored.transpose(inverse[orientation])  # what the camera wrote
    assert stored.transpose(_TRANSPOSES[orientation][0]).size == (32, 64)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    stored.save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    out = decode_cropped(open_image(buf.getvalue()), 32, 64, center_crop=True, flip=False, rng=None).pixels
    assert out.shape == (64, 32, 3)
    assert out[:24, :, 0].mean() > 200 and out[:24, :, 2].mean() < 60  # red on top
    assert out[40:, :, 2].mean() > 200 and out[40:, :, 0].mean() < 60  # blue below
