"""SDXL's micro-conditioning and second tokenizer from the image pipeline, on real tar shards through the
real loader: ``original_size``, ``crop_top_left``, ``target_size`` (int64 [B, 2], (h, w) / (y, x)) and
``input_ids_2``."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from data_fixtures import jpeg_bytes, make_cfg, take, tokenizer, write_tar
from PIL import Image

from sd_training.data import build_train_loader
from sd_training.data.buckets import assign_bucket, make_buckets
from sd_training.data.latents import npy_bytes
from sd_training.data.transforms import EXIF_ORIENTATION, decode_cropped, open_image

RES = 32


def load(path, tok=None, seed=0, **params):
    params.setdefault("resolution", RES)
    params.setdefault("shuffle_buffer", 1)
    cfg = make_cfg(path, **params)
    return build_train_loader(cfg, tokenizer=tok if tok is not None else tokenizer(), rank=0, world_size=1, seed=seed)


def gradient_png(w: int, h: int) -> bytes:
    """Red rises left to right (0 at column 0, 255 at the last), green top to bottom: a pixel's colour
    says where in the source it comes from."""
    red = np.round(np.arange(w) * 255 / (w - 1)).astype(np.uint8)
    green = np.round(np.arange(h) * 255 / (h - 1)).astype(np.uint8)
    arr = np.zeros((h, w, 3), np.uint8)
    arr[..., 0] = red[None, :]
    arr[..., 1] = green[:, None]
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def cover(w: int, h: int, out_w: int, out_h: int):
    """The resized (cover-scaled) width and height, as the arithmetic says (aspect kept, one side exact)."""
    scale = max(out_w / w, out_h / h)
    return max(out_w, round(w * scale)), max(out_h, round(h * scale))


def write_shards(folder, name, samples, shards=2):
    """``samples`` dealt round-robin into ``shards`` tar files (one per DataLoader worker); the brace pattern."""
    for k in range(shards):
        write_tar(str(folder / f"{name}-{k}.tar"), samples[k::shards])
    return str(folder / f"{name}-{{0..{shards - 1}}}.tar")


def batches_of(path, n, **params):
    return take(load(path, **params), n)


def rows(batches, name):
    return torch.cat([b[name] for b in batches]).tolist()


# -- (a) crop_top_left --------------------------------------------------------------------------------------


def test_center_crop_corner_is_the_cover_resize_arithmetic(tmp_path):
    # 100x60 (wide) and 50x90 (tall) at 32 px: cover sizes 53x32 and 32x58; centre offsets floor((r - 32) / 2).
    assert cover(100, 60, RES, RES) == (53, 32) and cover(50, 90, RES, RES) == (32, 58)
    samples = [{"__key__": f"w{i}", "png": gradient_png(100, 60), "txt": "wide"} for i in range(4)]
    samples += [{"__key__": f"t{i}", "png": gradient_png(50, 90), "txt": "tall"} for i in range(4)]
    path = write_tar(str(tmp_path / "c.tar"), samples)
    b = batches_of(path, 1, batch_size=8, center_crop=True)[0]
    want = {"wide": [0, (53 - RES) // 2], "tall": [(58 - RES) // 2, 0]}
    assert want == {"wide": [0, 10], "tall": [13, 0]}
    for cap, corner, orig, target in zip(b["captions"], b["crop_top_left"].tolist(), b["original_size"].tolist(),
                                         b["target_size"].tolist()):
        assert corner == want[cap]
        assert orig == ([60, 100] if cap == "wide" else [90, 50])  # (height, width) of the PNG
        assert target == [RES, RES]
    for name in ("original_size", "crop_top_left", "target_size"):
        assert b[name].dtype == torch.int64 and b[name].shape == (8, 2)
    # Flipped, the corner is measured in the flipped resized image: x = 53 - 10 - 32 = 11 (not 10: the
    # floor of the centre offset makes the crop asymmetric), y unchanged.
    f = batches_of(path, 1, batch_size=8, center_crop=True, random_flip=1.0)[0]
    flipped_want = {"wide": [0, 53 - 10 - RES], "tall": [13, 0]}
    assert flipped_want["wide"] == [0, 11]
    for cap, corner in zip(f["captions"], f["crop_top_left"].tolist()):
        assert corner == flipped_want[cap]
    assert f["keys"] == b["keys"] and torch.equal(f["pixel_values"], torch.flip(b["pixel_values"], dims=[3]))


def _red_of_first_column(x: int, flipped: bool, src_w: int = 100, rw: int = 53) -> float:
    """The red the output's first column should have when the crop starts at resized column ``x`` (in the
    flipped image when ``flipped``): a linear gradient survives a bicubic resize."""
    col = rw - 1 - x if flipped else x  # the resized column (unflipped) the first output column shows
    src = (col + 0.5) * src_w / rw - 0.5
    return src * 255 / (src_w - 1)


def test_random_crop_corners_vary_stay_in_range_and_follow_the_flip_rule(tmp_path):
    n = 24
    samples = [{"__key__": f"k{i:02d}", "png": gradient_png(100, 60), "txt": f"c {i}"} for i in range(n)]
    path = write_shards(tmp_path, "r", samples)
    plain = batches_of(path, 3, batch_size=8, center_crop=False, workers=2)
    flipped = batches_of(path, 3, batch_size=8, center_crop=False, random_flip=1.0, workers=2)
    rw, _ = cover(100, 60, RES, RES)
    corners = rows(plain, "crop_top_left")
    assert len(corners) == n
    assert all(y == 0 for y, _ in corners)  # the height is exact: no vertical freedom
    xs = [x for _, x in corners]
    assert all(0 <= x <= rw - RES for x in xs)
    assert len(set(xs)) >= 6  # random offsets, per sample
    # The same seed draws the same crops whatever the flip probability (the flip draw comes first, always):
    # flipped, x = resized_w - x - crop_w; the pixels are the mirror image.
    assert rows(flipped, "crop_top_left") == [[y, rw - x - RES] for y, x in corners]
    for a, b in zip(plain, flipped):
        assert a["keys"] == b["keys"] and torch.equal(b["pixel_values"], torch.flip(a["pixel_values"], dims=[3]))
    # The reported corner is where the pixels come from (red encodes the source column).
    for batches, is_flipped in ((plain, False), (flipped, True)):
        for b in batches:
            for img, (_, x) in zip(b["pixel_values"], b["crop_top_left"].tolist()):
                red = img[0, 4:-4, 0].float().mean().item()  # first column, away from the top/bottom edges
                assert abs(red - _red_of_first_column(x, is_flipped)) < 4, (x, is_flipped, red)


def test_the_crop_corner_comes_from_the_generator_alone():
    """A center crop draws nothing; a random crop is a function of the generator (same seed: same corner,
    same pixels, same generator state after), so resume replays it."""
    img_bytes = gradient_png(100, 60)
    r0 = np.random.default_rng(5)
    decode_cropped(open_image(img_bytes), RES, RES, center_crop=True, flip=False, rng=r0)
    assert r0.random() == np.random.default_rng(5).random()
    r1, r2 = np.random.default_rng(5), np.random.default_rng(5)
    d = decode_cropped(open_image(img_bytes), RES, RES, center_crop=False, flip=False, rng=r1)
    e = decode_cropped(open_image(img_bytes), RES, RES, center_crop=False, flip=False, rng=r2)
    assert np.array_equal(d.pixels, e.pixels) and d.crop_top_left == e.crop_top_left and r1.random() == r2.random()
    y, x = d.crop_top_left
    assert y == 0 and 0 <= x <= 21 and d.original_size == (60, 100)


# -- (b) original_size ---------------------------------------------------------------------------------------


def test_original_size_from_metadata_else_from_the_full_size_image(tmp_path):
    img = jpeg_bytes(200, 120)  # large enough for a reduced-scale (1/2) JPEG decode at 32 px
    metas = {
        "meta": {"original_height": 1080, "original_width": 1920},
        "float": {"original_height": 768.0, "original_width": 512.0},
        "half": {"original_width": 640},  # one side only: the image's own size
        "bad": {"original_height": "big", "original_width": 0},
        "none": None,
    }
    samples = []
    for name, meta in metas.items():
        s = {"__key__": name, "jpg": img, "txt": name}
        if meta is not None:
            s["json"] = meta
        samples.append(s)
    path = write_tar(str(tmp_path / "o.tar"), samples)
    want = {"meta": [1080, 1920], "float": [768, 512], "half": [120, 200], "bad": [120, 200], "none": [120, 200]}
    for fast in (True, False):
        b = batches_of(path, 1, batch_size=5, fast_decode=fast)[0]
        assert sorted(b["keys"]) == sorted(metas)
        got = dict(zip(b["keys"], b["original_size"].tolist()))
        assert got == want
        # The metadata changes original_size only, not the crop: 200x120 covers 53x32, centre x = 10.
        assert b["crop_top_left"].tolist() == [[0, 10]] * 5


def test_exif_turned_image_has_the_shown_size_and_bucket(tmp_path):
    # Stored 96 wide x 64 high with EXIF orientation 6 (turn 90 degrees): shown 64 wide x 96 high, portrait.
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    Image.new("RGB", (96, 64), (10, 200, 10)).save(buf, format="JPEG", exif=exif.tobytes())
    path = write_tar(str(tmp_path / "e.tar"), [{"__key__": f"e{i}", "jpg": buf.getvalue(), "txt": "x"} for i in range(2)])
    b = batches_of(path, 1, batch_size=2, resolution=64, bucket_step=16, aspect_buckets=True)[0]
    w, h = assign_bucket(64, 96, make_buckets(64, 16, 2.0))
    assert h > w
    assert b["original_size"].tolist() == [[96, 64]] * 2
    assert b["target_size"].tolist() == [[h, w]] * 2
    assert tuple(b["pixel_values"].shape[2:]) == (h, w)


# -- (c) target_size ------------------------------------------------------------------------------------------


def test_target_size_is_the_bucket_as_height_width(tmp_path):
    sizes = {"wide": (120, 60), "tall": (60, 120), "square": (80, 80)}  # (width, height)
    samples = [{"__key__": f"{name}{i}", "png": gradient_png(*wh), "txt": name}
               for i in range(6) for name, wh in sizes.items()]
    path = write_shards(tmp_path, "b", samples)
    buckets = make_buckets(64, 16, 2.0)
    want = {}
    for name, (w, h) in sizes.items():
        bw, bh = assign_bucket(w, h, buckets)
        want[name] = [bh, bw]
    assert want["wide"][1] > want["wide"][0] and want["tall"][0] > want["tall"][1] and want["square"] == [64, 64]
    ld = load(path, resolution=64, bucket_step=16, aspect_buckets=True, batch_size=3, workers=2, shuffle_buffer=4)
    seen = set()
    for b in take(ld, 6):
        target = b["target_size"].tolist()
        name = b["captions"][0]
        assert target == [want[name]] * 3 and set(b["captions"]) == {name}  # a batch never mixes buckets
        assert list(b["pixel_values"].shape[2:]) == want[name]  # H, W of the pixels
        rw, rh = cover(*sizes[name], want[name][1], want[name][0])
        for y, x in b["crop_top_left"].tolist():
            assert [y, x] == [(rh - want[name][0]) // 2, (rw - want[name][1]) // 2]
        assert b["original_size"].tolist() == [[sizes[name][1], sizes[name][0]]] * 3
        seen.add(name)
    assert seen == set(sizes)


# -- (d) the second tokenizer -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_2(tmp_path_factory):
    """A second CLIP tokenizer, 64 tokens, padding with '!' (id 0) as SDXL's tokenizer_2 does."""
    from sd_training.families.components.clip import build_clip_tokenizer

    tok = build_clip_tokenizer(tmp_path_factory.mktemp("tok2"), model_max_length=64)
    tok.pad_token = "!"
    assert tok.pad_token_id == 0 and tok.model_max_length == 64
    return tok


