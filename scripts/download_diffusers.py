"""Download a diffusers pipeline from the Hugging Face hub into a local folder (for offline training).

    python scripts/download_diffusers.py -o OUT -m MODEL_ID [--revision REV] [--fp32-only]

Afterwards use it with model.pretrained=OUT. Needs network access to the hub.
"""

import argparse
import sys
from pathlib import Path

from sd_training.config.script_args import out_folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", required=True, type=out_folder, help="output folder")
    ap.add_argument("-m", "--model", required=True, help="hub id, e.g. stabilityai/stable-diffusion-2-base")
    ap.add_argument("--revision", default=None, help="branch, tag or commit")
    args = ap.parse_args(argv)

    from diffusers import DiffusionPipeline

    try:
        pipe = DiffusionPipeline.from_pretrained(args.model, revision=args.revision, safety_checker=None)
    except OSError as e:
        print(
            f"error: could not download '{args.model}' from the hub: {str(e).splitlines()[0]}\n"
            "Check the model id and your network access (HF_HUB_OFFLINE must be unset), or log in with "
            "`hf auth login` for gated models.",
            file=sys.stderr,
        )
        return 1
    pipe.save_pretrained(args.out)
    from sd_training.outputs.file_modes import share_tree

    share_tree(args.out)  # safetensors writes its files 0600: the umask's mode, so the group can train from it
    print(f"saved {args.model} to {args.out}; train with model.pretrained={args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    sys.exit(main())
