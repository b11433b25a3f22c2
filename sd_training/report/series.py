"""metrics.jsonl -> the report's panels, as data (no drawing, no matplotlib): which panels a run's metrics
fill, with each series' points, raw and smoothed.

The keys are the ones the loop logs (``sd_training.outputs.metrics.StepMetrics``, ``outputs.RunOutputs``, the
loader's counters as ``data/<name>``). A panel whose keys are all missing is left out; a step logged twice
(a resumed run) keeps its last value; non-finite values (logged as null) are left out of the curves.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..outputs.readers import Skipped, read_jsonl

log = logging.getLogger(__name__)

Metrics = dict[str, list[tuple[int, float]]]  # key -> [(step, value), ...] sorted by step


@dataclass(frozen=True)
class PanelSpec:
    """One plot: ``keys`` as (metric key, label) pairs, or ``pattern``, a regular expression whose first group
    labels every matching key (a mixture's sources)."""

    name: str  # the PNG's file name (report/<name>.png)
    title: str
    keys: tuple[tuple[str, str], ...] = ()
    pattern: str | None = None
    log_y: bool = False  # a log y-axis when every value is positive and they span over plots.LOG_SPAN
    smooth: bool = False  # draw the smoothed curve over the raw one
    percent: bool = False  # values are fractions, shown as %
    unit: str = ""
    count: bool = False  # whole numbers from 0 (a counter)


PANELS: tuple[PanelSpec, ...] = (
    PanelSpec("loss", "training loss", (("loss", "loss"),), log_y=True, smooth=True),
    PanelSpec("loss_by_timestep", "loss by timestep quartile",
              tuple((f"loss_q{i}", f"t in quartile {i}" + (" (least noise)" if i == 0 else " (most noise)" if i == 3 else ""))
                    for i in range(4)), log_y=True, smooth=True),
    PanelSpec("validation_loss", "validation loss (held-out, fixed noise)", (("val/loss", "val/loss"),), log_y=True),
    PanelSpec("learning_rate", "learning rate", (("lr", "lr"),)),
    PanelSpec("throughput", "images/s per device", (("images_per_sec_per_device", "per device"),), smooth=True),
    PanelSpec("mfu", "model FLOPs utilisation", (("mfu", "MFU"), ("hfu", "hardware FLOPs utilisation")), percent=True),
    PanelSpec("data_wait", "data wait (share of step time)", (("data_wait_fraction", "data wait"),), percent=True,
              smooth=True),
    PanelSpec("sources", "mixture: share of samples per source", pattern=r"^data/source/(.+)/share$", percent=True),
    PanelSpec("grad_norm", "gradient norm (before clipping)", (("grad_norm", "grad norm"),), log_y=True, smooth=True),
    PanelSpec("nonfinite", "skipped non-finite steps (total)", (("nonfinite_steps", "skipped steps"),), count=True),
    PanelSpec("memory", "peak device memory", (("peak_memory_gb", "GiB"),), unit="GiB"),
    PanelSpec("fid", "FID (eval images)", (("eval/fid", "FID"),)),
    PanelSpec("clip_score", "CLIP score (eval images)", (("eval/clip_score", "CLIP score"),)),
)


@dataclass
class Series:
    label: str
    steps: list[int]
    values: list[float]
    smoothed: list[float] | None = None  # None: the panel shows raw values only


@dataclass
class Panel:
    spec: PanelSpec
    series: list[Series] = field(default_factory=list)
    window: int = 1  # the moving-average window of the smoothed curves


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_metrics(path: str | Path) -> Metrics:
    """{key: [(step, value), ...]} sorted by step, finite numbers only; a step logged twice keeps its last
    value. A line that is not a JSON object (the last line of a killed run may be cut), nested too deep or
    too long is skipped: one warning per reason, with the count and the first line numbers
    (:func:`sd_training.outputs.readers.read_jsonl`)."""
    by_key: dict[str, dict[int, float]] = {}
    skipped = Skipped(Path(path))
    for _n, row in read_jsonl(path, skipped):
        for k, v in row.items():
            # Background evaluations carry the (older) step they evaluated as "eval/step".
            step = row.get("eval/step", row.get("step")) if k.startswith("eval/") else row.get("step")
            if k in ("step", "eval/step") or not _number(step):
                continue
            if v is None:  # a non-finite value: an earlier finite one at this step no longer holds
                by_key.get(k, {}).pop(int(step), None)
            elif _number(v):
                by_key.setdefault(k, {})[int(step)] = float(v)
    skipped.warn()
    return {k: sorted(v.items()) for k, v in by_key.items() if v}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (1: unchanged); the first points average what there is."""
    if window <= 1:
        return list(values)
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def auto_window(points: int) -> int:
    """The default smoothing window: about 1/20 of the points (1 for short runs), at most 200."""
    return max(1, min(200, points // 20))


def _keys_of(spec: PanelSpec, metrics: Metrics) -> list[tuple[str, str]]:
    if spec.pattern is None:
        return [(k, label) for k, label in spec.keys if k in metrics]
    rx = re.compile(spec.pattern)
    return [(k, m.group(1)) for k in sorted(metrics) if (m := rx.match(k))]


def panels(metrics: Metrics, window: int | None = None) -> list[Panel]:
    """The panels the metrics fill, in :data:`PANELS` order. ``window``: the smoothing window of the
    panels that smooth (None: :func:`auto_window` of the loss's point count)."""
    if window is None:
        window = auto_window(len(metrics.get("loss", ())))
    out = []
    for spec in PANELS:
        keys = _keys_of(spec, metrics)
        if not keys:
            continue
        panel = Panel(spec, window=window if spec.smooth else 1)
        for key, label in keys:
            steps = [s for s, _ in metrics[key]]
            values = [v for _, v in metrics[key]]
            panel.series.append(Series(label, steps, values, smooth(values, window) if spec.smooth else None))
        out.append(panel)
    return out


def last_value(metrics: Metrics, key: str) -> tuple[int, float] | None:
    """The (step, value) of ``key``'s last point, or None."""
    points = metrics.get(key)
    return points[-1] if points else None
