"""Write a tiny random-weight Stable Diffusion pipeline (real diffusers/transformers classes, offline).

    python scripts/make_tiny_pipeline.py OUT_DIR [--seed 0] [--family sd|sdxl]

From Python: ``sd_training.tiny.make_tiny_pipeline(out_dir)``.
"""

import argparse

from sd_training.tiny import make_tiny_pipeline

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output folder (a diffusers pipeline: model_index.json, unet/, vae/ ...)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--family", choices=("sd", "sdxl"), default="sd",
                    help="sd: StableDiffusionPipeline (1.x layout); sdxl: StableDiffusionXLPipeline (two text encoders)")
    args = ap.parse_args()
    print(make_tiny_pipeline(args.out, seed=args.seed, family=args.family))
