"""Entry point: python train.py config=path/to/run.yaml [key.sub=value ...]   (also under torchrun / srun)."""

import sys

# First, before the heavy imports, the config and the model loading: a SLURM signal (preemption,
# the time-limit warning) that arrives during set-up is kept and acted on at the first step. This
# process is ours, so deadlines may end it (a stop it cannot act on, a shutdown that hangs).
from sd_training.run.preemption import (EXITS, FAILED_EXIT_S, StopFlag, enable_bounded_exits, exit_failed,
                                        exit_process, install_stack_dump)

enable_bounded_exits()
STOP = StopFlag().install()
install_stack_dump()  # kill -USR2 PID: every thread's stack on stderr, the run goes on

from sd_training.cli import main  # noqa: E402

if __name__ == "__main__":
    try:
        code = main(sys.argv[1:], stop=STOP)
    except BaseException as e:  # noqa: BLE001
        exit_failed(e)  # the traceback, then exit at once: nothing left to wait for
    # The interpreter's exit (non-daemon threads, atexit handlers) is bounded too, with the run's exit code.
    EXITS.arm("exit", FAILED_EXIT_S, code, f"the run ended {FAILED_EXIT_S:.0f}s ago and the interpreter has not exited")
    exit_process(code)
