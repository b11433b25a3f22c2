"""The report's HTML: one self-contained page (inline CSS, images as base64 data URIs, no script, no web
font, nothing fetched), readable offline from a copy anywhere. Laid out at fixed sizes: every plot is
700 x 320 CSS pixels, every sample grid fits 640 x 400 (small grids enlarged by a whole factor, sharp)."""

from __future__ import annotations

import base64
import html
import io
import math
import time
from pathlib import Path

from .series import Metrics, Panel, last_value

GRID_BOX = (640, 400)  # CSS pixels a sample grid fits in on the page (and the most an embedded grid keeps)
GRID_MAX_ENLARGE = 8  # a small grid (32 px tiles) is shown at most this many times its size
GRID_PNG_MAX_BYTES = 300_000  # a thumbnail larger than this as PNG is embedded as a JPEG (photographic grids)

CSS = """
body { font-family: sans-serif; margin: 16px; color: #222; background: #fff; max-width: 1460px; }
h1 { font-size: 20px; margin: 0 0 8px 0; } h2 { font-size: 16px; margin: 18px 0 6px 0; }
table.summary { border-collapse: collapse; font-size: 13px; }
table.summary th { text-align: left; padding: 2px 12px 2px 0; color: #555; font-weight: normal; }
table.summary td { padding: 2px 12px 2px 0; }
pre.config { font-size: 11px; background: #f6f6f6; padding: 8px; max-height: 480px; overflow: auto; }
.panels { display: flex; flex-wrap: wrap; gap: 8px; }
.panels img { width: 700px; height: 320px; border: 1px solid #ddd; display: block; }
.grids { display: flex; gap: 8px; overflow-x: auto; padding-bottom: 6px; }
.grids figure { margin: 0; flex: none; }
.grids img { border: 1px solid #ddd; display: block; }
.grids img.small { image-rendering: pixelated; }
figcaption { font-size: 12px; color: #555; text-align: center; }
.note { font-size: 12px; color: #666; }
"""


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def grid_thumbnail(path: Path) -> tuple[bytes, str, tuple[int, int]]:
    """A sample grid downscaled to fit :data:`GRID_BOX`: (bytes, mime type, its size)."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        im.thumbnail(GRID_BOX, Image.Resampling.LANCZOS)  # keeps the aspect; never enlarges
        buf = io.BytesIO()
        im.save(buf, "PNG", optimize=True)
        if buf.tell() <= GRID_PNG_MAX_BYTES:
            return buf.getvalue(), "image/png", im.size
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90)
        return buf.getvalue(), "image/jpeg", im.size


def display_size(size: tuple[int, int]) -> tuple[int, int]:
    """CSS pixels of a grid thumbnail: as is, or a small one enlarged by a whole factor to fit GRID_BOX."""
    w, h = size
    factor = max(1, min(GRID_MAX_ENLARGE, GRID_BOX[0] // w, GRID_BOX[1] // h))
    return w * factor, h * factor


def spread(items: list, most: int) -> list:
    """At most ``most`` of ``items``, evenly spaced, the first and the last always among them."""
    if len(items) <= most:
        return list(items)
    if most <= 1:
        return items[-1:]
    idx = sorted({round(i * (len(items) - 1) / (most - 1)) for i in range(most)})
    return [items[i] for i in idx]


def _fmt(v, digits: int = 4) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.{digits}g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _get(cfg: dict, dotted: str, default=None):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def summary_rows(cfg: dict, metrics: Metrics, facts: dict) -> list[tuple[str, str]]:
    """(label, value) rows of the summary table from the run's config, its metrics and ``facts`` (what the
    trainer knows and the files do not say: family, global_batch, world_size, total_steps)."""
    step = max((pts[-1][0] for pts in metrics.values()), default=0)
    seen = last_value(metrics, "images_seen")
    global_batch = facts.get("global_batch")
    if global_batch is None and seen and seen[0] > 0 and seen[1] % seen[0] == 0:
        global_batch = int(seen[1]) // seen[0]  # images_seen = steps x global batch
    total = facts.get("total_steps")
    to_see = _get(cfg, "experiment.num_examples_to_see")
    if total is None and global_batch and isinstance(to_see, int):
        total = math.ceil(to_see / global_batch)
    precision = _get(cfg, "model.mixed_precision", "?")
    rows = [("run", f"{_get(cfg, 'experiment.name', '?')}"), ("family", str(facts.get("family", "?"))),
            ("steps", f"{step:,}" + (f" of {total:,}" if total else "")),
            ("images seen", _fmt(int(seen[1])) if seen else "?"),
            ("global batch", _fmt(global_batch) if global_batch else "?")]
    if facts.get("world_size"):
        rows.append(("devices", _fmt(facts["world_size"])))
    lr = last_value(metrics, "lr")
    rows.append(("learning rate", f"{_fmt(_get(cfg, 'optimizer.params.learning_rate', '?'))} peak, "
                 f"{_get(cfg, 'lr_scheduler.scheduler', '?')}; {_get(cfg, 'optimizer.name', '?')}"
                 + (f"; now {_fmt(lr[1])}" if lr else "")))
    rows.append(("precision", "fp32 (no autocast)" if precision == "no" else f"{precision} autocast"))
    for key, label in (("loss", "last loss"), ("val/loss", "last validation loss")):
        if (last := last_value(metrics, key)) is not None:
            rows.append((label, f"{_fmt(last[1])} at step {last[0]:,}"))
    if (per_dev := last_value(metrics, "images_per_sec_per_device")) is not None:
        rows.append(("images/s per device", _fmt(per_dev[1], 3)))
    if (u := last_value(metrics, "mfu")) is not None:
        rows.append(("MFU", f"{100 * u[1]:.1f}%"))
    if (bad := last_value(metrics, "nonfinite_steps")) is not None:
        rows.append(("skipped non-finite steps", _fmt(int(bad[1]))))
    rows.append(("updated", time.strftime("%Y-%m-%d %H:%M:%S")))
    return rows


def _summary_html(rows: list[tuple[str, str]], config_text: str) -> str:
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    config = (f"<details><summary>config.yaml</summary><pre class=\"config\">{html.escape(config_text)}</pre></details>"
              if config_text else "<p class=\"note\">no config.yaml in the run folder</p>")
    return f"<table class=\"summary\">{cells}</table>\n{config}"


def _panels_html(panels: list[Panel], pngs: dict[str, bytes]) -> str:
    if not panels:
        return "<p class=\"note\">no metrics logged yet</p>"
    figs = []
    for p in panels:
        uri = data_uri(pngs[p.spec.name], "image/png")
        figs.append(f"<img class=\"plot\" data-name=\"{p.spec.name}\" width=\"700\" height=\"320\" "
                    f"alt=\"{html.escape(p.spec.title)}\" src=\"{uri}\">")
    return "<div class=\"panels\">" + "".join(figs) + "</div>"


def _grids_html(grids: list[tuple[int, str, Path]], max_grids: int, tag: str, prompts: list[str]) -> str:
    """One row per kind of grid (the main weights, then e.g. '_raw'), its steps side by side. ``tag``: what
    the grids show (samples, reconstructions); ``prompts``: the sample prompts, one per grid row."""
    if not grids:
        return f"<p class=\"note\">no {html.escape(tag)} yet (a grid is written at each export)</p>"
    out = []
    if tag == "samples" and prompts:
        rows = "; ".join(f"{i + 1}. {p}" for i, p in enumerate(prompts))
        out.append(f"<p class=\"note\">one row per prompt (experiment.sample_prompts): {html.escape(rows)}</p>")
    for suffix in sorted({s for _, s, _ in grids}, key=lambda s: (s != "", s)):
        row = [(step, path) for step, s, path in grids if s == suffix]
        shown = spread(row, max_grids)
        name = tag if not suffix else f"{tag} ({suffix.lstrip('_')} weights)"
        note = f" ({len(shown)} of {len(row)} shown; all in samples/)" if len(shown) < len(row) else ""
        figs = []
        for step, path in shown:
            data, mime, size = grid_thumbnail(path)
            w, h = display_size(size)
            small = " small" if w > size[0] else ""  # enlarged: sharp pixels, not a blur
            figs.append(f"<figure><img class=\"grid{small}\" data-step=\"{step}\" width=\"{w}\" height=\"{h}\" "
                        f"alt=\"{html.escape(tag)} at step {step}\" src=\"{data_uri(data, mime)}\">"
                        f"<figcaption>step {step:,}</figcaption></figure>")
        out.append(f"<h3 class=\"note\">{html.escape(name)}{note}</h3><div class=\"grids\">{''.join(figs)}</div>")
    return "\n".join(out)


def render(title: str, rows: list[tuple[str, str]], config_text: str, panels: list[Panel], pngs: dict[str, bytes],
           grids: list[tuple[int, str, Path]], max_grids: int, tag: str = "samples", prompts: list[str] = ()) -> str:
    """The whole page."""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n{_summary_html(rows, config_text)}\n"
        f"<h2>Metrics</h2>\n{_panels_html(panels, pngs)}\n"
        f"<h2>{html.escape(tag.capitalize())} over time</h2>\n{_grids_html(grids, max_grids, tag, list(prompts))}\n"
        "<p class=\"note\">Written by sd_training.report (refreshed at every export; "
        "python scripts/report.py RUN_FOLDER rewrites it). Smoothed curves: trailing mean over the window in "
        "the legend, over the raw values drawn faint.</p>\n</body></html>\n"
    )
