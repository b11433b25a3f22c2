"""What ``scripts/preview_data.py`` shows: the first samples of the training loader as the model sees them,
and the metadata filters' pass-rates.

Tiles come from :func:`~sd_training.data.build_train_loader` itself (rank 0 of one, in-process), so they
are the samples after the filters, bucketing, crops, flips and caption dropout the run applies, with the
loader's ``preview`` fields: each sample's source name, whether its caption was dropped, its cropped mask.
Edit pairs (``dataset.params.references``) are shown side by side, each reference then the target, as the
model sees them (the mask outline on the target only).
No model is loaded: token ids are not needed, so the loader gets :class:`NoTokens`; latent shards are shown
as their first three channels in false colour (no VAE decode).

Pass-rates come from a scan of the metadata stage alone (no pixel is decoded): every sample of up to
``units`` units (shards, row groups, chunks) of each source, spread evenly over its units, goes through
the source's filters, each filter counted on its own (as the loader counts them), and through the rest of
the selection (missing image or caption, tags), counted as ``skipped/<reason>``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import torch

from .masks import LATENT_DOWNSAMPLE
from .stats import Stats


class NoTokens:
    """Stands in for the model's tokenizer: the preview needs no token ids (one 0 per caption)."""

    model_max_length = 1

    def __call__(self, captions, **kwargs):
        class Ids:
            input_ids = torch.zeros(len(captions), 1, dtype=torch.long)

        return Ids()


def false_colour(latents: np.ndarray) -> np.ndarray:
    """uint8 [h*8, w*8, 3] of latents [C, h, w]: channels 0-2 (fewer repeated), each stretched between its
    1st and 99th percentile, each cell an 8x8 block (the pixels it stands for)."""
    chans = [latents[min(c, latents.shape[0] - 1)] for c in range(3)]
    out = []
    for ch in chans:
        lo, hi = np.percentile(ch, [1, 99])
        out.append(np.clip((ch - lo) / max(float(hi - lo), 1e-6), 0, 1))
    img = (np.stack(out, -1) * 255).round().astype(np.uint8)
    return img.repeat(LATENT_DOWNSAMPLE, 0).repeat(LATENT_DOWNSAMPLE, 1)


PAIR_GAP = 2  # pixels between the pictures of an edit pair (the sheet's background shows through)


def side_by_side(pictures: List[np.ndarray], gap: int = PAIR_GAP) -> np.ndarray:
    """uint8 [H, W1 + gap + W2 ..., 3]: ``pictures`` (one height) left to right, ``gap`` white pixels apart."""
    h = pictures[0].shape[0]
    parts = []
    for k, pic in enumerate(pictures):
        if k:
            parts.append(np.full((h, gap, 3), 255, np.uint8))
        parts.append(pic)
    return np.concatenate(parts, axis=1)


def reference_pictures(batch: Dict[str, Any], i: int) -> List[np.ndarray]:
    """Sample ``i``'s reference images (edit training) as uint8 HxWx3, latents in false colour; [] without."""
    if "reference_values" in batch:
        return [r.permute(1, 2, 0).numpy() for r in batch["reference_values"][i]]
    if "reference_latents" in batch:
        return [false_colour(r.float().numpy()) for r in batch["reference_latents"][i]]
    return []


def tile_of(batch: Dict[str, Any], i: int) -> Dict[str, Any]:
    """One sample of a preview batch: its picture (uint8 HxWx3; an edit pair: its references then its target,
    side by side), mask (uint8 HxW or None, over the target) and labels."""
    if "pixel_values" in batch:
        image = batch["pixel_values"][i].permute(1, 2, 0).numpy()
    else:
        image = false_colour(batch["latents"][i].float().numpy())
    masks = batch.get("masks")
    mask = masks[i] if masks is not None else None
    mask = np.asarray(mask, dtype=np.uint8) if mask is not None else None  # a worker's batch: a tensor
    h, w = image.shape[:2]
    refs = reference_pictures(batch, i)
    target_left = 0
    if refs:
        image = side_by_side([*refs, image])
        target_left = image.shape[1] - w
        if mask is not None:  # the outline stays on the target
            mask = np.concatenate([np.zeros((h, target_left), np.uint8), mask], axis=1)
    return {
        "references": len(refs),
        "target_left": target_left,  # pixels: where the target starts in ``image``
        "image": image,
        "mask": mask,
        "key": str(batch["keys"][i]),
        "source": str(batch["sources"][i]),
        "caption": str(batch["captions"][i]),
        "dropped": bool(batch["caption_dropped"][i]),
        "bucket": [int(w), int(h)],
        "masked": mask is not None,
        "mask_mean": None if mask is None else round(float(mask[:, target_left:].mean()) / 255.0, 4),
    }


