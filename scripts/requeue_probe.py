"""A stand-in for train.py that exercises SLURM's signal -> requeue -> restart path in seconds.

Tests copy it as ``train.py`` into a scratch directory and submit ``batch_files/*.sbatch`` there with
``--chdir``, so the template runs it exactly as it would run the trainer: one process per task under
``srun`` (or per worker under torchrun), with ``config=PATH key=value ...`` arguments.

Per process it writes ``<out>/<event>.r<restart>.rank<rank>`` marker files (``start``, ``signal``,
``saved``, ``requeue``, ``exit``), each one JSON line written atomically, and prints the same
events. On SIGUSR1/SIGTERM it does what the trainer does: set a flag, act at the next "step"
(0.1 s), "save" for ``save_seconds``, rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (first run
only, unless ``requeue=always``), every rank exits 0. Without a signal it exits 0 after ``steps``
steps (the restarted run after ``restart_steps``).

    python requeue_probe.py config=ignored out=/tmp/markers steps=600 restart_steps=5

Arguments (``key=value``): out (required), steps [600], restart_steps [5],
requeue [once|always|never], save_seconds [0], allreduce [0|1]: if 1, join torch.distributed
(gloo; MASTER_ADDR/MASTER_PORT from the environment) and all_reduce rank + 1 once at start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _env_int(*names: str, default: int = 0) -> int:
    for name in names:
        if os.environ.get(name, "") != "":
            return int(os.environ[name])
    return default


def main(argv: list[str]) -> int:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    rank = _env_int("RANK", "SLURM_PROCID")
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    restart = _env_int("SLURM_RESTART_COUNT")
    job = os.environ.get("SLURM_JOB_ID", "")

    def record(event: str, **extra) -> None:
        data = {"event": event, "rank": rank, "world": world, "restart": restart, "job": job,
                "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()), "netns": netns,
                "pid": os.getpid(), "time": time.time(), **extra}
        line = json.dumps(data)
        tmp = out / f".{event}.r{restart}.rank{rank}.tmp"  # readers must never see half a line
        tmp.write_text(line + "\n")
        os.replace(tmp, out / f"{event}.r{restart}.rank{rank}")
        print(f"probe {line}", flush=True)

    parent = os.getppid()
    netns = os.readlink("/proc/self/ns/net") if os.path.exists("/proc/self/ns/net") else ""
    caught: list[int] = []
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: caught.append(signum))

    extra = {}
    if args.get("allreduce") == "1":
        import torch
        import torch.distributed as dist

        # Explicit rank/world: under plain srun only SLURM_PROCID/SLURM_NTASKS are set, not RANK.
        dist.init_process_group("gloo", rank=rank, world_size=world)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        extra = {"allreduce": t.item(), "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"}
        dist.destroy_process_group()
    record("start", argv=argv, **extra)

    steps = int(args.get("restart_steps" if restart else "steps", 600 if not restart else 5))
    for step in range(steps):
        if caught:
            name = signal.Signals(caught[0]).name
            record("signal", signal=name, step=step)
            time.sleep(float(args.get("save_seconds", 0)))  # a checkpoint save takes a while
            # parent_same: the launcher (srun's slurmstepd or torchrun) outlived the save.
            record("saved", step=step, parent_same=os.getppid() == parent)
            policy = args.get("requeue", "once")
            if rank == 0 and job and (policy == "always" or (policy == "once" and restart == 0)):
                r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
                record("requeue", rc=r.returncode, stderr=r.stderr.strip())
            record("exit", reason=name)
            return 0
        time.sleep(0.1)
    record("exit", reason="done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
