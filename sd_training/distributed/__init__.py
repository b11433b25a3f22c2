"""One environment probe (torchrun | plain srun | single process), process-group setup and teardown.

This is the only module that reads rank variables from the environment.

Restarts inside a job (``torchrun --max-restarts N``): torchrun's agent keeps one TCPStore for the whole job
(static rendezvous) and its workers use it without a per-attempt prefix, so a restarted rank can read the
previous attempt's keys (a dead rank's address: "Connection refused", or a hang in the group's set-up).
:func:`setup` keeps attempts apart itself: its keys live under ``sd_training/<run id>/attempt_<N>/``
(``TORCHELASTIC_RESTART_COUNT``).

A dead peer: gloo's collectives fail at once ("Connection reset by peer") when a peer's sockets close;
NCCL's may spin. The launcher notices the death first (torchrun within its monitor interval, srun with
``--kill-on-bad-exit``) and sends SIGTERM to the survivors; a survivor blocked in a collective cannot act
on it, and exits 10 s later (``preemption.StopFlag``). NCCL's asynchronous error handling
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``, set if unset) ends a rank whose collective timed out or failed
(``distributed.timeout_minutes``) instead of leaving it hung.
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

from ..config import ConfigError

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

    @property
    def nodes(self) -> int:
        """Nodes of the job (the launcher's ranks per node: torchrun's LOCAL_WORLD_SIZE, SLURM's tasks per node)."""
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def has_group(self) -> bool:
        """A process group is up: several ranks, or one rank that FSDP2 asked for (``setup(one_rank_group)``)."""
        return self.backend is not None


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


def setup(device: str = "auto", backend: str = "auto", init_method: str = "env://", timeout_minutes: float = 30.0,
          one_rank_group: bool = False, hsdp_shard: int | None = None) -> DistInfo:
    """Start the process group (when there is more than one process) and pick this rank's device.

    ``one_rank_group``: one process starts a process group of its own too (``distributed.strategy=fsdp``:
    FSDP2 and its CPU offload on one GPU). Its store is in this process (``HashStore``): no address or
    port is opened, and nothing else can join it. ``hsdp_shard``: ``distributed.hsdp_shard_size`` under
    hsdp, checked against the rank layout before any rendezvous (every rank raises the same ConfigError)."""
    layout = probe_env()
    if hsdp_shard is not None:
        hsdp_shard_size(hsdp_shard, layout["world_size"], layout["local_world_size"])
    dev = pick_device(device, layout["local_rank"], backend)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if layout["world_size"] == 1 and not one_rank_group:
        return DistInfo(device=dev, launcher=layout["launcher"])
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise RuntimeError("distributed.dist_backend=nccl needs CUDA devices; use gloo (or auto) on CPU")
    if layout["world_size"] == 1:
        return _one_rank_group(dev, backend, layout["launcher"], datetime.timedelta(minutes=timeout_minutes))
    if init_method == "env://":
        os.environ.setdefault("MASTER_ADDR", layout["master_addr"])
        os.environ.setdefault("MASTER_PORT", str(layout["master_port"]))
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = dev  # binds the communicator to this GPU; avoids a hang on first barrier
        # A failed or timed-out collective ends the process (torchrun sets the same; srun does not).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = attempt_store(timeout) if init_method == "env://" else None
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method
    dist.init_process_group(
        backend=backend,
        rank=layout["rank"],
        world_size=layout["world_size"],
        timeout=timeout,
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


def _one_rank_group(dev: torch.device, backend: str, launcher: str, timeout: datetime.timedelta) -> DistInfo:
    """A process group of this one process (rank 0 of 1), its rendezvous in an in-process store."""
    kwargs = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)
    log.info("one process with a process group of its own (%s): FSDP2 (distributed.strategy=fsdp or hsdp) on one "
             "rank", backend)
    return DistInfo(launcher=launcher, device=dev, backend=backend)


def attempt_store(timeout: datetime.timedelta, env: dict[str, str] | None = None):
    """Under torchrun: a client of the agent's store whose keys are this attempt's own (prefix
    ``sd_training/<run id>/attempt_<TORCHELASTIC_RESTART_COUNT>/``); None elsewhere (srun, one process,
    or a store the agent does not serve: env:// as usual)."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timeout)
    prefix = f"sd_training/{env.get('TORCHELASTIC_RUN_ID', 'none')}/attempt_{env['TORCHELASTIC_RESTART_COUNT']}/"
    return dist.PrefixStore(prefix, store)


def teardown(failed: bool = False) -> None:
    """Destroy the process group; after a failure, abort it (NCCL's destroy can wait on a collective whose
    peer is gone; an abort does not)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from ..run.preemption import EXITS

    EXITS.stage("destroying the process group")
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if failed and abort is not None and dist.get_backend() == "nccl":
        try:
            abort()
            EXITS.stage(None)
            return
        except Exception as e:  # noqa: BLE001 (then the ordinary destroy)
            log.warning("aborting the process group failed (%s); destroying it", e)
    dist.destroy_process_group()
    EXITS.stage(None)


def hsdp_shard_size(configured: int, world_size: int, local_world_size: int) -> int:
    """Ranks per shard group of ``distributed.strategy=hsdp``: ``configured`` (``distributed.hsdp_shard_size``),
    or 0 for the ranks of one node. A ConfigError when it does not divide the rank count: HSDP's mesh is
    (world / shard) replicas x shard ranks, every replica the same size."""
    size = configured or local_world_size
    if size >= 1 and world_size % size == 0:
        return size
    given = (f"distributed.hsdp_shard_size={configured}" if configured else
             f"distributed.hsdp_shard_size=0 (the ranks of one node: {local_world_size})")
    raise ConfigError(f"{given} does not divide the {world_size} ranks of this job: distributed.strategy=hsdp "
                      "shards inside groups of that many ranks and replicates across groups of equal size. Set "
                      "distributed.hsdp_shard_size to a divisor of the rank count (the GPUs of one node; the same "
                      "number of ranks on every node), or use distributed.strategy=fsdp")


def hsdp_mesh(device_type: str, world_size: int, shard_size: int):
    """The 2-D device mesh of hsdp: dims ("replicate", "shard"), consecutive ranks (one node's, as torchrun
    and srun number them) in one shard group, so weights are gathered and gradients reduce-scattered inside
    a node and only the gradient all-reduce of each shard crosses nodes (collective: every rank calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world_size // shard_size, shard_size),
                            mesh_dim_names=("replicate", "shard"))


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


def warn_starved_loader(cpus: int, workers: int, device: torch.device) -> None:
    """Log a warning when ``workers`` loader workers and the trainer need more than the ``cpus`` it may use."""
    if workers + 1 > cpus:
        log.warning(
            "this process may run on %d CPU(s) but starts %d loader worker(s) besides the trainer: the loader "
            "will starve the %s. Give each task more CPUs (SLURM: --cpus-per-task, which srun since 22.05 "
            "only applies with SRUN_CPUS_PER_TASK exported, as batch_files/ do) or lower system.workers",
            cpus, workers, device.type.upper() if device.type == "cuda" else "step")


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity (what SLURM's task binding, taskset or a cgroup cpuset
    leave it), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1
