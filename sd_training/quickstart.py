"""Generated inputs for runs with no downloads: the tiny pipeline and the generated-shapes dataset.

Rank 0 writes whatever is absent (into a temporary folder, renamed when complete), the others wait.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from . import distributed
from .config import QuickstartConfig

log = logging.getLogger(__name__)


def _build_atomically(final: Path, build) -> None:
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(final)


def prepare(cfg: QuickstartConfig, is_main: bool) -> None:
    if is_main and cfg.tiny_pipeline and not (Path(cfg.tiny_pipeline) / "model_index.json").exists():
        from .tiny import make_tiny_pipeline

        log.info("building the tiny random-weight pipeline in %s", cfg.tiny_pipeline)
        _build_atomically(Path(cfg.tiny_pipeline), make_tiny_pipeline)
    if is_main and cfg.shapes_dataset and not Path(cfg.shapes_dataset).is_dir():
        from .data.synthetic import write_shapes_shards

        n_shards = -(-cfg.shapes_samples // cfg.shapes_per_shard)
        log.info("writing %d generated-shapes images in %d shards to %s", cfg.shapes_samples, n_shards, cfg.shapes_dataset)
        _build_atomically(
            Path(cfg.shapes_dataset),
            lambda out: write_shapes_shards(out, cfg.shapes_samples, n_shards, size=cfg.shapes_size, seed=0),
        )
    distributed.barrier()
