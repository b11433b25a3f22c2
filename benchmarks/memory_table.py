"""The docs' table of single-GPU modes (docs/memory.md, "Measured on one GPU"), from bench_memory's JSON files.

    python benchmarks/memory_table.py runs/gpu_check/mem36_*.json runs/gpu_check/bench_memory.json

prints one markdown row per model and mode: the start-up plan's total (GiB per GPU) beside the measured peak
(CUDA max_memory_allocated, reserved in brackets), images/s and steps/s, and the goal's pass/fail. A mode that
was skipped (its lever not in the build, or a net the machine could not build) or failed says so. Paste the
rows over the placeholders.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HEADER = ("| model | mode | planned GiB | measured GiB (reserved) | img/s | steps/s | goal |\n"
          "|---|---|---|---|---|---|---|")


def goal_text(s: dict) -> str:
    parts = []
    if "goal_gib" in s:
        parts.append(f"<= {s['goal_gib']:g} GiB: {'yes' if s['within_goal'] else 'NO'}")
    if "goal_steps_per_sec" in s:
        parts.append(f">= {s['goal_steps_per_sec']:g} steps/s: {'yes' if s['within_speed_goal'] else 'NO'}")
    return "; ".join(parts) or "—"


def rows(result: dict) -> list[str]:
    """The markdown rows of one bench_memory JSON (``--out``)."""
    where = f"{result['model']} ({result['device']}, {result['resolution']} px, batch {result['batch']})"
    out = []
    for mode, s in result.get("summary", {}).items():
        if "error" in s:
            what = s["error"] if s.get("skipped") else f"failed: {s['error']}"
            out.append(f"| {where} | `{mode}` | — | {what} | — | — | — |")
            continue
        reserved = f" ({s['reserved_gib']:.1f})" if s.get("reserved_gib") is not None else ""
        steps = f"{s['steps_per_sec']:.2f}" if s.get("steps_per_sec") is not None else "—"
        out.append(f"| {where} | `{mode}` | {s['plan_total_gib']:.1f} | {s['peak_gib']:.1f}{reserved} | "
                   f"{s['images_per_sec']:.2f} | {steps} | {goal_text(s)} |")
    return out


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="bench_memory.py JSON files")
    args = p.parse_args(argv)
    lines = [HEADER]
    for path in args.results:
        try:
            lines += rows(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError) as exn:
            raise SystemExit(f"memory_table: {path}: not a bench_memory result ({exn})") from None
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
