"""Prompts -> images, from an exported pipeline or from a training checkpoint; split across ranks.

    python scripts/generate_examples.py --prompts captions.csv --out samples/ --pipeline runs/x/current_pipeline
    python scripts/generate_examples.py --prompts prompts.txt --out samples/ --checkpoint runs/x [--ema]
    python scripts/generate_examples.py --prompts edits.txt --reference-file refs.txt --resolution 1024 \
        --out samples/ --pipeline runs/edit/current_pipeline                 (an edit model)
    torchrun --nproc_per_node 8 scripts/generate_examples.py ...          (each rank makes its share)

Prompts: a .txt (one per line) or a .csv (its 'caption' column, else the first), as
``experiment.eval_caption_file``. Image ``i`` uses prompt ``i % len(prompts)`` and seed ``seed + i`` and
is written as ``{i:06d}.png`` with its prompt in ``{i:06d}.txt`` - the convention of the training run's
eval images, so ``python -m sd_training.evaluation --images OUT`` scores either. Existing images are
kept: rerun the same command to finish an interrupted job.

An edit model (Flux Kontext, Qwen-Image-Edit(-Plus), FLUX.2 with references) needs ``--reference-file``:
one line per prompt, its reference image path(s) tab-separated, relative to the file's folder (a run's
``experiment.eval_reference_file``, as ``python -m sd_training.evaluation --reference-file`` reads it).
Each reference is resized to the output size (cover, center crop) and saved beside each image it
conditions as ``{i:06d}.ref.png`` (``.ref2.png`` ...), which the evaluation leaves out of its score. An
edit model without the file, or a text-to-image model with it, is refused.

``--checkpoint`` takes a run folder, its ``checkpoints/`` folder, or one ``step_N`` folder (newest
complete one by default). The models are built from the ``config.yaml`` saved in the checkpoint
(``model.*`` keys can be changed with ``--set model.pretrained=/local/copy``) by the run's model family,
then the trained module's weights (or the EMA weights with ``--ema``) are loaded. FSDP checkpoints (``sharded/``) are not read here: use the
pipeline the run exported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from sd_training.config.script_args import SEED_MAX, existing, integer, number, out_folder

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True, type=existing("file"),
                   help="prompt file: .txt one per line, or .csv with a 'caption' column")
    p.add_argument("--out", required=True, type=out_folder, help="output folder ({i:06d}.png + {i:06d}.txt)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pipeline", help="exported diffusers pipeline folder (e.g. runs/x/current_pipeline)")
    src.add_argument("--checkpoint", type=existing("folder"),
                     help="run folder, its checkpoints/ folder, or a checkpoints/step_N folder")
    p.add_argument("--ema", action="store_true", help="with --checkpoint: use the EMA weights (ema.pt)")
    p.add_argument("--set", action="append", default=[], metavar="model.KEY=VALUE",
                   help="with --checkpoint: override a model.* key of the saved config (repeatable)")
    p.add_argument("--reference-file", type=existing("file"),
                   help="edit models: one line per prompt, its reference image path(s) tab-separated, relative "
                        "to the file's folder; with --pipeline it needs --resolution")
    p.add_argument("--num-images", type=integer(1, 10_000_000), default=None,
                   help="images in all, 1 to 10000000 (default: one per prompt)")
    p.add_argument("--seed", type=integer(0, SEED_MAX - 10_000_000), default=0, help="image i uses generator seed seed+i")
    p.add_argument("--steps", type=integer(1, 1000), default=25, help="denoising steps, 1 to 1000")
    p.add_argument("--guidance", type=number(0, 100), default=7.5, help="classifier-free guidance scale, 0 to 100")
    p.add_argument("--resolution", type=integer(64, 8192, multiple_of=8), default=None,
                   help="pixels, 64 to 8192, a multiple of 8 (default: the pipeline's, or the run's)")
    p.add_argument("--batch-size", type=integer(1, 1024), default=8, help="prompts per pipeline call, per rank, 1 to 1024")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="weights' precision")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.reference_file and args.pipeline and not args.resolution:
        p.error("--reference-file with --pipeline needs --resolution (the references are resized to it)")
    return args


def find_checkpoint(path: str) -> Path:
    """The newest complete step folder under a run / checkpoints folder, or the step folder itself."""
    from sd_training.checkpoint import MARKER, complete_steps
    from sd_training.run.run_dir import step_name

    p = Path(path)
    if (p / MARKER).exists():
        return p
    for root in (p / "checkpoints", p):
        steps = complete_steps(root)
        if steps:
            return root / step_name(steps[-1])
    raise FileNotFoundError(f"no complete checkpoint (a step_N folder with {MARKER}) in {p}")


def run_config(ckpt: Path, overrides: list[str]):
    """The checkpoint's config.yaml as a ``TrainConfig``, ``model.*`` keys overridden (not validated: the
    run's data paths need not exist here)."""
    from omegaconf import OmegaConf

    from sd_training.checkpoint.layout import CONFIG
    from sd_training.config.schema import train_config_class
    from sd_training.outputs.readers import UnsafeFile, read_yaml

    try:  # bounded: no YAML aliases, no deep nesting (a run never writes them)
        saved = OmegaConf.create(read_yaml(ckpt / CONFIG) or {})
    except UnsafeFile as e:
        raise SystemExit(str(e)) from None
    cli = OmegaConf.from_dotlist(overrides)
    bad = [k for k in cli.keys() if k != "model"]
    if bad:
        raise SystemExit(f"--set only changes model.* keys, got {bad[0]}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(train_config_class()), saved, cli))


def pipeline_from_checkpoint(ckpt: Path, cfg, ema: bool, device: torch.device):
    """The run's pipeline, built by its family from the checkpoint's config ``cfg`` (:func:`run_config`), with
    the checkpoint's trained weights."""
    from sd_training.checkpoint import init_weights_from
    from sd_training.checkpoint.layout import EMA, is_sharded, shared_file
    from sd_training.families import registry

    cfg.model.gradient_checkpointing = False  # inference
    # the frozen parts loaded at full precision (a bf16 run keeps them in bf16): --dtype says the precision
    cfg.model.mixed_precision = "no"
    if is_sharded(ckpt):
        raise FileNotFoundError(f"{ckpt} is an FSDP checkpoint (sharded/): generate from the pipeline the run exported")
    if ema and not shared_file(ckpt, EMA).is_file():
        raise FileNotFoundError(f"{shared_file(ckpt, EMA)} does not exist (the run had model.use_ema=False)")
    family = registry.create(cfg, device, cfg.system.seed, is_main=True)
    init_weights_from(str(ckpt), family.net, family.net_name, want_ema=ema)
    pipe = family.inference_pipeline(family.net)
    if pipe is None:
        raise SystemExit(f"{ckpt} was written by a run that trains no text-to-image model ({family.name}): "
                         "use the pipeline it exported")
    return pipe


def main(argv: list[str] | None = None) -> list[Path]:
    args = parse(sys.argv[1:] if argv is None else argv)
    from sd_training import distributed
    from sd_training.evaluation.generate import generate_images, load_pipeline
    from sd_training.evaluation.references import pipeline_family, reference_inputs
    from sd_training.families import registry
    from sd_training.outputs.export import read_prompts

    prompts = read_prompts(args.prompts)
    info = distributed.setup(args.device)
    try:
        resolution = args.resolution
        if args.pipeline:
            # the references are checked before the pipeline loads: a refusal costs nothing
            shown, calls = reference_inputs(args.reference_file, pipeline_family(args.pipeline), len(prompts),
                                            resolution, f"--pipeline {args.pipeline}")
            pipe = load_pipeline(args.pipeline, info.device, DTYPES[args.dtype])
        else:
            ckpt = find_checkpoint(args.checkpoint)
            if info.is_main:
                print(f"generating from {ckpt}{' (EMA)' if args.ema else ''}", file=sys.stderr)
            cfg = run_config(ckpt, args.set)
            resolution = resolution or int(cfg.dataset.params.resolution)
            shown, calls = reference_inputs(args.reference_file, registry.FAMILIES[registry.detect(cfg.model)],
                                            len(prompts), resolution, f"--checkpoint {ckpt}")
            pipe = pipeline_from_checkpoint(ckpt, cfg, args.ema, info.device)
            pipe.set_progress_bar_config(disable=True)
            # in place, not reassigned: .to() returns the bare pipeline, not a family's wrapper (TrainedLength ...)
            pipe.to(info.device, DTYPES[args.dtype])
        written = generate_images(
            pipe, prompts, args.num_images or len(prompts), args.out, args.seed, args.steps, args.guidance,
            resolution, info.rank, info.world_size, args.batch_size, progress=not args.no_progress,
            calls=calls, shown=shown,
        )
        distributed.barrier()  # the folder is complete when rank 0 returns
        return written
    finally:
        distributed.teardown()


if __name__ == "__main__":
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    main()
