"""Entry point: python train.py config=path/to/run.yaml [key.sub=value ...]   (also under torchrun / srun)."""

import sys

# First, before the heavy imports, the config and the model loading: a SLURM signal (preemption,
# the time-limit warning) that arrives during set-up is kept and acted on at the first step.
from sd_training.preemption import StopFlag

STOP = StopFlag().install()

from sd_training.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], stop=STOP))
