"""The checkpoint folder format: zero-padded step folders (names in ``layout``), written under a
temporary name, marked complete, renamed; kept or deleted by the retention settings; read back.

The checkpointer sees a dict of objects with ``state_dict()`` / ``load_state_dict()``. Rank 0 writes the
shared state (replicated under DDP); every rank writes its own ``rank_<R>.pt``. A SIGKILL at any moment
leaves at most a ``*.tmp`` folder, which is ignored and cleaned up, never a half-written step folder.

Asynchronous saves (``experiment.checkpoint_async``): the step waits only while the state is copied to
host memory (pinned buffers reused from save to save); a background thread writes the files. Rank 0's
thread declares the folder complete once every rank's ``rank_<R>.pt`` is on disk (it watches the
folder, so no collective runs outside the training thread). One save is in flight at a time; the loop
waits for it before the next save, before a requeue and at the end. Sharded (FSDP) state goes through
DCP's ``async_save`` (staged before it returns); a rank's file is written once its shards are on disk.

Verified before trusted: each rank records the size and CRC32 of every file it wrote (its rank file, its
DCP shards, and on rank 0 the shared files) in ``manifest_rank_<R>.json``, hashed where the bytes were
written (in the writer thread when asynchronous, never in the training step); rank 0 merges them into the
``COMPLETE`` marker. :func:`verify` checks a folder against its marker; :meth:`Checkpointer.load` and
:meth:`Checkpointer.rank_states` name the file of any problem (:class:`CheckpointDamaged`). Checksum cost
(``zlib.crc32``, 1 MiB reads of a file in the page cache, measured on a 2-core VM): about 0.4-0.5 s per GB
and core (2.0-2.6 GB/s; sha256 1.25 GB/s, blake2b 0.55 GB/s, adler32 no faster); a rank hashes up to 4 of
its files at once (crc32 releases the GIL), each as soon as it is written. ``experiment.checkpoint_verify:
sizes`` records and checks sizes only (a stat: no cost).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .. import distributed
from ..config import ConfigError
from ..run.run_dir import STEP_RE, step_name
from .integrity import (
    CHECKSUM,
    MARKER_FORMAT,
    CheckpointDamaged,
    file_record,
    read_marker,
    read_train_state,
    sizes_intact,
)
from .layout import (
    CONFIG,
    MANIFEST_PREFIX,
    MARKER,
    RANK_DATA,
    RANK_RNG,
    SHARDED,
    TRAIN_STATE,
    dcp_files,
    manifest_file,
    member_path,
    plain_name,
    rank_file,
    rank_files,
    rank_of,
    shared_file,
)

log = logging.getLogger(__name__)

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
        raise ConfigError(describe_write_error(probe, e).replace(str(probe), str(folder))) from None
    free = shutil.disk_usage(folder).free
    if expected_bytes and free < 2 * expected_bytes:
        log.warning("%s has %.1f GB free; one checkpoint takes about %.1f GB: the next saves may fail",
                    folder, free / 1e9, expected_bytes / 1e9)


class Snapshot:
    """Host copies of a nested state (dicts, lists, tuples of tensors and plain values) that training may
    go on changing. Device tensors land in pinned buffers kept for the next snapshot of the same shapes;
    their copies are asynchronous, and :meth:`ready` waits for them (in the writer, not the step)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._event = None  # recorded after the device-to-host copies of the last snapshot, if any
        self._reserving: threading.Thread | None = None

    @staticmethod
    def staged(t: torch.Tensor) -> bool:
        """Whether ``t`` is copied into a kept host buffer (a device tensor) rather than cloned."""
        return t.device.type != "cpu"

    @staticmethod
    def new_buffer(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)

    def _buffer(self, t: torch.Tensor, key: str) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.new_buffer(t)
            self._buffers[key] = buf
        return buf

    def reserve(self, obj) -> None:
        """Allocate the buffers a later :meth:`take` of a state shaped like ``obj`` uses, copying nothing.
        Pinning host memory is slow (seconds per 10 GB), so doing it here, in a thread while training goes
        on, keeps it out of the first save's stall."""
        if isinstance(obj, torch.Tensor):
            if self.staged(obj):
                self._buffer(obj, "")
            return
        self._walk(obj, "")

    def _walk(self, obj, key: str) -> None:
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
        for k, v in items:
            if isinstance(v, torch.Tensor):
                if self.staged(v):
                    self._buffer(v.detach(), f"{key}/{k}")
            else:
                self._walk(v, f"{key}/{k}")

    def reserve_in_background(self, obj) -> None:
        self._reserving = threading.Thread(target=self.reserve, args=(obj,), name="checkpoint-staging", daemon=True)
        self._reserving.start()

    def wait_reserved(self) -> float:
        """Seconds spent waiting for a background :meth:`reserve` to finish (0 when none is running)."""
        if self._reserving is None:
            return 0.0
        t0 = time.perf_counter()
        self._reserving.join()
        self._reserving = None
        return time.perf_counter() - t0

    def take(self, obj):
        self.wait_reserved()  # the buffers' allocation, if still going, finishes first
        self._event = None
        self._device_copies = False
        out = self._copy(obj, "")
        if self._device_copies:
            self._event = torch.cuda.Event()
            self._event.record()
        return out

    def ready(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def _copy(self, obj, key: str):
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if not self.staged(t):
                return t.clone()
            buf = self._buffer(t, key)
            buf.copy_(t, non_blocking=True)
            self._device_copies = self._device_copies or t.is_cuda  # ready() waits on a CUDA event
            return buf
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{key}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{key}/{i}") for i, v in enumerate(obj)]
            return type(obj)(items) if type(obj) in (list, tuple) else type(obj)(*items)
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        import copy

        return copy.deepcopy(obj)


class _FileRecords:
    """Records of the files one rank writes into a checkpoint folder, each hashed in a small pool as soon
    as it is written (while the next one is being written)."""

    def __init__(self, folder: Path, checksum: bool):
        self.folder, self.checksum = Path(folder), checksum
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="checkpoint-hash")
        self._futures = {}

    def add(self, path: Path) -> None:
        name = Path(path).relative_to(self.folder).as_posix()
        self._futures[name] = self._pool.submit(file_record, Path(path), self.checksum)

    def result(self) -> dict:
        out = {}
        for name, future in sorted(self._futures.items()):
            try:
                out[name] = future.result()
            except OSError as e:
                raise CheckpointWriteError(describe_write_error(self.folder / name, e)) from e
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _write_manifest(folder: Path, rank: int, records: dict) -> None:
    """This rank's files are all on disk: their records, written atomically (rank 0 waits for them)."""
    path = manifest_file(folder, rank)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as fh:
        json.dump({"rank": rank, "files": records}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Checkpointer:
    def __init__(self, root: Path, keep_last: int = 2, keep_every: int | None = None, asynchronous: bool = False,
                 rank_files_timeout_s: float = 1800.0, checksum: bool = True):
        """``checksum``: record each file's CRC32 besides its size (``experiment.checkpoint_verify: full``)."""
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.asynchronous = asynchronous
        self.rank_files_timeout_s = rank_files_timeout_s
        self.checksum = checksum
        self.last_stall_s = 0.0  # how long the last save held the training thread
        self._snapshot = Snapshot()
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def reserve(self, shared: dict, per_rank: dict) -> None:
        """Asynchronous saves: allocate, in a background thread, the host buffers that a save of a state
        shaped like this one will copy into (:meth:`Snapshot.reserve`); no-op for synchronous saves."""
        if self.asynchronous:
            self._snapshot.reserve_in_background({"shared": shared, "rank": per_rank})

    def wait_reserved(self) -> float:
        """Seconds the caller waited for the staging buffers' background allocation (a benchmark's way to
        time saves the way a run at checkpoint_every >> the allocation's seconds sees them)."""
        return self._snapshot.wait_reserved()

    def latest(self) -> Path | None:
        steps = complete_steps(self.root)
        return self.root / step_name(steps[-1]) if steps else None

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; re-raise its error here, in the training thread."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def save(
        self, step: int, shared: dict, per_rank: dict, train_state: dict, config_yaml: str, rank: int,
        write_sharded=None,
    ) -> Path:
        """Collective: every rank calls it. Returns the final folder (complete on return unless asynchronous;
        then :meth:`wait` says when).

        ``write_sharded(folder)``, when given, is called on every rank to write sharded state (FSDP: DCP).
        Asynchronous, it returns a future (DCP's ``async_save``: staged on return, written in the background);
        this rank's file is written only once the future is done, so rank 0 completes the folder after
        every rank's shards are on disk.
        """
        t0 = time.perf_counter()
        self.wait()  # one save at a time: the previous one is complete (or its error raised) first
        final = self.root / step_name(step)
        tmp = self.root / (step_name(step) + ".tmp")
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        distributed.barrier()  # the folder exists before any rank writes into it
        state_json = json.dumps({**train_state, "checkpoint_files": sorted(shared)}, indent=1)
        world = distributed.world_size()
        if not self.asynchronous:
            records = _FileRecords(tmp, self.checksum)
            try:
                _atomic_torch_save(per_rank, rank_file(tmp, rank))
                records.add(rank_file(tmp, rank))
                if write_sharded is not None:
                    write_sharded(tmp / SHARDED)
                    for path in dcp_files(tmp / SHARDED, rank):
                        records.add(path)
                if rank == 0:
                    self._write_shared(tmp, shared, state_json, config_yaml, records)
                _write_manifest(tmp, rank, records.result())
            finally:
                records.close()
            distributed.barrier()  # every rank's files are on disk before the folder is declared complete
            if rank == 0:
                self._complete(tmp, final, world)
                log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - t0)
            distributed.barrier()
            self.last_stall_s = time.perf_counter() - t0
            return final
        sharded = write_sharded(tmp / SHARDED) if write_sharded is not None else None  # a future
        both = self._snapshot.take({"shared": shared if rank == 0 else {}, "rank": per_rank})
        shared_copy, rank_copy = both["shared"], both["rank"]
        self._writer = threading.Thread(
            target=self._write_async, name=f"checkpoint-{step}",
            args=(tmp, final, rank, world, shared_copy, rank_copy, state_json, config_yaml, t0, sharded),
        )
        self._writer.start()
        self.last_stall_s = time.perf_counter() - t0
        return final

    def _write_shared(self, tmp: Path, shared: dict, state_json: str, config_yaml: str, records: _FileRecords) -> None:
        for name, obj in shared.items():
            _atomic_torch_save(obj, shared_file(tmp, name))
            records.add(shared_file(tmp, name))
        # The files a loader may open: nothing else in the folder is ever read.
        (tmp / TRAIN_STATE).write_text(state_json)
        (tmp / CONFIG).write_text(config_yaml)
        records.add(tmp / TRAIN_STATE)
        records.add(tmp / CONFIG)

    def _complete(self, tmp: Path, final: Path, world: int) -> None:
        self._write_marker(tmp, world)
        if final.exists():  # a folder of the same step: written before a crash, or damaged, then trained again
            if sizes_intact(final):
                shutil.rmtree(final)
            else:  # a damaged one is kept, under another name
                aside = final.with_name(f"{final.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
                os.replace(final, aside)
                log.warning("the damaged checkpoint %s was moved to %s to make room for the new one of its step",
                            final, aside.name)
        os.replace(tmp, final)
        self._retain()

    def _write_marker(self, tmp: Path, world: int) -> None:
        """``COMPLETE``: every rank's records merged (their manifests then removed)."""
        files = {}
        for r in range(world):
            files.update(json.loads(manifest_file(tmp, r).read_text())["files"])
        # A file no rank recorded (another DCP version naming its files otherwise): its size at least.
        others = [p for p in [*tmp.iterdir(), *(tmp / SHARDED).glob("*")] if p.is_file()]
        for p in others:
            name = p.relative_to(tmp).as_posix()
            if name not in files and not name.startswith(MANIFEST_PREFIX) and member_path(name):
                files[name] = file_record(p, checksum=False)
        marker = {"format": MARKER_FORMAT, "time": time.time(), "checksum": CHECKSUM if self.checksum else None,
                  "ranks": world, "files": dict(sorted(files.items()))}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        for r in range(world):
            manifest_file(tmp, r).unlink()

    def _write_async(self, tmp: Path, final: Path, rank: int, world: int, shared: dict, per_rank: dict,
                     state_json: str, config_yaml: str, t0: float, sharded=None) -> None:
        records = _FileRecords(tmp, self.checksum)
        try:
            self._snapshot.ready()
            if sharded is not None:
                sharded.result()  # this rank's shards (and, on rank 0, DCP's metadata) are on disk
                for path in dcp_files(tmp / SHARDED, rank):
                    records.add(path)
            _atomic_torch_save(per_rank, rank_file(tmp, rank))
            records.add(rank_file(tmp, rank))
            if rank == 0:
                self._write_shared(tmp, shared, state_json, config_yaml, records)
            _write_manifest(tmp, rank, records.result())
            if rank != 0:
                return
            deadline = time.monotonic() + self.rank_files_timeout_s
            missing = [r for r in range(world) if not manifest_file(tmp, r).exists()]
            while missing:  # the other ranks' writers: their manifests appear complete (written, then renamed)
                if time.monotonic() > deadline:
                    raise CheckpointWriteError(
                        f"{tmp}: rank(s) {missing[:8]} did not finish writing their files within "
                        f"{self.rank_files_timeout_s:.0f}s; this checkpoint stays incomplete (ignored on resume); the "
                        "previous one is intact")
                time.sleep(0.05)
                missing = [r for r in missing if not manifest_file(tmp, r).exists()]
            self._complete(tmp, final, world)
            log.info("saved checkpoint %s in %.1fs (training waited %.3fs)", final, time.perf_counter() - t0,
                     self.last_stall_s)
        except BaseException as e:  # raised in the training thread at the next wait()
            self._error = e
        finally:
            records.close()

    def _retain(self) -> None:
        """Delete the intact checkpoints beyond ``keep_last`` (and not multiples of ``keep_every``). A damaged
        one (``DAMAGED``, or a file whose size is not the recorded one) is never deleted, nor counted as kept."""
        steps = complete_steps(self.root)
        intact = [s for s in steps if sizes_intact(self.root / step_name(s))]
        keep = set(intact[-self.keep_last :]) if self.keep_last > 0 else set(intact[-1:])
        if self.keep_every:
            keep |= {s for s in intact if s % self.keep_every == 0}
        for s in intact:
            if s not in keep:
                shutil.rmtree(self.root / step_name(s), ignore_errors=True)
        for d in self.root.glob("*.tmp"):  # leftovers of a save that was killed
            shutil.rmtree(d, ignore_errors=True)

    @staticmethod
    def load(path: Path, rank: int, map_location="cpu") -> tuple[dict, dict, dict]:
        """(shared objects by name, this rank's state or None if the checkpoint had fewer ranks, train_state)
        of a complete checkpoint. Every value is checked as it is read (the marker's records, train_state's
        values, the file list's names); a problem raises :class:`CheckpointDamaged` naming the file. The
        checksums are :func:`verify`'s."""
        path = Path(path)
        if not (path / MARKER).exists():
            raise RuntimeError(f"checkpoint {path} is incomplete (no {MARKER} marker)")
        marker = read_marker(path)
        train_state = read_train_state(path)
        names = train_state.pop("checkpoint_files", None)
        if names is None:  # written before the list existed
            names = sorted(p.stem for p in path.glob("*.pt") if p not in rank_files(path))
        elif not isinstance(names, list):
            raise CheckpointDamaged(path / TRAIN_STATE, f"has a checkpoint_files that is not a list: {str(names)[:100]}")
        for n in names:
            if not plain_name(n):
                raise CheckpointDamaged(path / TRAIN_STATE, f"lists {str(n)[:200]!r} in checkpoint_files, a path outside "
                                                           "the step folder (only plain file names are read)")
            if marker is not None and shared_file(path, n).name not in marker["files"]:
                raise CheckpointDamaged(path / TRAIN_STATE, f"lists {n!r} in checkpoint_files, which the COMPLETE "
                                                           "marker does not record")
        # weights_only: tensors and plain containers only; a pickle that would run code is refused.
        shared = {n: _load_weights_only(shared_file(path, n), map_location) for n in names}
        own = rank_file(path, rank)
        per_rank = _load_weights_only(own, map_location) if own.exists() else None
        return shared, per_rank, train_state

    @staticmethod
    def rank_states(path: Path, map_location="cpu") -> list[dict]:
        """Every rank's file of a complete checkpoint, in rank order (small: data positions and RNG
        states). A run on another number of ranks reads them all to take over the saved positions."""
        path = Path(path)
        files = rank_files(path)
        found = [rank_of(p) for p in files]
        if found != list(range(len(files))) or not files:
            gap = next(r for r in range(len(files) + 1) if r not in found)
            raise CheckpointDamaged(rank_file(path, gap), f"is missing (rank files found: {[p.name for p in files][:8]})")
        states = [_load_weights_only(p, map_location) for p in files]
        for p, state in zip(files, states):
            if not isinstance(state, dict) or RANK_RNG not in state or RANK_DATA not in state:
                raise CheckpointDamaged(p, f"holds no '{RANK_RNG}' and '{RANK_DATA}' states (found: "
                                           f"{sorted(state)[:8] if isinstance(state, dict) else type(state).__name__})")
        return states


def _load_weights_only(path: Path, map_location) -> dict:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointDamaged(
            path, f"holds objects other than tensors and plain containers, which this trainer does not load "
            f"(torch.load weights_only=True refused it: {str(e).splitlines()[0]}). Checkpoints written by "
            "sd-training never do; do not resume from a folder you do not trust"
        ) from None
    except FileNotFoundError:
        raise CheckpointDamaged(path, "is missing") from None
    except MemoryError:
        raise
    except Exception as e:  # a cut or garbled zip ("failed finding central directory"), an I/O error ...
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointDamaged(path, f"cannot be read (torch.load: {first}): cut short or garbled") from None
