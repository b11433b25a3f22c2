"""The reference images of an edit family's sample grids and eval images: ``experiment.sample_references``
(one entry per ``experiment.sample_prompts`` entry: an image path, or a list of paths) and
``experiment.eval_reference_file`` (one line per eval prompt of ``experiment.eval_caption_file``: its
reference paths, tab-separated, relative to the file's folder).

Checked at load (:func:`check`, from ``registry.validate``): an edit family that samples needs them, a
text-to-image family takes none, every path must exist and each prompt have as many references as the
family takes. At sampling time each reference is read as RGB and resized to the sample's square size on its
own (:func:`load`: cover-resized, bicubic, then center-cropped: as ``dataset.params.reference_crop=center``
prepares a training reference), so the pipeline conditions on a reference of the size it generates; the
family's ``reference_call`` turns them into the pipeline's keyword arguments.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import ConfigError

SAMPLE_KEY = "experiment.sample_references"
EVAL_KEY = "experiment.eval_reference_file"


def sample_paths(experiment) -> tuple[tuple[str, ...], ...]:
    """``experiment.sample_references`` as one tuple of paths per prompt (a single path is a 1-tuple)."""
    out = []
    for i, entry in enumerate(experiment.sample_references or []):
        items = [entry] if isinstance(entry, str) else list(entry) if isinstance(entry, (list, tuple)) else None
        if not items or not all(isinstance(p, str) and p for p in items):
            raise ConfigError(f"'{SAMPLE_KEY}[{i}]' is {entry!r}: expected an image path or a list of image paths")
        out.append(tuple(items))
    return tuple(out)


def eval_paths(path: str) -> tuple[tuple[str, ...], ...]:
    """The lines of an eval reference file (blank lines skipped, as the prompt file's): each line's
    tab-separated paths, relative ones resolved against the file's folder."""
    folder = Path(path).parent
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(tuple(str(folder / p.strip()) if not os.path.isabs(p.strip()) else p.strip()
                              for p in line.split("\t") if p.strip()))
    return tuple(rows)


def check_rows(rows, key: str, family, where) -> None:
    """Each row (one prompt's paths) holds as many references as ``family`` takes, each an existing file
    (ConfigError naming ``key`` and ``where(i)``)."""
    fewest, most = family.reference_images
    for i, paths in enumerate(rows):
        if not fewest <= len(paths) <= most:
            takes = f"exactly {fewest}" if fewest == most else f"{fewest} to {most}"
            raise ConfigError(f"'{key}': {where(i)} has {len(paths)} reference image(s); the {family.name} family "
                              f"takes {takes}")
        for p in paths:
            if not os.path.isfile(p):
                raise ConfigError(f"'{key}': {where(i)} names {p}, which does not exist")


def check(cfg, family) -> None:
    """The sampling references of ``cfg`` against the family class ``family`` (see the module)."""
    from .export import read_prompts

    e = cfg.experiment
    fewest, most = family.reference_images
    if most == 0:
        for key, value in ((SAMPLE_KEY, e.sample_references), (EVAL_KEY, e.eval_reference_file)):
            if value:
                raise ConfigError(f"'{key}': the {family.name} family generates from text alone and takes no "
                                  "reference images; remove the key")
        return
    rows = sample_paths(e)
    samples = bool(e.sample_prompts) and e.sample_per_prompt > 0
    if samples and (rows or fewest > 0) and len(rows) != len(e.sample_prompts):
        raise ConfigError(f"'{SAMPLE_KEY}' has {len(rows)} entries for {len(e.sample_prompts)} "
                          f"experiment.sample_prompts: the {family.name} family edits reference images, so each "
                          "sample prompt needs its own (an image path, or a list of paths), or set "
                          "experiment.sample_prompts: [] to make no sample grid")
    check_rows(rows, SAMPLE_KEY, family, lambda i: f"entry {i} ({e.sample_prompts[i]!r})"
                if i < len(e.sample_prompts) else f"entry {i}")
    if e.num_eval_images < 1 or not e.eval_caption_file:
        return
    if not e.eval_reference_file:
        if fewest > 0:
            raise ConfigError(f"'{EVAL_KEY}' is needed for eval images of the {family.name} family (it edits "
                              "reference images): one line per eval prompt, its reference path(s) tab-separated, "
                              "relative to the file's folder")
        return
    if not os.path.isfile(e.eval_reference_file):
        raise ConfigError(f"'{EVAL_KEY}' {e.eval_reference_file} does not exist")
    rows, prompts = eval_paths(e.eval_reference_file), read_prompts(e.eval_caption_file)
    if len(rows) != len(prompts):
        raise ConfigError(f"'{EVAL_KEY}' {e.eval_reference_file} has {len(rows)} lines for the {len(prompts)} "
                          f"prompts of experiment.eval_caption_file: one line of reference paths per prompt")
    check_rows(rows, EVAL_KEY, family, lambda i: f"line {i + 1} of {e.eval_reference_file}")


def load(paths, resolution: int):
    """The reference images of one prompt as RGB PIL images of ``resolution`` x ``resolution`` (see the module)."""
    from PIL import Image, ImageOps

    out = []
    for p in paths:
        with Image.open(p) as im:
            out.append(ImageOps.fit(im.convert("RGB"), (resolution, resolution), Image.Resampling.BICUBIC))
    return out
