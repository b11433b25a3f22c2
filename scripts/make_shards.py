#!/usr/bin/env python
"""Pack an image folder, parquet files or a CSV into WebDataset tar shards of N samples.

    python scripts/make_shards.py INPUT OUT_DIR [--type folder|parquet|CSV] [--samples-per-shard 1000]
        [--image-column COL] [--caption-column COL] [--image-root DIR] [--prefix shard] [--max-side PX]

Each sample becomes ``KEY.<jpg|png|webp>`` (the original bytes, or re-encoded as JPEG with --max-side),
``KEY.txt`` (the caption; for seed 000's metadata layout, the tags joined with ", ") and ``KEY.json``
(the metadata: table columns / metadata file, plus ``width``, ``height`` and ``source``). The output is
``OUT_DIR/<prefix>-000000.tar ...`` and ``OUT_DIR/sizes.json`` ({shard: samples}); the brace pattern to
put in ``dataset.params.path`` is printed at the end. Unreadable images and missing captions are skipped
and counted, never fatal.

Input layouts are the ones ``dataset.type`` folder / parquet / CSV read (see sd_training/data/).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections import Counter
from typing import Any, Dict, Iterator, Optional, Tuple

from PIL import Image

from sd_training.config.dataset import DatasetConfig, canonical_type
from sd_training.config.script_args import existing, integer, name_part, number, out_folder
from sd_training.data import build_sources
from sd_training.data.sources import read_image_path
from sd_training.data.stats import Stats

FORMAT_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


def _guess_type(path: str) -> str:
    if os.path.isdir(path):
        has_parquet = any(f.endswith((".parquet", ".pq")) for f in os.listdir(path))
        return "parquet" if has_parquet else "folder"
    low = path.lower()
    if low.endswith((".parquet", ".pq")):
        return "parquet"
    if low.endswith((".csv", ".tsv")):
        return "CSV"
    raise SystemExit(f"make_shards: cannot tell the input type of {path}; pass --type folder|parquet|CSV")


def _params(args) -> DatasetConfig:
    cfg = DatasetConfig(type=canonical_type(args.type or _guess_type(args.input)))
    p = cfg.params
    p.path = args.input
    p.batch_size, p.workers, p.num_examples_to_see = 1, 0, 0
    if cfg.type in ("parquet", "CSV"):
        p.image_column = args.image_column or ""
        p.caption_column = args.caption_column or ""
        p.image_root = args.image_root or ""
        if cfg.type == "CSV":
            p.csv_separator = args.csv_separator
    p.samples_per_shard = 10_000  # reading units: any size will do, we re-chunk into shards ourselves
    return cfg


def _encode(data: bytes, max_side: Optional[int]) -> Tuple[bytes, str, int, int]:
    """(bytes, extension, width, height); raises on an unreadable image."""
    img = Image.open(io.BytesIO(data))
    width, height = img.size
    fmt = img.format
    if max_side and max(width, height) > max_side:
        img.draft("RGB", (max_side, max_side))
        img = img.convert("RGB")
        img.thumbnail((max_side, max_side), Image.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=95)
        return buf.getvalue(), "jpg", img.width, img.height
    img.verify()  # a full integrity check (cheap next to the decode it saves at training time)
    if fmt not in FORMAT_EXT:  # keep the pixels, in a format every WebDataset reader knows
        img = Image.open(io.BytesIO(data)).convert("RGB")
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue(), "png", width, height
    return data, FORMAT_EXT[fmt], width, height


def _caption(raw: Dict[str, Any]) -> Optional[str]:
    if raw.get("tags_mode"):
        tags = (raw.get("meta") or {}).get("tags")
        return ", ".join(tags) if isinstance(tags, list) else None
    cap = raw.get("caption")
    if cap is None:
        return None
    return cap.decode("utf-8") if isinstance(cap, (bytes, bytearray)) else str(cap)


def _json_safe(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def iter_samples(sources, counts: Counter) -> Iterator[Dict[str, Any]]:
    stats = Stats()
    for source in sources:
        for unit in source.units:
            for raw in source.read(unit, stats):
                if raw.get("error"):
                    counts[raw["error"][0]] += 1
                    continue
                yield raw
    counts.update({k.split("/", 1)[1]: v for k, v in stats.counts.items() if k.startswith("skipped/")})


def make_shards(args) -> str:
    import webdataset as wds
    from tqdm import tqdm

    cfg = _params(args)
    os.makedirs(args.out_dir, exist_ok=True)
    counts: Counter = Counter()
    sizes: Dict[str, int] = {}
    sink = None
    shard = 0
    used_keys = set()
    sources = build_sources(cfg.type, cfg.params)
    total = sum(s.num_samples or 0 for s in sources) or None

    def open_next():
        nonlocal sink, shard
        if sink is not None:
            sink.close()
        name = f"{args.prefix}-{shard:06d}.tar"
        sizes[name] = 0
        sink = wds.TarWriter(os.path.join(args.out_dir, name))
        shard += 1
        return name

    name = None
    with tqdm(total=total, unit="img", desc="make_shards", disable=args.quiet) as bar:
        for raw in iter_samples(sources, counts):
            bar.update(1)
            caption = _caption(raw)
            if caption is None:
                counts["missing_caption"] += 1
                continue
            try:
                data = raw["image"] if raw.get("image") is not None else read_image_path(raw["image_path"], args.timeout)
                data, ext, width, height = _encode(data, args.max_side)
            except Exception as exn:  # unreadable file or URL, corrupt image: skip, count, go on
                counts["bad_image"] += 1
                if counts["bad_image"] <= 5:
                    print(f"make_shards: skipping {raw.get('image_path') or raw['key']}: {exn}", file=sys.stderr)
                continue
            if name is None or sizes[name] >= args.samples_per_shard:
                name = open_next()
            # WebDataset keys must not contain dots (the first dot starts the extension).
            key = raw["key"].replace(".", "_").replace("/", "_")
            while key in used_keys:
                key += "_"
            used_keys.add(key)
            meta = {k: _json_safe(v) for k, v in (raw.get("meta") or {}).items()}
            meta.update(width=width, height=height, source=raw.get("image_path") or raw["url"])
            sample = {"__key__": key, ext: data, "txt": caption, "json": meta}
            if raw.get("cls") is not None:
                sample["cls"] = str(raw["cls"])
            sink.write(sample)
            sizes[name] += 1
    if sink is not None:
        sink.close()
    if not sizes:
        raise SystemExit(f"make_shards: no usable sample in {args.input} (skipped: {dict(counts)})")
    with open(os.path.join(args.out_dir, "sizes.json"), "w") as fh:
        json.dump(sizes, fh, indent=1)
    pattern = os.path.join(args.out_dir, f"{args.prefix}-{{000000..{len(sizes) - 1:06d}}}.tar")
    print(f"make_shards: {sum(sizes.values())} samples in {len(sizes)} shards; skipped: {dict(counts) or 'none'}")
    print(pattern)
    return pattern


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", help="image folder, parquet file/folder, or CSV file (parquet/CSV: also a glob or brace pattern)")
    ap.add_argument("out_dir", type=out_folder, help="folder the shards and sizes.json are written to")
    ap.add_argument("--type", default=None, help="folder | parquet | CSV (default: guessed from the input)")
    ap.add_argument("--samples-per-shard", type=integer(1, 1_000_000), default=1000,
                    help="samples per tar shard, 1 to 1000000")
    ap.add_argument("--prefix", type=name_part, default="shard", help="shard file name prefix (no '/')")
    ap.add_argument("--image-column", default=None, help="parquet/CSV: image bytes/path/URL column (default: guessed)")
    ap.add_argument("--caption-column", default=None, help="parquet/CSV: caption column (default: guessed)")
    ap.add_argument("--image-root", type=existing("folder"), default=None,
                    help="parquet/CSV: folder relative image paths are resolved against")
    ap.add_argument("--csv-separator", default=",", help="CSV: field separator")
    ap.add_argument("--max-side", type=integer(16, 65535), default=None,
                    help="pixels, 16 to 65535: re-encode larger images as JPEG this size")
    ap.add_argument("--timeout", type=number(gt=0, hi=3600), default=30.0, help="seconds per image URL fetch, > 0, <= 3600")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if not args.csv_separator:
        ap.error("argument --csv-separator: must not be empty")
    return args


def main(argv=None) -> str:
    return make_shards(parse_args(argv))


if __name__ == "__main__":
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    main()