def test_two_tokenizers_give_input_ids_and_input_ids_2(tmp_path, tokenizer_2):
    tok = tokenizer()
    captions = ["a red circle", "a big blue square on a white background", "", "x " * 100]
    samples = [{"__key__": f"k{i}", "jpg": jpeg_bytes(48, 40), "txt": c} for i, c in enumerate(captions)] * 2
    samples = [dict(s, __key__=f"{s['__key__']}_{j}") for j, s in enumerate(samples)]
    path = write_shards(tmp_path, "t", samples)
    for workers in (0, 2):
        for tok_arg in ((tok, tokenizer_2), [tok, tokenizer_2]):
            batches = take(load(path, tok=tok_arg, batch_size=4, workers=workers, shuffle_buffer=3), 2)
            for b in batches:
                caps = b["captions"]
                assert b["input_ids"].shape == (4, 77) and b["input_ids"].dtype == torch.int64
                assert b["input_ids_2"].shape == (4, 64) and b["input_ids_2"].dtype == torch.int64
                one = tok(caps, padding="max_length", truncation=True, max_length=77, return_tensors="pt").input_ids
                two = tokenizer_2(caps, padding="max_length", truncation=True, max_length=64, return_tensors="pt").input_ids
                assert torch.equal(b["input_ids"], one) and torch.equal(b["input_ids_2"], two)
                for c, a, z in zip(caps, b["input_ids"], b["input_ids_2"]):
                    if c.startswith("x x"):  # truncated to each one's own length, eos last, no padding
                        assert torch.equal(a[:63], z[:63]) and a[76] == z[63] == 49407 and a[63] != 49407
                        assert (a != 0).all() and (z != 0).all()
                        continue
                    n = len(tok(c).input_ids)  # bos + words + eos: the same ids in both
                    assert n < 20 and torch.equal(a[:n], z[:n]) and z[n - 1] == tok.eos_token_id == 49407
                    assert (a[n:] == 49407).all() and (z[n:] == 0).all()  # each tokenizer's own padding
            assert [tuple(b["input_ids"].shape) for b in batches] == [(4, 77)] * 2
    # One tokenizer: no input_ids_2, the rest as before.
    single = take(load(path, batch_size=4), 1)[0]
    assert "input_ids_2" not in single and single["input_ids"].shape == (4, 77)
    assert set(single) == {"pixel_values", "input_ids", "original_size", "crop_top_left", "target_size", "captions",
                           "keys", "epochs", "sample_seeds"}


