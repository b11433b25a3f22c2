"""Evaluate generated images (or a pipeline) offline; alone, under torchrun, or from AsyncEvaluator.

    python -m sd_training.evaluation --out result.json --images DIR \\
        --ref-stats coco_ref.npz [--ref-images DIR|SHARDS] \\
        [--clip-model ViT-L-14 --clip-pretrained /weights/open_clip_vit_l14.bin] [--prompts captions.csv]

    # generate from an exported pipeline first (images go to --images, default OUT_images/):
    python -m sd_training.evaluation --out result.json --pipeline runs/x/current_pipeline \\
        --prompts captions.csv --num-images 1000 --resolution 512 --ref-stats coco_ref.npz

    # only compute and cache the reference statistics:
    python -m sd_training.evaluation --ref-images DIR|SHARDS --ref-stats ref.npz

Rank 0 writes ``--out``: ``{"step": N, "eval/fid": ..., "eval/clip_score": ..., "eval/num_images": ...,
"eval/seconds": ...}``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from .evaluate import EvalSettings, evaluate_images, write_result
from .fid import image_files


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sd_training.evaluation", description=__doc__.split("\n")[0])
    src = p.add_argument_group("what to evaluate")
    src.add_argument("--images", help="folder of generated images ({i:06d}.png, prompt in {i:06d}.txt)")
    src.add_argument("--pipeline", help="exported diffusers pipeline folder: generate --num-images into --images first")
    src.add_argument("--step", type=int, default=None, help="training step the images belong to (copied to the result)")
    src.add_argument("--out", help="result JSON (written by rank 0)")
    gen = p.add_argument_group("generation (with --pipeline)")
    gen.add_argument("--prompts", help="prompt file: .txt one per line, or .csv with a 'caption' column")
    gen.add_argument("--num-images", type=int, default=None, help="images to generate (default: one per prompt)")
    gen.add_argument("--seed", type=int, default=0, help="image i uses generator seed seed+i")
    gen.add_argument("--steps", type=int, default=25, help="denoising steps")
    gen.add_argument("--guidance", type=float, default=7.5, help="classifier-free guidance scale")
    gen.add_argument("--resolution", type=int, default=None, help="pixels (default: the pipeline's)")
    gen.add_argument("--gen-batch-size", type=int, default=8, help="prompts per pipeline call")
    gen.add_argument("--reference-file", help="edit pipelines (Flux Kontext ...): one line per prompt, its reference "
                     "image path(s) tab-separated, relative to the file's folder (a run's "
                     "experiment.eval_reference_file); resized to --resolution, which it needs")
    met = p.add_argument_group("metrics")
    met.add_argument("--ref-stats", help=".npz reference statistics: read if present, else written from --ref-images")
    met.add_argument("--ref-images", help="reference images: a folder, or WebDataset shards (brace pattern or folder of .tar)")
    met.add_argument("--ref-max-images", type=int, default=None, help="use at most this many reference images")
    met.add_argument("--clip-model", help="open_clip model name (e.g. ViT-L-14) or local-dir:PATH")
    met.add_argument("--clip-pretrained", help="local open_clip weights file for --clip-model")
    met.add_argument("--clip-config", help="extra open_clip model config .json that defines --clip-model")
    met.add_argument("--batch-size", type=int, default=32, help="images per Inception / CLIP batch")
    sysg = p.add_argument_group("system")
    sysg.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    sysg.add_argument("--threads", type=int, default=None, help="torch CPU threads (keep low next to a training run)")
    sysg.add_argument("--progress", action="store_true", help="progress bars on rank 0")
    args = p.parse_args(argv)
    if args.pipeline and not (args.prompts and (args.images or args.out)):
        p.error("--pipeline needs --prompts and --images (or --out, to put images beside it)")
    if not (args.images or args.pipeline) and not (args.ref_images and args.ref_stats):
        p.error("give --images or --pipeline, or --ref-images with --ref-stats to only cache reference statistics")
    if (args.images or args.pipeline) and not args.out:
        p.error("--out is required to evaluate images")
    if args.reference_file and not (args.pipeline and args.resolution):
        p.error("--reference-file goes with --pipeline and --resolution (the references are resized to it)")
    return args


def reference_calls(path: str | None, pipeline: str, n_prompts: int, resolution: int) -> list[dict] | None:
    """Each prompt's pipeline arguments from ``--reference-file`` (``references.reference_inputs`` for the
    pipeline's family: an edit pipeline needs the file, a text-to-image one takes none); None without it."""
    from .references import pipeline_family, reference_inputs

    return reference_inputs(path, pipeline_family(pipeline), n_prompts, resolution, f"--pipeline {pipeline}")[1]


def main(argv: list[str] | None = None) -> dict | None:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    from .. import distributed

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.time()
    info = distributed.setup(args.device)
    try:
        settings = EvalSettings(
            prompts=args.prompts, ref_stats=args.ref_stats, ref_images=args.ref_images,
            ref_max_images=args.ref_max_images, clip_model=args.clip_model, clip_pretrained=args.clip_pretrained,
            clip_config=args.clip_config, device=str(info.device), batch_size=args.batch_size,
        )
        if not (args.images or args.pipeline):
            from .fid import reference_stats

            stats = reference_stats(args.ref_images, args.ref_stats, None, args.ref_max_images, info.device, args.progress)
            return {"eval/fid_reference_images": stats.n}
        images = Path(args.images) if args.images else Path(args.out).with_name(Path(args.out).stem + "_images")
        if args.pipeline:
            from ..outputs.export import read_prompts
            from .generate import generate_images, image_path, load_pipeline

            prompts = read_prompts(args.prompts)
            n = args.num_images or len(prompts)
            calls = reference_calls(args.reference_file, args.pipeline, len(prompts), args.resolution)
            pipe = load_pipeline(args.pipeline, info.device)
            generate_images(
                pipe, prompts, n, images, args.seed, args.steps, args.guidance, args.resolution, info.rank,
                info.world_size, args.gen_batch_size, progress=args.progress, calls=calls,
            )
            del pipe
            distributed.barrier()  # every rank's images are on disk before anyone reads them
            files = [image_path(images, i) for i in range(n)]
        else:
            files = image_files(images)
        result = {"step": args.step, **evaluate_images(files, settings, args.progress)}
        result["eval/seconds"] = time.time() - t0
        if info.is_main:
            write_result(args.out, result)
            logging.getLogger(__name__).info("evaluation: %s", result)
        return result
    finally:
        distributed.teardown()


if __name__ == "__main__":
    main()
