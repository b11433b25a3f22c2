"""A contact sheet of what the model will see: python scripts/preview_data.py config=run.yaml [key=value ...]

    python scripts/preview_data.py config=configs/quickstart.yaml --n 24 --cols 6 --out preview.png

The config is read as train.py reads it (``config=`` files, ``key=value`` overrides, ``~key`` removals) and
its ``dataset`` section is checked as train.py checks it; no model is loaded. The tiles are the first
``--n`` samples of rank 0's training loader (``build_train_loader``, in-process): after the metadata
filters, aspect buckets, crops, flips and caption dropout, as the trainer decodes them. Each tile is
labelled with its key, source, bucket (w x h pixels) and caption ("[dropped]" when caption dropout
emptied it); with ``dataset.params.masked_loss`` the mask's outline is drawn over the picture (magenta) and
its mean weight is printed. Latent shards (``dataset.type=latents``) show their first three channels in
false colour, not decoded pictures. Edit pairs (``dataset.params.references``) are shown side by side:
each reference, then the target (``<out>.json``: ``references``, and ``target_left``, the target's first
column in the tile's picture).

The header and the printed table give the metadata filters' pass-rates, from a scan of the filters alone
(nothing decoded) over ``--scan-units`` units (shards, row groups, chunks) of each source, evenly spread
(``all``: every unit). Beside the PNG, ``<out>.json`` holds the tiles' labels and boxes on the sheet, the
scan and the loader's counters.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sd_training import quickstart  # noqa: E402
from sd_training.config import ConfigError  # noqa: E402
from sd_training.config.loading import parse  # noqa: E402
from sd_training.config.script_args import integer, integer_or, new_file  # noqa: E402
from sd_training.data import build_train_loader  # noqa: E402
from sd_training.data.checks import check_dataset_inputs  # noqa: E402
from sd_training.data.preview import NoTokens, collect_tiles, pass_rate_lines, scan_pass_rates  # noqa: E402

PAD = 6
LINE = 14  # pixels per text line (the default font at size 11)
LABEL_LINES = 4
OUTLINE = (255, 0, 255)
BACKGROUND = (255, 255, 255)
# The arguments' bounds: a sheet is for looking at, and these keep its time and memory in check.
MAX_N, MAX_COLS, MIN_TILE, MAX_TILE, MAX_WORKERS, MAX_SCAN_UNITS = 1024, 64, 32, 1024, 64, 100_000
MAX_SHEET_PIXELS = 64_000_000  # ~190 MB as RGB


def fit(text: str, font, width: int) -> str:
    """``text`` cut (with an ellipsis) to ``width`` pixels."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "...") > width:
        text = text[:-1]
    return text + "..."


def wrap(text: str, font, width: int, lines: int) -> list[str]:
    """``text`` in up to ``lines`` lines of ``width`` pixels, the last one cut."""
    out, words = [], text.split()
    while words and len(out) < lines:
        line = words.pop(0)
        while words and font.getlength(line + " " + words[0]) <= width:
            line += " " + words.pop(0)
        out.append(line)
    if words:
        out[-1] = fit(out[-1] + " " + " ".join(words), font, width)
    return [fit(line, font, width) for line in out]