def test_processor_with_two_tokenizers_pickles(tmp_path, tokenizer_2):
    path = write_tar(str(tmp_path / "p.tar"), [{"__key__": f"k{i}", "jpg": jpeg_bytes(), "txt": "x"} for i in range(4)])
    proc = load(path, tok=(tokenizer(), tokenizer_2), batch_size=4).proc
    again = pickle.loads(pickle.dumps(proc))
    assert [t.model_max_length for t in again.tokenizers] == [77, 64] and again.tokenizer.model_max_length == 77
    with pytest.raises(ValueError, match="non-empty"):
        load(path, tok=(), batch_size=4)


def test_latent_shards_tokenize_with_both_tokenizers_and_read_sizes_from_json(tmp_path, tokenizer_2):
    samples = []
    for i in range(4):
        lat = np.full((4, RES // 8, RES // 8), float(i), np.float32)
        samples.append({"__key__": f"l{i}", "latents.npy": npy_bytes(lat), "txt": f"latent {i}",
                        "json": {"latent_store": "sample", "original_size": [100 + i, 80], "crop_top_left": [i, 0],
                                 "target_size": [RES, RES]}})
    path = write_tar(str(tmp_path / "lat.tar"), samples)
    b = take(load(path, tok=(tokenizer(), tokenizer_2), type="latents", batch_size=4), 1)[0]
    assert b["latents"].shape == (4, 4, RES // 8, RES // 8)
    one = tokenizer()(b["captions"], padding="max_length", truncation=True, max_length=77, return_tensors="pt").input_ids
    two = tokenizer_2(b["captions"], padding="max_length", truncation=True, max_length=64, return_tensors="pt").input_ids
    assert torch.equal(b["input_ids"], one) and torch.equal(b["input_ids_2"], two) and not torch.equal(one, two)
    order = [int(k[1:]) for k in b["keys"]]
    assert b["original_size"].tolist() == [[100 + i, 80] for i in order]
    assert b["crop_top_left"].tolist() == [[i, 0] for i in order] and b["target_size"].tolist() == [[RES, RES]] * 4
