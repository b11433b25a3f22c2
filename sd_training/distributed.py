"""One environment probe (torchrun | plain srun | single process), process-group setup and teardown.

This is the only module that reads rank variables from the environment.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "single"  # torchrun | srun | single
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None when no process group is started (single process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _first_host(nodelist: str) -> str:
    """First host of a SLURM node list, e.g. 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def probe_env(env: dict[str, str] | None = None) -> dict:
    """Rank layout from the launcher's variables: torchrun first, then srun, else one process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (or anything that sets the env:// variables)
        return dict(
            launcher="torchrun",
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=env.get("MASTER_PORT", "29500"),
        )
    # Inside an srun step (not the batch shell, which has SLURM_PROCID=0 but no step): one task per rank.
    if int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in env:
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1"))
        return dict(
            launcher="srun",
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_STEP_NUM_TASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=int(re.match(r"\d+", per_node).group(0)),  # e.g. '2(x4)' -> 2
            master_addr=env.get("MASTER_ADDR") or _first_host(env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))),
            # A port derived from the job id keeps two jobs sharing a node apart.
            master_port=env.get("MASTER_PORT") or str(20000 + job_id % 20000),
        )
    return dict(launcher="single", rank=0, world_size=1, local_rank=0, local_world_size=1)


SLURM_GPU_VARS = ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK",
                  "SLURM_GPUS")


def gpus_requested_from_slurm() -> str | None:
    """The SLURM variable that says this job asked for GPUs (``--gpus*``, ``--gres=gpu``), or None."""
    for var in SLURM_GPU_VARS:
        if os.environ.get(var, "").strip() not in ("", "0"):
            return f"{var}={os.environ[var]}"
    if "gpu" in os.environ.get("SLURM_TRES_PER_TASK", "") or "gpu" in os.environ.get("SLURM_JOB_GRES", ""):
        return "SLURM_TRES_PER_TASK/SLURM_JOB_GRES name gpu"
    return None


def pick_device(requested: str, local_rank: int, backend: str = "auto") -> torch.device:
    """``cuda``: GPU ``local_rank`` (mod the visible count); ``cpu``; ``auto``: a GPU when one is visible.

    ``auto`` never falls back to the CPU silently where a GPU was clearly meant: under SLURM with GPUs
    requested, or with ``distributed.dist_backend=nccl``, no visible GPU is an error."""
    if torch.cuda.is_available() and requested in ("auto", "cuda"):
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if requested == "cpu":
        return torch.device("cpu")
    seen = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}, torch {torch.__version__}"
    if requested == "cuda":
        raise ConfigError(f"system.device=cuda but no GPU is visible to this process ({seen}); check nvidia-smi "
                          "and the job's GPU request, or set system.device=cpu")
    meant = gpus_requested_from_slurm() or ("distributed.dist_backend=nccl" if backend == "nccl" else None)
    if meant:
        raise ConfigError(f"system.device=auto found no GPU although {meant} asks for GPUs ({seen}); training on "
                          "the CPU would be silently slow. Fix the GPU visibility (a CPU-only torch build? the "
                          "job's --gpus/--gres?), or set system.device=cpu explicitly")
    return torch.device("cpu")


def configure_math(device: torch.device, tf32: bool) -> None:
    """On CUDA: TF32 tensor cores for fp32 matmuls and convolutions, or not (``system.tf32``). PyTorch's own
    defaults differ (convolutions on, matmuls off); the key sets both. Nothing to set on the CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
        torch.backends.cudnn.allow_tf32 = bool(tf32)


def setup(device: str = "auto", backend: str = "auto", init_method: str = "env://", timeout_minutes: float = 30.0) -> DistInfo:
    """Start the process group (when there is more than one process) and pick this rank's device."""
    layout = probe_env()
    dev = pick_device(device, layout["local_rank"], backend)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if layout["world_size"] == 1:
        return DistInfo(device=dev, launcher=layout["launcher"])
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise RuntimeError("distributed.dist_backend=nccl needs CUDA devices; use gloo (or auto) on CPU")
    if init_method == "env://":
        os.environ.setdefault("MASTER_ADDR", layout["master_addr"])
        os.environ.setdefault("MASTER_PORT", str(layout["master_port"]))
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = dev  # binds the communicator to this GPU; avoids a hang on first barrier
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=layout["rank"],
        world_size=layout["world_size"],
        timeout=datetime.timedelta(minutes=timeout_minutes),
        **kwargs,
    )
    return DistInfo(
        rank=layout["rank"],
        local_rank=layout["local_rank"],
        world_size=layout["world_size"],
        local_world_size=layout["local_world_size"],
        launcher=layout["launcher"],
        device=dev,
        backend=backend,
    )


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (a no-op for one process). Note: a sync point with the device."""
    if dist.is_available() and dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on at least one (e.g. a preemption signal)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity (what SLURM's task binding, taskset or a cgroup cpuset
    leave it), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1
