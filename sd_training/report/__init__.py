"""The run report: ``report.html`` in the run folder, one self-contained page (plots and sample grids embedded
as base64 data URIs, inline CSS, nothing fetched: it reads offline, copied anywhere), with the plots also
written as PNGs to ``report/``.

Refreshed by rank 0 at every export (:func:`refresh_after_export`, called from ``outputs.RunOutputs.export``;
``experiment.report``), and for any run folder by ``python scripts/report.py RUN`` (or
``scripts/plot_metrics.py RUN --report``). The page holds a summary table (run, family, steps, images seen,
global batch, learning rate, precision, last loss, the config), the metrics panels of
:mod:`sd_training.report.series` drawn by :mod:`sd_training.report.plots`, and the sample grids over time
side by side. Needs matplotlib (``pip install 'sd-training[plots]'``); without it the trainer skips the
report with one warning. Drawing it never stops training: a failure is a warning.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import yaml

from ..config.schema import TrainConfig
from ..families.base import Family
from ..families.registry import FAMILIES, detect_source
from ..outputs.readers import MAX_YAML_BYTES, UnsafeFile, read_yaml
from ..run.run_dir import RunDir
from ..run.train_state import Plan
from .page import render, summary_rows
from .plots import PLOTS_EXTRA, MatplotlibMissing, draw_panel, require_matplotlib
from .series import panels, read_metrics

__all__ = ["write_report", "refresh_after_export", "MatplotlibMissing", "PLOTS_EXTRA", "MAX_GRIDS"]

log = logging.getLogger(__name__)

MAX_GRIDS = 12  # sample grids per row of the page (evenly spread over the run, the first and last always)
_warned_missing = False  # the trainer warns once per process that matplotlib is missing


def _family(cfg: dict, run: RunDir) -> str:
    """The family the config names, or for ``auto`` the one its pipeline (or the run's export) declares."""
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    family = model.get("family") or "auto"
    for source in (model.get("pretrained"), run.pipeline(None)):
        try:
            found = detect_source(str(family), str(source) if source else None, must=False)
        except Exception:  # a pipeline that moved or is not a diffusers one: try the next source
            continue
        if found:
            return found
    return str(family)


def _read_config(run: RunDir) -> tuple[dict, str]:
    """The run's config.yaml as a dict and as text (shown on the page), read with the bounded reader: a
    file with YAML aliases or deep nesting (not one a run wrote) is left out of the summary with a warning."""
    if not run.config.is_file():
        return {}, ""
    try:
        cfg = read_yaml(run.config)
    except UnsafeFile as e:
        log.warning("%s: the report's summary leaves the config out", e)
        return {}, ""
    except (yaml.YAMLError, OSError) as e:
        log.warning("%s is not YAML (%s): the report's summary leaves its values out", run.config, e)
        return {}, _text_of(run.config)
    return (cfg if isinstance(cfg, dict) else {}), _text_of(run.config)


def _text_of(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(MAX_YAML_BYTES)
    except OSError:
        return ""


def write_report(root: str | Path, facts: dict | None = None, window: int | None = None,
                 max_grids: int = MAX_GRIDS) -> Path:
    """Write ``report.html`` (and ``report/<panel>.png``) for the run folder ``root``; returns the page's path.

    ``facts``: what only the trainer knows (family, global_batch, total_steps, world_size; derived from the
    files when left out); ``window``: the smoothing window (None: about 1/20 of the points). Raises
    :class:`MatplotlibMissing` without matplotlib."""
    require_matplotlib()
    run = RunDir.at(root)
    if not run.root.is_dir():
        raise FileNotFoundError(f"{run.root} is not a run folder (no such directory)")
    metrics = read_metrics(run.metrics) if run.metrics.is_file() else {}
    cfg, config_text = _read_config(run)
    facts = dict(facts or {})
    if "family" not in facts:
        facts["family"] = _family(cfg, run)
    family_cls = FAMILIES.get(facts["family"])
    tag = facts.get("samples_tag") or (family_cls.samples_tag if family_cls else "samples")
    drawn = panels(metrics, window)
    run.report_assets.mkdir(parents=True, exist_ok=True)
    pngs = {p.spec.name: draw_panel(p, run.report_assets / f"{p.spec.name}.png").read_bytes() for p in drawn}
    for old in run.report_assets.glob("*.png"):  # a panel no longer drawn (its keys gone after a restart)
        if old.stem not in pngs:
            old.unlink()
    title = f"{cfg.get('experiment', {}).get('name') or run.root.name}: run report"
    prompts = cfg.get("experiment", {}).get("sample_prompts") or []
    page = render(title, summary_rows(cfg, metrics, facts), config_text, drawn, pngs, run.sample_grids(), max_grids,
                  tag, [str(p) for p in prompts] if isinstance(prompts, list) else [])
    tmp = run.report_html.with_name(run.report_html.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, run.report_html)  # a reader never sees half a page
    return run.report_html


def refresh_after_export(cfg: TrainConfig, root: str | Path, family: Family, world_size: int) -> None:
    """The export hook (rank 0): rewrite the report unless ``experiment.report`` is off. Never raises:
    without matplotlib one warning per process, any other failure a warning; training goes on."""
    global _warned_missing
    if not cfg.experiment.report:
        return
    t0 = time.perf_counter()
    try:
        plan = Plan.make(cfg, world_size)
        facts = {"family": family.name, "samples_tag": family.samples_tag, "world_size": world_size,
                 "global_batch": plan.global_batch, "total_steps": plan.total_steps}
        path = write_report(root, facts)
    except MatplotlibMissing as e:
        if not _warned_missing:
            log.warning("%s. The run goes on without report.html; set experiment.report=false to silence this", e)
            _warned_missing = True
        return
    except Exception as e:  # drawing must never stop a run
        log.warning("the run report (report.html) could not be written, training goes on: %s: %s",
                    type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
        return
    log.info("run report %s refreshed in %.1fs", path, time.perf_counter() - t0)
