"""Resume state: zero-padded step folders, written under a temporary name, marked complete, renamed.

    checkpoints/step_00001000/
      unet.pt            raw (non-EMA) UNet weights, always
      ema.pt             EMA weights (model.use_ema)
      optimizer.pt       optimizer state
      lr_scheduler.pt    LR scheduler state
      grad_scaler.pt     fp16 gradient scaler state
      sharded/           FSDP instead of unet/ema/optimizer.pt: every rank's shards (torch.distributed.checkpoint)
      rank_<R>.pt        per rank: RNG states (python, numpy, torch CPU and CUDA) and data-loader position
      train_state.json   step, images seen, tracker run id ...
      config.yaml        the resolved config of the run that wrote it
      COMPLETE           written last: only folders that have it are ever resumed from

The checkpointer sees a dict of objects with ``state_dict()`` / ``load_state_dict()``. Rank 0 writes the
shared state (replicated under DDP); every rank writes its own ``rank_<R>.pt``. A SIGKILL at any moment
leaves at most a ``*.tmp`` folder, which is ignored and cleaned up, never a half-written step folder.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from . import distributed

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step_(\d{8,})$")
MARKER = "COMPLETE"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        # As a tensor, not an ndarray: checkpoints load with weights_only=True, which unpickles no numpy.
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriteError(RuntimeError):
    pass


def _atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".part")
    try:
        torch.save(obj, tmp)
    except (OSError, RuntimeError) as e:
        # A full disk reads "basic_ios::clear: iostream error" from torch's writer: say what it is.
        raise CheckpointWriteError(describe_write_error(path, e)) from e
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        m = STEP_RE.match(d.name)
        if m and d.is_dir() and (d / MARKER).exists():
            steps.append(int(m.group(1)))
    return sorted(steps)


def describe_write_error(path: Path, e: BaseException) -> str:
    """One line that says why writing ``path`` failed and what to do."""
    import errno

    folder = Path(path).parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    code = getattr(e, "errno", None)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {path}: {os.strerror(code)}. Make {folder} writable; the previous checkpoint is intact"
    if code in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < 64 * 2**20):
        return (f"cannot write {path}: no space left on the device (or quota reached; {free or 0:,} bytes free). "
                "Free space or move experiment.log_dir; the previous checkpoint is intact")
    return f"cannot write {path}: {e}. The previous checkpoint is intact"


def check_writable(folder: Path, expected_bytes: int = 0) -> None:
    """At start-up: ``folder`` exists and takes a file (not first discovered at the first save, hours
    later); a warning when its free space is under twice ``expected_bytes`` (one checkpoint)."""
    probe = Path(folder) / f".write-test-{os.getpid()}"
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        from .fields import ConfigError

        raise ConfigError(describe_write_error(probe, e).replace(str(probe), str(folder))) from None
    free = shutil.disk_usage(folder).free
    if expected_bytes and free < 2 * expected_bytes:
        log.warning("%s has %.1f GB free; one checkpoint takes about %.1f GB: the next saves may fail",
                    folder, free / 1e9, expected_bytes / 1e9)


class Checkpointer:
    def __init__(self, root: Path, keep_last: int = 2, keep_every: int | None = None):
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_every = keep_every

    def latest(self) -> Path | None:
        steps = complete_steps(self.root)
        return self.root / step_dir_name(steps[-1]) if steps else None

    def save(
        self, step: int, shared: dict, per_rank: dict, train_state: dict, config_yaml: str, rank: int,
        write_sharded=None,
    ) -> Path:
        """Collective: every rank calls it. Returns the final folder.

        ``write_sharded(folder)``, when given, is called on every rank to write sharded state (FSDP: DCP).
        """
        t0 = time.time()
        final = self.root / step_dir_name(step)
        tmp = self.root / (step_dir_name(step) + ".tmp")
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        distributed.barrier()  # the folder exists before any rank writes into it
        _atomic_torch_save(per_rank, tmp / f"rank_{rank}.pt")
        if write_sharded is not None:
            write_sharded(tmp / "sharded")
        if rank == 0:
            for name, obj in shared.items():
                _atomic_torch_save(obj, tmp / f"{name}.pt")
            # The files a loader may open: nothing else in the folder is ever read.
            (tmp / "train_state.json").write_text(json.dumps({**train_state, "checkpoint_files": sorted(shared)}, indent=1))
            (tmp / "config.yaml").write_text(config_yaml)
        distributed.barrier()  # every rank's file is on disk before the folder is declared complete
        if rank == 0:
            (tmp / MARKER).write_text(f"{time.time()}\n")
            if final.exists():  # a stale folder of the same step (e.g. written before a crash, then trained again)
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._retain()
            log.info("saved checkpoint %s in %.1fs", final, time.time() - t0)
        distributed.barrier()
        return final

    def _retain(self) -> None:
        steps = complete_steps(self.root)
        keep = set(steps[-self.keep_last :]) if self.keep_last > 0 else set(steps[-1:])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                shutil.rmtree(self.root / step_dir_name(s), ignore_errors=True)
        for d in self.root.glob("*.tmp"):  # leftovers of a save that was killed
            shutil.rmtree(d, ignore_errors=True)

    @staticmethod
    def load(path: Path, rank: int, map_location="cpu") -> tuple[dict, dict, dict]:
        """(shared objects by name, this rank's state, train_state) of a complete checkpoint."""
        path = Path(path)
        if not (path / MARKER).exists():
            raise RuntimeError(f"checkpoint {path} is incomplete (no {MARKER} marker)")
        train_state = json.loads((path / "train_state.json").read_text())
        names = train_state.pop("checkpoint_files", None)
        if names is None:  # written before the list existed
            names = sorted(p.stem for p in path.glob("*.pt") if not p.name.startswith("rank_"))
        # weights_only: tensors and plain containers only; a pickle that would run code is refused.
        shared = {n: _load_weights_only(path / f"{n}.pt", map_location) for n in names}
        rank_file = path / f"rank_{rank}.pt"
        if not rank_file.exists():
            raise RuntimeError(
                f"{rank_file} is missing: the checkpoint was written by fewer ranks than this run has; "
                "resume with the same world size"
            )
        per_rank = _load_weights_only(rank_file, map_location)
        return shared, per_rank, train_state


def _load_weights_only(path: Path, map_location) -> dict:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise RuntimeError(
            f"{path} holds objects other than tensors and plain containers, which this trainer does not load "
            f"(torch.load weights_only=True refused it: {str(e).splitlines()[0]}). Checkpoints written by "
            "sd-training never do; do not resume from a folder you do not trust"
        ) from None
