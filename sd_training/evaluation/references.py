"""An edit model's reference images for the offline generators (``python -m sd_training.evaluation
--reference-file``, ``scripts/generate_examples.py --reference-file``): the file's format is a run's
``experiment.eval_reference_file`` (one line per prompt, its reference paths tab-separated, relative to the
file's folder: ``outputs.sample_references``), each reference resized to the output size as the run's eval
images do it, turned into the pipeline's keyword arguments by the family's ``reference_call``.

Apart from :mod:`.generate` because it reads the family registry, whose families import :mod:`.generate`.
"""

from __future__ import annotations


def pipeline_family(folder: str, source_key: str = "--pipeline"):
    """The family class of an exported pipeline folder (its model_index.json's pipeline class); None for a
    pipeline no family trains (any diffusers text-to-image pipeline still generates: it takes no references)."""
    from ..config import ConfigError
    from ..families import registry

    try:
        return registry.FAMILIES[registry.detect_source("auto", folder, family_key="the pipeline's family",
                                                        source_key=source_key)]
    except ConfigError:
        return None


def reference_inputs(path: str | None, family, n_prompts: int, resolution: int,
                     source: str) -> tuple[list | None, list | None]:
    """(each prompt's reference images at ``resolution``, each prompt's pipeline keyword arguments from them: the
    family's ``reference_call``; ``family``: a family class or None) from a reference file (one line per
    prompt, its reference paths tab-separated, relative to the file's folder:
    ``outputs.sample_references.eval_paths``); (None, None) without the file.
    Refused (SystemExit, naming ``source``: the pipeline or checkpoint): an edit family without the file (it
    would generate from text alone, not the edit it learned), a text-to-image family with it, a file whose
    lines are not one per prompt, a line with a count of references the family does not take or a missing
    image."""
    from ..config import ConfigError
    from ..outputs import sample_references

    if family is None:  # pipeline_family of a pipeline no family trains
        if path:
            raise SystemExit(f"--reference-file {path}: {source} is not a pipeline of an edit family this package "
                             "trains, so how it takes reference images is not known")
        return None, None
    fewest, most = family.reference_images
    if not path:
        if fewest:
            raise SystemExit(f"{source} is a {family.name} model, which edits reference images: give --reference-file "
                             "(one line per prompt, its reference image path(s) tab-separated, relative to the "
                             "file's folder)")
        return None, None
    if not most:
        raise SystemExit(f"--reference-file {path}: {source} is a {family.name} model, which generates from text "
                         "alone and takes no reference images; leave the file out")
    rows = sample_references.eval_paths(path)
    if len(rows) != n_prompts:
        raise SystemExit(f"--reference-file {path} has {len(rows)} lines for {n_prompts} prompts: one per prompt")
    try:
        sample_references.check_rows(rows, "--reference-file", family, lambda i: f"line {i + 1} of {path}")
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    shown = [sample_references.load(paths, resolution) for paths in rows]
    return shown, [family.reference_call(images) for images in shown]