def outline(mask: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Boolean [h, w] of the edge of ``mask`` > half, at the displayed ``size`` (w, h)."""
    m = Image.fromarray(((mask >= 128) * 255).astype(np.uint8)).resize(size, Image.NEAREST)
    grown, shrunk = m.filter(ImageFilter.MaxFilter(3)), m.filter(ImageFilter.MinFilter(3))
    return np.asarray(grown) != np.asarray(shrunk)


def draw_tile(sheet: Image.Image, draw: ImageDraw.ImageDraw, font, tile: dict, x: int, y: int, size: int) -> list[int]:
    """The tile's picture fitted into ``size`` x ``size`` at (x, y), its labels below; returns its picture's box."""
    image = tile["image"]
    h, w = image.shape[:2]
    scale = size / max(h, w)
    shown = (max(1, round(w * scale)), max(1, round(h * scale)))
    pic = Image.fromarray(image).resize(shown, Image.NEAREST if scale >= 1 else Image.BICUBIC)
    if tile["mask"] is not None:
        arr = np.asarray(pic).copy()
        arr[outline(tile["mask"], shown)] = OUTLINE
        pic = Image.fromarray(arr)
    x0, y0 = x + (size - shown[0]) // 2, y + (size - shown[1]) // 2
    sheet.paste(pic, (x0, y0))
    ty = y + size + 2
    weight = f", mask {tile['mask_mean']:.2f}" if tile["masked"] else ""
    draw.text((x, ty), fit(f"{tile['key']}  {tile['source']}", font, size), fill=(0, 0, 0), font=font)
    draw.text((x, ty + LINE), fit(f"bucket {tile['bucket'][0]}x{tile['bucket'][1]}{weight}", font, size),
              fill=(60, 60, 60), font=font)
    if tile["dropped"]:
        draw.text((x, ty + 2 * LINE), "[dropped]", fill=(200, 0, 0), font=font)
    else:
        for k, line in enumerate(wrap(tile["caption"] or "(empty caption)", font, size, LABEL_LINES - 2)):
            draw.text((x, ty + (2 + k) * LINE), line, fill=(0, 0, 90), font=font)
    return [x0, y0, x0 + shown[0], y0 + shown[1]]


def contact_sheet(tiles: list[dict], cols: int, size: int, header: list[str]):
    """(the sheet, the header's height, each tile's cell and picture boxes)."""
    font = ImageFont.load_default(size=11)
    cell_w, cell_h = size + 2 * PAD, size + 2 + LABEL_LINES * LINE + 2 * PAD
    rows = -(-len(tiles) // cols)
    head = PAD + LINE * len(header) + PAD
    sheet = Image.new("RGB", (cols * cell_w, head + rows * cell_h), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    for k, line in enumerate(header):
        draw.text((PAD, PAD + k * LINE), fit(line, font, sheet.width - 2 * PAD), fill=(0, 0, 0), font=font)
    boxes = []
    for i, tile in enumerate(tiles):
        x, y = (i % cols) * cell_w + PAD, head + (i // cols) * cell_h + PAD
        cell = [x - PAD, y - PAD, x - PAD + cell_w, y - PAD + cell_h]
        boxes.append((cell, draw_tile(sheet, draw, font, tile, x, y, size)))
    return sheet, head, boxes


def sheet_pixels(n: int, cols: int, size: int) -> int:
    """The tiles' area of :func:`contact_sheet`'s sheet (the header's few lines left out)."""
    cell_w, cell_h = size + 2 * PAD, size + 2 + LABEL_LINES * LINE + 2 * PAD
    return cols * cell_w * -(-n // cols) * cell_h


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Other arguments: config=PATH, key=value "
                                 "and ~key, as train.py takes them.")
    ap.add_argument("--out", type=new_file(".png"),
                    help="the PNG to write (default: <experiment.log_dir>/preview_<experiment.name>.png, under runs/, "
                         "which git ignores); <out>.json beside it")
    ap.add_argument("--n", type=integer(1, MAX_N), default=16, help=f"samples to show, 1 to {MAX_N} (default 16)")
    ap.add_argument("--cols", type=integer(1, MAX_COLS), default=4, help=f"tiles per row, 1 to {MAX_COLS} (default 4)")
    ap.add_argument("--tile", type=integer(MIN_TILE, MAX_TILE), default=192,
                    help=f"pixels of a tile's picture area, {MIN_TILE} to {MAX_TILE} (default 192); the whole sheet "
                         f"at most {MAX_SHEET_PIXELS // 1_000_000} megapixels")
    ap.add_argument("--workers", type=integer(0, MAX_WORKERS), default=0,
                    help=f"loader worker processes, 0 to {MAX_WORKERS} (default 0: in this process)")
    ap.add_argument("--scan-units", type=integer_or("all", 1, MAX_SCAN_UNITS), default="8",
                    help=f"units per source the pass-rates are counted over, 1 to {MAX_SCAN_UNITS} or all (default 8)")
    args, rest = ap.parse_known_args(argv)
    pixels = sheet_pixels(args.n, args.cols, args.tile)
    if pixels > MAX_SHEET_PIXELS:
        ap.error(f"argument --tile: {args.n} tiles of {args.tile} px in {args.cols} columns make a "
                 f"{pixels / 1e6:.0f}-megapixel sheet, more than {MAX_SHEET_PIXELS // 1_000_000}: fewer --n or --cols, "
                 "or a smaller --tile")
    scan_units = args.scan_units
    try:
        cfg = parse(rest)
        check_dataset_inputs(cfg.dataset)
        quickstart.prepare(dataclasses.replace(cfg.quickstart, tiny_pipeline=None), True)  # generated data only
        data = dataclasses.replace(cfg.dataset, params=dataclasses.replace(cfg.dataset.params, workers=args.workers))
        loader = build_train_loader(data, tokenizer=NoTokens(), rank=0, world_size=1, seed=cfg.system.seed)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    scan = scan_pass_rates(loader, scan_units)
    tiles = collect_tiles(loader, args.n)
    lines = pass_rate_lines(scan)
    p = cfg.dataset.params
    header = [f"{cfg.experiment.name}: {len(tiles)} samples as trained ({cfg.dataset.type}, resolution {p.resolution}"
              f"{', aspect buckets' if p.aspect_buckets else ''}, caption dropout {p.caption_dropout:g}, flip "
              f"{p.random_flip:g}{', masked loss' if p.masked_loss else ''}"
              f"{f', edit pairs: {p.references} reference(s) | target' if p.references else ''})", *lines]
    sheet, head, boxes = contact_sheet(tiles, args.cols, args.tile, header)
    out = Path(args.out or Path(cfg.experiment.log_dir) / f"preview_{cfg.experiment.name}.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(out)
    meta = {"png": str(out), "n": len(tiles), "cols": args.cols, "tile": args.tile, "header_height": head,
            "size": list(sheet.size), "scan": scan, "loader_stats": loader.stats(),
            "tiles": [{**{k: v for k, v in t.items() if k not in ("image", "mask")}, "cell": cell, "box": box}
                      for t, (cell, box) in zip(tiles, boxes)]}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    print("\n".join(lines))
    print(f"{len(tiles)} samples: {out} (labels: {out.with_suffix('.json')})")
    return 0


if __name__ == "__main__":
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    sys.exit(main(sys.argv[1:]))
