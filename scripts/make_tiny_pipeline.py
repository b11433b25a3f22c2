"""Write a tiny random-weight pipeline of a model family (real diffusers/transformers classes, offline).

    python scripts/make_tiny_pipeline.py OUT_DIR [--seed 0] [--family NAME]

``--family``: a name in the family registry (``sd_training.families.registry.FAMILIES``; default: the
default family's). From Python: ``sd_training.families.registry.make_tiny_pipeline(out_dir, family=...)``.
"""

import argparse

from sd_training.config.script_args import SEED_MAX, integer, out_folder
from sd_training.families.registry import DEFAULT_FAMILY, FAMILIES, make_tiny_pipeline

if __name__ == "__main__":
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=out_folder, help="output folder (a diffusers pipeline: model_index.json and its components)")
    ap.add_argument("--seed", type=integer(0, SEED_MAX), default=0, help="seed of the random weights, >= 0")
    ap.add_argument("--family", choices=tuple(FAMILIES), default=DEFAULT_FAMILY,
                    help="; ".join(f"{name}: {'/'.join(cls.pipeline_classes)}" for name, cls in FAMILIES.items()))
    args = ap.parse_args()
    print(make_tiny_pipeline(args.out, seed=args.seed, family=args.family))
