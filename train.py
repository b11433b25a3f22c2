"""Entry point: python train.py config=path/to/run.yaml [key.sub=value ...]   (also under torchrun / srun)."""

import sys

from sd_training.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