def collect_tiles(loader, n: int) -> List[Dict[str, Any]]:
    """The first ``n`` samples ``loader`` yields (its processor switched to the preview fields)."""
    loader.proc.preview = True
    tiles: List[Dict[str, Any]] = []
    it = iter(loader)
    try:
        while len(tiles) < n:
            batch = next(it)
            for i in range(len(batch["keys"])):
                tiles.append(tile_of(batch, i))
                if len(tiles) == n:
                    break
    finally:
        it.close()
    return tiles


def _spread(units: List[Any], k: Optional[int]) -> List[Any]:
    """Up to ``k`` units evenly spaced over ``units`` (None: all)."""
    if k is None or len(units) <= k:
        return list(units)
    return [units[round(i * (len(units) - 1) / max(k - 1, 1))] for i in range(k)]


def scan_pass_rates(loader, units: Optional[int]) -> Dict[str, Any]:
    """Run the metadata stage (filters, captions; no decode) over up to ``units`` units per source.

    Returns ``{"rows": [{source, filter, expr, checked, passed, rate}], "sources": [{name, units_scanned,
    units, read, accepted, skipped: {reason: n}}]}``."""
    plan, proc = loader.plan, loader.proc
    rows, sources = [], []
    for k, src in enumerate(plan.sources):
        stats = Stats()
        mine = [u for s, u in plan.units if s == k]
        scanned = _spread(mine, units)
        accepted = 0
        for unit in scanned:
            try:
                for raw in src.read(unit, stats):
                    raw["src"] = k
                    accepted += proc.select(raw, stats) is not None
            except Exception as exn:  # an unreadable unit: counted, as the loader counts it
                stats.skip(f"shard_error:{type(exn).__name__}", f"{src.describe(unit)}: {exn}")
        counts = stats.counts
        filters = proc.source_filters[k] if proc.source_filters is not None else proc.filters
        for flt in filters:
            checked, passed = counts.get(f"filter/{flt.key}/checked", 0), counts.get(f"filter/{flt.key}/passed", 0)
            rows.append({"source": src.name, "filter": flt.key, "expr": flt.text, "checked": checked,
                         "passed": passed, "rate": passed / checked if checked else None})
        sources.append({"name": src.name, "units_scanned": len(scanned), "units": len(mine),
                        "read": counts.get("samples_read", 0), "accepted": accepted,
                        "skipped": {key[len("skipped/"):]: v for key, v in sorted(counts.items())
                                    if key.startswith("skipped/")}})
    return {"rows": rows, "sources": sources}


def pass_rate_lines(scan: Dict[str, Any]) -> List[str]:
    """The scan as text lines: one per source (read, accepted), one per filter (checked, passed, rate)."""
    lines = []
    for s in scan["sources"]:
        share = f"{s['accepted'] / s['read']:.1%}" if s["read"] else "-"
        skipped = ", ".join(f"{k} {v}" for k, v in s["skipped"].items())
        lines.append(f"source {s['name']}: {s['read']} samples read in {s['units_scanned']} of {s['units']} units, "
                     f"{s['accepted']} accepted ({share}){'; skipped: ' + skipped if skipped else ''}")
        for r in (r for r in scan["rows"] if r["source"] == s["name"]):
            rate = f"{r['rate']:.1%}" if r["rate"] is not None else "-"
            lines.append(f"  filter {r['filter']} {r['expr']}: {r['passed']} of {r['checked']} pass ({rate})")
    return lines
