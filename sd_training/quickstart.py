"""Generated inputs for runs with no downloads: the tiny pipeline and the generated-shapes dataset.

Rank 0 writes whatever is absent (into a temporary folder, renamed when complete), the others wait.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from . import distributed
from .config.schema import QuickstartConfig
from .data.synthetic import write_shapes_shards
from .families.registry import make_tiny_pipeline

log = logging.getLogger(__name__)


def _build_atomically(final: Path, build) -> None:
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(final)


def prepare(cfg: QuickstartConfig, is_main: bool) -> None:
    if is_main and cfg.tiny_pipeline and not (Path(cfg.tiny_pipeline) / "model_index.json").exists():
        log.info("building the tiny random-weight pipeline in %s", cfg.tiny_pipeline)
        _build_atomically(Path(cfg.tiny_pipeline), lambda out: make_tiny_pipeline(out, family=cfg.tiny_family))
    if is_main and cfg.shapes_dataset:
        _prepare_shapes(cfg)
    distributed.barrier()


SHAPES_SPEC = "quickstart_spec.json"


def _prepare_shapes(cfg: QuickstartConfig) -> None:
    """Write the shapes dataset when absent, or rewrite it when it was written with other settings (its
    ``quickstart_spec.json`` records them), so a changed ``quickstart.shapes_*`` key always takes effect."""
    folder = Path(cfg.shapes_dataset)
    spec = {"samples": cfg.shapes_samples, "per_shard": cfg.shapes_per_shard, "size": cfg.shapes_size,
            "radius": [float(r) for r in cfg.shapes_radius], "offset": float(cfg.shapes_offset), "seed": 0}
    if folder.is_dir():
        try:
            if json.loads((folder / SHAPES_SPEC).read_text()) == spec:
                return
        except (OSError, ValueError):
            pass
        log.info("%s was written with other settings than quickstart.shapes_*: writing it again", folder)
        shutil.rmtree(folder)
    n_shards = -(-cfg.shapes_samples // cfg.shapes_per_shard)
    log.info("writing %d generated-shapes images in %d shards to %s", cfg.shapes_samples, n_shards, folder)

    def build(out: Path) -> None:
        write_shapes_shards(str(out), cfg.shapes_samples, n_shards, size=cfg.shapes_size, seed=0,
                            radius=tuple(spec["radius"]), offset=spec["offset"])
        (out / SHAPES_SPEC).write_text(json.dumps(spec, indent=1))

    _build_atomically(folder, build)
