"""metrics.jsonl -> one PNG: loss (and loss by timestep quartile), images/s, learning rate vs step.

    python scripts/plot_metrics.py runs/my_run                     # writes runs/my_run/metrics.png
    python scripts/plot_metrics.py runs/my_run/metrics.jsonl -o curves.png [--smooth 20]

Panels for MFU / HFU (``mfu``, ``hfu``) and evaluation (``eval/fid``, ``eval/clip_score``, plotted at
``eval/step`` when a row has it) are added when the file has them. A resumed run logs some steps twice; the last row of a step wins. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# (title, [(key, label)], y log scale) of each panel; a panel is drawn when any of its keys is present.
PANELS = [
    ("loss", [("loss", "loss")] + [(f"loss_q{i}", f"t quartile {i}") for i in range(4)], True),
    ("throughput (images/s)", [("images_per_sec", "all devices"), ("images_per_sec_per_device", "per device")], False),
    ("learning rate", [("lr", "lr")], False),
    ("utilisation", [("mfu", "MFU"), ("hfu", "hardware FLOPs utilisation")], False),
    ("FID", [("eval/fid", "FID")], False),
    ("CLIP score", [("eval/clip_score", "CLIP score")], False),
]


def read_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value), ...]} sorted by step, numbers only; a step logged twice keeps its last value."""
    by_key: dict[str, dict[int, float]] = {}
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                # The last line of a killed run may be cut; anything else is a real problem.
                print(f"warning: {path}:{n} is not JSON, skipped", file=sys.stderr)
                continue
            for k, v in row.items():
                # Background evaluations may carry the (older) step they evaluated as "eval/step".
                step = row.get("eval/step", row.get("step")) if k.startswith("eval/") else row.get("step")
                if step is None or k in ("step", "eval/step"):
                    continue
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    by_key.setdefault(k, {})[int(step)] = float(v)
    return {k: sorted(v.items()) for k, v in by_key.items()}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (1: unchanged)."""
    if window <= 1:
        return values
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(metrics: dict[str, list[tuple[int, float]]], out: str | Path, title: str = "", window: int = 1) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    panels = [(t, [(k, lab) for k, lab in series if k in metrics], log) for t, series, log in PANELS]
    panels = [p for p in panels if p[1]]
    if not panels:
        raise ValueError("no known metric (loss, images_per_sec, lr, ...) in the file")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, series, log) in zip(axes[:, 0], panels):
        for i, (key, label) in enumerate(series):
            steps, values = zip(*metrics[key])
            main = i == 0
            ys = smooth(list(values), window) if key.startswith(("loss", "images_per_sec")) else list(values)
            ax.plot(steps, ys, label=label, lw=1.6 if main else 0.8, alpha=1.0 if main else 0.7,
                    marker="o" if len(steps) < 30 else None, ms=3)
        ax.set_title(name, fontsize=10, loc="left")
        if log and all(v > 0 for _, v in metrics[series[0][0]]):
            ax.set_yscale("log")
        if not log:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("optimizer step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", help="a run folder or its metrics.jsonl")
    ap.add_argument("-o", "--out", help="PNG to write (default: metrics.png beside the metrics file)")
    ap.add_argument("--smooth", type=int, default=1, help="moving-average window (log points) for loss and images/s")
    args = ap.parse_args(argv)
    path = Path(args.metrics)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("plot_metrics needs matplotlib: pip install matplotlib") from None
    out = plot(read_metrics(path), args.out or path.with_name("metrics.png"), title=path.parent.name, window=args.smooth)
    print(out)
    return out


if __name__ == "__main__":
    main()
