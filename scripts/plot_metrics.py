"""metrics.jsonl -> one PNG of every panel the run's metrics fill, or with --report the run's report.html.

    python scripts/plot_metrics.py runs/my_run                     # writes runs/my_run/metrics.png
    python scripts/plot_metrics.py runs/my_run/metrics.jsonl -o curves.png [--smooth 20]
    python scripts/plot_metrics.py runs/my_run --report [--smooth 20]  # = python scripts/report.py runs/my_run

The panels (sd_training.report.series): loss raw and smoothed, loss by timestep quartile, validation loss,
learning rate, images/s per device, MFU / HFU, data wait, a mixture's per-source shares, gradient norm,
skipped non-finite steps, peak memory, FID and CLIP score (at ``eval/step`` when a row has it); a panel is
drawn when the file has any of its keys. A resumed run logs some steps twice; the last row of a step wins.
Needs matplotlib: pip install 'sd-training[plots]'.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from sd_training.config.script_args import integer, new_file  # noqa: E402
from sd_training.report import write_report  # noqa: E402
from sd_training.report.plots import MatplotlibMissing, draw_stacked, require_matplotlib  # noqa: E402
from sd_training.report.series import Metrics, panels, read_metrics, smooth  # noqa: E402,F401 (the script's API)


def plot(metrics: Metrics, out: str | Path, title: str = "", window: int | None = 1) -> Path:
    """Every panel ``metrics`` fill, stacked in one PNG at ``out``; ``window``: the smoothing window (None:
    about 1/20 of the points)."""
    return draw_stacked(panels(metrics, window), out, title=title)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", help="a run folder or its metrics.jsonl")
    ap.add_argument("-o", "--out", type=new_file(".png"), help="PNG to write (default: metrics.png beside the metrics file)")
    ap.add_argument("--smooth", type=integer(1, 100_000), default=None,
                    help="moving-average window (log points) of the smoothed curves, 1 to 100000 (default: about 1/20 "
                         "of the points)")
    ap.add_argument("--report", action="store_true", help="write the run folder's report.html instead (scripts/report.py)")
    args = ap.parse_args(argv)
    path = Path(args.metrics)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: give a run folder or its metrics.jsonl")
    try:
        require_matplotlib()
    except MatplotlibMissing as e:
        raise SystemExit(str(e)) from None
    if args.report:
        out = write_report(path.parent, window=args.smooth)
    else:
        out = plot(read_metrics(path), args.out or path.with_name("metrics.png"), title=path.parent.name,
                   window=args.smooth)
    print(out)
    return out


if __name__ == "__main__":
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    main()
