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
from .data.synthetic import write_edit_shards, write_shapes_shards, write_word_shards
from .families.registry import make_tiny_pipeline
from .outputs.file_modes import share_tree

log = logging.getLogger(__name__)


def _build_atomically(final: Path, build) -> None:
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    share_tree(tmp)  # safetensors writes 0600: the cached pipeline follows the umask like every other file
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(final)


def prepare(cfg: QuickstartConfig, is_main: bool) -> None:
    if is_main and cfg.tiny_pipeline and not (Path(cfg.tiny_pipeline) / "model_index.json").exists():
        log.info("building the tiny random-weight pipeline in %s", cfg.tiny_pipeline)
        _build_atomically(Path(cfg.tiny_pipeline), lambda out: make_tiny_pipeline(out, family=cfg.tiny_family))
    if is_main and cfg.shapes_dataset:
        _prepare_shapes(cfg)
    if is_main and cfg.word_dataset:
        _prepare_word(cfg)
    if is_main and cfg.edit_dataset:
        _prepare_edit(cfg)
    distributed.barrier()


SHAPES_SPEC = "quickstart_spec.json"


def _prepare_shapes(cfg: QuickstartConfig) -> None:
    """Write the shapes dataset when absent, or rewrite it when it was written with other settings (its
    ``quickstart_spec.json`` records them), so a changed ``quickstart.shapes_*`` key always takes effect."""
    spec = {"samples": cfg.shapes_samples, "per_shard": cfg.shapes_per_shard, "size": cfg.shapes_size,
            "radius": [float(r) for r in cfg.shapes_radius], "offset": float(cfg.shapes_offset), "seed": 0}
    n_shards = -(-cfg.shapes_samples // cfg.shapes_per_shard)
    _write_dataset(Path(cfg.shapes_dataset), spec, "quickstart.shapes_*", lambda out: write_shapes_shards(
        str(out), cfg.shapes_samples, n_shards, size=cfg.shapes_size, seed=0, radius=tuple(spec["radius"]),
        offset=spec["offset"]))


def _prepare_word(cfg: QuickstartConfig) -> None:
    """The made-up word's images (quickstart.word_*), drawn like the shapes dataset (its size and jitter),
    kept while its settings match."""
    spec = {"word": cfg.word, "shape": cfg.word_shape, "colour": cfg.word_colour,
            "backgrounds": list(cfg.word_backgrounds), "samples": cfg.word_samples, "size": cfg.shapes_size,
            "radius": [float(r) for r in cfg.shapes_radius], "offset": float(cfg.shapes_offset), "seed": 0}
    _write_dataset(Path(cfg.word_dataset), spec, "quickstart.word_*", lambda out: write_word_shards(
        str(out), cfg.word, cfg.word_shape, cfg.word_colour, spec["backgrounds"], cfg.word_samples, 2,
        size=cfg.shapes_size, radius=tuple(spec["radius"]), offset=spec["offset"]))


def _prepare_edit(cfg: QuickstartConfig) -> None:
    """The paired edit dataset (quickstart.edit_*): a shape on a background that is not blue (the reference),
    the same shape on blue (the target), "make the background blue"; the shapes' size and shard size."""
    spec = {"samples": cfg.edit_samples, "kind": "edit", "per_shard": cfg.shapes_per_shard, "size": cfg.shapes_size, "seed": 0}
    n_shards = -(-cfg.edit_samples // cfg.shapes_per_shard)
    _write_dataset(Path(cfg.edit_dataset), spec, "quickstart.edit_*", lambda out: write_edit_shards(
        str(out), cfg.edit_samples, n_shards, size=cfg.shapes_size, seed=0))


def _write_dataset(folder: Path, spec: dict, keys: str, write) -> None:
    """``write(folder)`` when the folder is absent, or again when it was written with other settings (its
    ``quickstart_spec.json`` records them), so a changed key always takes effect."""
    if folder.is_dir():
        try:
            if json.loads((folder / SHAPES_SPEC).read_text()) == spec:
                return
        except (OSError, ValueError):
            pass
        log.info("%s was written with other settings than %s: writing it again", folder, keys)
        shutil.rmtree(folder)
    log.info("writing %d generated images to %s", spec["samples"], folder)

    def build(out: Path) -> None:
        write(out)
        (out / SHAPES_SPEC).write_text(json.dumps(spec, indent=1))

    _build_atomically(folder, build)
