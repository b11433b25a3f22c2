"""The run folder: every name in it is spelled here, and what protects it (one run at a time, no new run
on top of an old one, every step logged once after a resume).

    <log_dir>/<name>/
      config.yaml               resolved config (re-run with config=<this file>)
      metrics.jsonl             one JSON object per log interval (always written)
      train.log                 rank 0's log; logs/rank_<N>.log for the other ranks
      checkpoints/step_<N>/     resume state (see sd_training.checkpoint)
      current_pipeline/         newest exported diffusers pipeline (raw weights)
      current_pipeline_ema/     the same with EMA weights (model.use_ema=True)
      pipelines/step_<N>[_ema]/ every export, when experiment.save_only_most_recent=False
      samples/step_<N>.png      sample grid of each export
      report.html               the run report (experiment.report): summary, plots, sample grids over time;
                                one self-contained file, refreshed at every export
      report/                   the report's plots as PNGs (report/<panel>.png)
      eval/step_<N>/            eval images of each export; eval/results/ their FID / CLIP scores
      tensorboard/              event files (experiment.tensorboard)
      wandb/                    wandb's files (offline runs sync from here)
      sources.json              where the trained and frozen components came from
      memory_plan.json          per-device bytes of the modules under the run's strategy
      sample_keys/rank_<N>.jsonl  the samples of every step (experiment.record_sample_keys)
      .lock                     held by the running job

The guards (rank 0):

* :meth:`RunDir.lock`: a POSIX record lock (``fcntl.lockf``) on ``.lock``, the holder's host and pid
  written inside. The kernel releases it when the process dies (no stale locks after a kill -9), and
  unlike ``flock`` it belongs to the process, not to the open file: a forked child (a loader worker
  that outlives a killed rank) never holds it. A start after a holder that died says so in the log
  (:attr:`RunDir.took_over`); a clean end empties the file.
* :meth:`RunDir.refuse_or_move_aside`: a folder that already holds checkpoints is refused unless the run
  resumes it (``experiment.resume``) or the user asks for a fresh start (``experiment.start_fresh``),
  which moves the old contents aside; nothing is deleted.
* :meth:`RunDir.cut_metrics_back`: after a resume at step S, rows past S (logged after the checkpoint by
  the run that was killed) are dropped, so every step is logged once.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from ..config import ConfigError
from ..outputs.readers import loads

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
STEP_RE = re.compile(r"^step_(\d{8,})$")
GRID_RE = re.compile(r"^step_(\d{8,})(.*)\.png$")  # samples/step_<N><suffix>.png


def step_name(step: int) -> str:
    """The name of everything a step writes: ``step_00001000`` (checkpoints, pipelines, samples, eval)."""
    return f"step_{step:08d}"


class RunFolderInUse(ConfigError):
    pass


class SampleKeys(NamedTuple):
    """An open ``sample_keys/rank_<r>.jsonl`` and what each of its lines says of the process writing it."""

    file: Any
    attempt: dict

    def write(self, step: int, keys: list) -> None:
        self.file.write(json.dumps({"step": step, "keys": keys, **self.attempt}) + "\n")


class RunDir:
    def __init__(self, log_dir: str, name: str):
        self.root = Path(log_dir) / name
        self.took_over: str | None = None  # the holder written in .lock by a run that died holding it

    @classmethod
    def at(cls, root: str | Path) -> "RunDir":
        """The run folder at ``root`` (another run's, e.g. for model.init_from)."""
        return cls(str(Path(root).parent), Path(root).name)

    # -- files and folders ----------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def sources(self) -> Path:
        return self.root / "sources.json"

    @property
    def memory_plan(self) -> Path:
        return self.root / "memory_plan.json"

    @property
    def quantized_base(self) -> Path:
        """model.adapter.base_quantization: the quantised base layers, reloaded by a requeued job."""
        return self.root / "quantized_base"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def pipelines(self) -> Path:
        return self.root / "pipelines"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def report_html(self) -> Path:
        return self.root / "report.html"

    @property
    def report_assets(self) -> Path:
        return self.root / "report"

    @property
    def eval_results(self) -> Path:
        return self.root / "eval" / "results"

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK_NAME

    def log_file(self, rank: int) -> Path:
        return self.root / "train.log" if rank == 0 else self.root / "logs" / f"rank_{rank}.log"

    def sample_keys(self, rank: int) -> Path:
        return self.root / "sample_keys" / f"rank_{rank}.jsonl"

    def open_sample_keys(self, rank: int, world_size: int, start_step: int) -> SampleKeys:
        """``experiment.record_sample_keys``: this rank's log of the keys each step trained on (appended to)."""
        path = self.sample_keys(rank)
        path.parent.mkdir(exist_ok=True)
        # Which process wrote a line: a step written twice (killed after it, before its checkpoint) is the
        # later attempt's, the one that started from the newer checkpoint.
        return SampleKeys(open(path, "a", buffering=1),  # noqa: SIM115 (a line per step; closed by the loop)
                          {"rank": rank, "world_size": world_size, "start_step": start_step, "started": time.time()})

    def pipeline(self, step: int | None, ema: bool = False) -> Path:
        suffix = "_ema" if ema else ""
        if step is None:
            return self.root / f"current_pipeline{suffix}"
        return self.pipelines / f"{step_name(step)}{suffix}"

    def sample_grid(self, step: int, suffix: str = "") -> Path:
        return self.samples / f"{step_name(step)}{suffix}.png"

    def sample_grids(self) -> list[tuple[int, str, Path]]:
        """The sample grids written so far as (step, suffix, path), by step (suffix: '' for the main weights,
        '_raw' / '_ema' for the second of experiment.sample_from=both)."""
        if not self.samples.is_dir():
            return []
        found = [(int(m.group(1)), m.group(2), p) for p in self.samples.iterdir() if (m := GRID_RE.match(p.name))]
        return sorted(found, key=lambda t: (t[0], t[1]))

    def eval_images(self, step: int) -> Path:
        return self.root / "eval" / step_name(step)

    def create(self) -> None:
        for d in (self.root, self.checkpoints, self.samples, self.root / "logs"):
            d.mkdir(parents=True, exist_ok=True)

    def setup_logging(self, rank: int) -> None:
        """Console (rank 0 only, at INFO) plus one log file per rank."""
        path = self.log_file(rank)
        fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        root = logging.getLogger()
        for h in list(root.handlers):
            if getattr(h, "_sd_training", False):
                root.removeHandler(h)
                h.close()
        handlers = [logging.FileHandler(path)]
        if rank == 0:
            handlers.append(logging.StreamHandler(sys.stdout))
        for h in handlers:
            h.setFormatter(fmt)
            h._sd_training = True
            root.addHandler(h)
        root.setLevel(logging.INFO)
        if self.took_over:  # rank 0's lock (RunDir.lock), now that there is a log to say it in
            log.warning("run folder lock: its last holder (%s) ended without releasing it (killed?); taken over",
                        self.took_over)
            self.took_over = None

    # -- guards (rank 0) ------------------------------------------------------------------------
    def lock(self):
        """Hold the run folder's lock for the life of this process; returns the open file (give it to
        :func:`release_run_folder` at the end). ``took_over``: the previous holder if it died holding it."""
        fh = lock_run_folder(self.root)
        self.took_over = getattr(fh, "took_over", None)
        return fh

    def refuse_or_move_aside(self, checkpoint_steps: list[int], resume: bool, start_fresh: bool) -> Path | None:
        # Step folders without their marker count too: a new run must not train over them, and
        # start_fresh moves them aside with the rest.
        steps = sorted(set(checkpoint_steps) | set(step_folders(self.checkpoints)))
        return prepare_fresh_start(self.root, steps, resume, start_fresh)

    def cut_metrics_back(self, step: int) -> int:
        return cut_metrics_back(self.metrics, step)

    def repair_exports(self) -> list[Path]:
        """Exports a kill interrupted while one replaced the other: the previous one is put back."""
        return repair_swaps(self.root, self.pipelines)


class _LockFile:
    """The open ``.lock`` file (its lock lives as long as it is open in this process)."""

    def __init__(self, fh, took_over: str | None):
        self.fh, self.took_over = fh, took_over

    def fileno(self) -> int:
        return self.fh.fileno()

    def close(self) -> None:
        self.fh.close()

    @property
    def closed(self) -> bool:
        return self.fh.closed


def lock_run_folder(root: Path) -> _LockFile:
    """Hold an exclusive lock on the run folder for the life of this process; returns the open file.

    ``fcntl.lockf`` (a POSIX record lock, ``F_SETLK``): released by the kernel when this process dies and
    never inherited by forked children, so an orphaned loader worker cannot keep the folder locked (an
    ``flock`` is shared with every child that inherited the descriptor). One caveat of POSIX locks: any
    descriptor of ``.lock`` this process closes drops the lock, so nothing else here opens the file."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    fh = open(path, "a+")  # noqa: SIM115 (held open, locked, for the life of the run)
    try:
        fcntl.lockf(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise RunFolderInUse(
            f"run folder {root} is in use by {holder}. Two runs in one folder would delete each other's "
            "checkpoints: wait for it to end (or stop it), or set another experiment.name"
        ) from None
    fh.seek(0)
    previous = fh.read().strip() or None  # written by a holder that died without releasing (a clean end empties it)
    fh.seek(0)
    fh.truncate()
    fh.write(f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    fh.flush()
    return _LockFile(fh, previous)


def release_run_folder(lock) -> None:
    """The run's clean end: the holder line is removed and the lock released (closing releases it)."""
    if lock is None or lock.closed:
        return
    try:
        os.ftruncate(lock.fileno(), 0)
    except OSError:
        pass
    lock.close()


def step_folders(root: Path) -> list[int]:
    """Steps of every ``step_<N>`` folder under ``root`` (complete or not; not ``*.tmp`` staging ones)."""
    if not Path(root).is_dir():
        return []
    return sorted(int(m.group(1)) for d in Path(root).iterdir() if (m := STEP_RE.match(d.name)) and d.is_dir())


def prepare_fresh_start(root: Path, checkpoint_steps: list[int], resume: bool, start_fresh: bool) -> Path | None:
    """Refuse to train a new run on top of an old one; with ``start_fresh`` move the old one aside.

    Returns the folder the old contents were moved to, or None."""
    if not checkpoint_steps or (resume and not start_fresh):
        return None
    if not start_fresh:
        raise ConfigError(
            f"run folder {root} holds checkpoints of an earlier run (steps {checkpoint_steps[0]}..{checkpoint_steps[-1]}) "
            "and experiment.resume=false: a new run there would mix its metrics and samples with the old ones "
            "and its checkpoint retention would delete the old run's. Set experiment.resume=true to continue it, "
            "another experiment.name, or experiment.start_fresh=true to move the old contents aside and start over"
        )
    aside = root.with_name(f"{root.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    aside.mkdir()
    for entry in root.iterdir():
        if entry.name != LOCK_NAME:
            os.replace(entry, aside / entry.name)
    log.warning("experiment.start_fresh: the earlier run's files were moved to %s", aside)
    return aside


def cut_metrics_back(path: Path, step: int) -> int:
    """Drop metric rows logged after ``step`` (by the run that was killed after its last checkpoint);
    returns how many were dropped. Written to a temporary file, then renamed."""
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = loads(line, "a metrics.jsonl line")  # bounded: a line nested 100,000 deep is refused, not recursed
        except ValueError:  # a line cut by the kill (or one no run wrote)
            dropped += 1
            continue
        row_step = row.get("step", 0) if isinstance(row, dict) else 0
        if not isinstance(row_step, (int, float)) or row_step > step:
            dropped += 1
        else:
            keep.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
        log.info("metrics.jsonl: %d row(s) logged after step %d by the interrupted run removed", dropped, step)
    return dropped


def repair_swaps(*folders: Path) -> list[Path]:
    """Finish what a kill between the two renames of :func:`replace_dir` left: ``X.old`` without ``X``
    goes back to ``X`` (the previous complete export); ``X.old`` beside a complete ``X`` is removed."""
    restored = []
    for folder in folders:
        if not Path(folder).is_dir():
            continue
        for old in Path(folder).glob("*.old"):
            final = old.with_name(old.name[: -len(".old")])
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, final)
                restored.append(final)
    return restored


def copy_dir_atomically(src: Path, final: Path) -> None:
    """A copy of ``src`` at ``final`` that a kill leaves either complete or absent (never half-written)."""
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, tmp)
    replace_dir(tmp, final)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a fully written folder into place; the old one is removed only after the new one exists.
    A kill between the two renames leaves ``final.old``, which :func:`repair_swaps` puts back."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
