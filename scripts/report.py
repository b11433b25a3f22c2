"""Write a run folder's report.html (and report/<panel>.png): the page the trainer refreshes at every export
(experiment.report), for a finished, running or copied run folder.

    python scripts/report.py runs/my_run                 # writes runs/my_run/report.html
    python scripts/report.py runs/my_run --smooth 50     # the smoothing window of loss, images/s, ... (log points)
    python scripts/report.py runs/my_run --max-grids 24  # sample grids shown per row (spread over the run)

One self-contained HTML file (plots and sample grids embedded as data URIs, no script, nothing fetched):
open it in any browser, offline, or copy it off the cluster. Reads config.yaml, metrics.jsonl and samples/
of the run folder. Needs matplotlib: pip install 'sd-training[plots]'.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from sd_training.config.script_args import integer  # noqa: E402
from sd_training.report import MAX_GRIDS, MatplotlibMissing, write_report  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="the run folder (<experiment.log_dir>/<experiment.name>)")
    ap.add_argument("--smooth", type=integer(1, 100_000), default=None,
                    help="moving-average window (log points) of the smoothed curves, 1 to 100000 (default: about 1/20 "
                         "of the points)")
    ap.add_argument("--max-grids", type=integer(1, 1000), default=MAX_GRIDS,
                    help="sample grids per row, spread over the run, 1 to 1000")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    run = Path(args.run)
    if run.is_file() and run.name == "metrics.jsonl":
        run = run.parent
    if not (run / "metrics.jsonl").is_file() and not (run / "config.yaml").is_file():
        raise SystemExit(f"{run} is not a run folder (no metrics.jsonl or config.yaml in it)")
    try:
        out = write_report(run, window=args.smooth, max_grids=args.max_grids)
    except MatplotlibMissing as e:
        raise SystemExit(str(e)) from None
    print(out)
    return out


if __name__ == "__main__":
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    main()
