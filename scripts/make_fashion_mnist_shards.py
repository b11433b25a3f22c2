"""Fashion-MNIST (Debian's dataset-fashion-mnist) -> WebDataset shards with class captions.

    apt-get install dataset-fashion-mnist        # 70,000 28x28 images, 10 classes, no network needed
    python scripts/make_fashion_mnist_shards.py data/fashion --size 64 --per-shard 5000

Writes OUT/train-{000000..000011}.tar (60,000 images) and OUT/test-{000000..000001}.tar (10,000,
held out), each sample KEY.png (grey, upscaled to --size, as RGB) + KEY.txt ("a photo of a sneaker")
+ KEY.cls + KEY.json ({"label", "class_name", "split"}).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import struct
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from sd_training.config.script_args import integer, out_folder

SOURCE = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ["t-shirt", "pair of trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]


def read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        magic, n = struct.unpack(">II", f.read(8))
        dims = [struct.unpack(">I", f.read(4))[0] for _ in range((magic & 0xFF) - 1)]
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(n, *dims)


def write_split(images, labels, out: Path, split: str, size: int, per_shard: int) -> str:
    import webdataset as wds
    from tqdm import tqdm

    n_shards = -(-len(images) // per_shard)
    for s in tqdm(range(n_shards), desc=split, unit="shard"):
        tmp = out / f"{split}-{s:06d}.tar.tmp"
        with wds.TarWriter(str(tmp)) as w:
            for i in range(s * per_shard, min((s + 1) * per_shard, len(images))):
                im = Image.fromarray(images[i]).resize((size, size), Image.BICUBIC).convert("RGB")
                buf = io.BytesIO()
                im.save(buf, format="PNG")
                label = int(labels[i])
                w.write({
                    "__key__": f"{split}_{i:06d}",
                    "png": buf.getvalue(),
                    "txt": f"a photo of a {CLASSES[label]}",
                    "cls": str(label),
                    "json": json.dumps({"label": label, "class_name": CLASSES[label], "split": split,
                                        "width": size, "height": size}),
                })
        tmp.rename(out / f"{split}-{s:06d}.tar")
    return str(out / f"{split}-{{000000..{n_shards - 1:06d}}}.tar")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=out_folder, help="output folder")
    ap.add_argument("--size", type=integer(8, 1024), default=64, help="pixels (square) of the written images, 8 to 1024")
    ap.add_argument("--per-shard", type=integer(1, 1_000_000), default=5000, help="images per shard, 1 to 1000000")
    ap.add_argument("--source", default=str(SOURCE), help="folder of the idx .gz files")
    args = ap.parse_args(argv)
    src = Path(args.source)
    if not (src / "train-images-idx3-ubyte.gz").exists():
        print(f"error: {src} has no Fashion-MNIST files; install them with: apt-get install dataset-fashion-mnist",
              file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        pattern = write_split(read_idx(src / f"{prefix}-images-idx3-ubyte.gz"), read_idx(src / f"{prefix}-labels-idx1-ubyte.gz"),
                              out, split, args.size, args.per_shard)
        print(f"{split}: {pattern}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    sys.exit(main())
