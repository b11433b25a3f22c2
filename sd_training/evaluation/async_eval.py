"""Evaluation in a background process, so training does not stall while FID / CLIP are computed.

The trainer's rank 0 owns one ``AsyncEvaluator``. ``submit(step, ...)`` starts
``python -m sd_training.evaluation`` as a subprocess (a fresh interpreter: no forked CUDA context, no
inherited process group; it dies with the trainer, ``preemption.die_with_parent``) and returns at once; ``poll()``, called at each log interval, returns the
results that have finished since, each with the step it belongs to; ``wait()`` at the end of the run
collects the rest. Only ``max_running`` evaluations run at once; later submissions queue (oldest first).

    <out_dir>/step_<N>.json       the result ({"step": N, "eval/fid": ..., ...}), written atomically
    <out_dir>/step_<N>.log        the subprocess's output
    <out_dir>/step_<N>_pipeline/  a hard-linked snapshot of the submitted pipeline (removed when done)

Hard links make the snapshot free and safe: an export writes a new folder and renames it into place,
it never rewrites a file, so the linked files keep the weights of the submitted step.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ..outputs.readers import read_json
from ..run.run_dir import step_name
from .evaluate import EvalSettings

log = logging.getLogger(__name__)

# Variables that make a child think it is one rank of the parent's job (torchrun, srun).
_RANK_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
)


# ``python -m sd_training.evaluation ARGS`` whose first argument is the trainer's pid, which it dies with.
_DIES_WITH_PARENT = (
    "import signal, sys; from sd_training.run.preemption import die_with_parent; "
    "die_with_parent(int(sys.argv.pop(1)), signal.SIGTERM); from sd_training.evaluation.__main__ import main; main()"
)


def settings_args(s: EvalSettings) -> list[str]:
    """The command-line arguments of ``python -m sd_training.evaluation`` for these settings."""
    pairs = [
        ("--prompts", s.prompts), ("--ref-stats", s.ref_stats), ("--ref-images", s.ref_images),
        ("--ref-max-images", s.ref_max_images), ("--clip-model", s.clip_model),
        ("--clip-pretrained", s.clip_pretrained), ("--clip-config", s.clip_config), ("--device", s.device),
        ("--batch-size", s.batch_size),
    ]
    return [x for k, v in pairs if v is not None for x in (k, str(v))]


def _snapshot(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)

    def link(a, b):
        try:
            os.link(a, b)
        except OSError:  # another file system, or links not allowed: copy
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)
    return dst


@dataclass
class _Job:
    step: int
    cmd: list[str]
    result: Path
    log: Path
    cleanup: list[Path] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    log_file: object = None


class AsyncEvaluator:
    """Background evaluations of exported pipelines or eval-image folders, one result JSON per step."""

    def __init__(
        self, out_dir: str | os.PathLike, settings: EvalSettings, generation_args: list[str] | None = None,
        threads: int | None = None, max_running: int = 1, python: str = sys.executable,
    ):
        """``generation_args``: extra CLI arguments for pipelines (``--num-images``, ``--resolution`` ...);
        ``threads``: torch CPU threads of the subprocess (keep it small beside a CPU training run)."""
        self.out_dir = Path(out_dir)
        self.settings = settings
        self.generation_args = list(generation_args or [])
        self.threads = threads
        self.max_running = max_running
        self.python = python
        self.queue: deque[_Job] = deque()
        self.running: list[_Job] = []

    def submit(self, step: int, pipeline: str | os.PathLike | None = None, images: str | os.PathLike | None = None) -> Path:
        """Evaluate ``pipeline`` (generate, then score) or an ``images`` folder for ``step``; returns the
        result path. Returns at once: the work runs in a subprocess."""
        if (pipeline is None) == (images is None):
            raise ValueError("submit: give exactly one of pipeline= or images=")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        name = step_name(step)
        result = self.out_dir / f"{name}.json"
        result.unlink(missing_ok=True)
        # ``python -m sd_training.evaluation``, started so that it dies with this process (SIGTERM when
        # the trainer dies, even by SIGKILL): an orphaned evaluation would hold a GPU a restart needs.
        cmd = [self.python, "-c", _DIES_WITH_PARENT, str(os.getpid()), "--out", str(result), "--step", str(step)]
        cleanup = []
        if pipeline is not None:
            snap = _snapshot(Path(pipeline), self.out_dir / f"{name}_pipeline")
            cleanup.append(snap)
            cmd += ["--pipeline", str(snap), "--images", str(self.out_dir / f"{name}_images"), *self.generation_args]
        else:
            cmd += ["--images", str(images)]
        cmd += settings_args(self.settings)
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        self.queue.append(_Job(step, cmd, result, self.out_dir / f"{name}.log", cleanup))
        self._launch()
        return result

    def _launch(self) -> None:
        while self.queue and len(self.running) < self.max_running:
            job = self.queue.popleft()
            env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
            if self.threads:
                env["OMP_NUM_THREADS"] = str(self.threads)
            # Importable even when sd_training is not installed (run from a checkout).
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), env.get("PYTHONPATH")]))
            job.log_file = open(job.log, "w")
            job.proc = subprocess.Popen(job.cmd, stdout=job.log_file, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
            log.info("evaluation of step %d started in the background (pid %d, log %s)", job.step, job.proc.pid, job.log)
            self.running.append(job)

    def _finish(self, job: _Job) -> dict:
        job.log_file.close()
        for path in job.cleanup:
            shutil.rmtree(path, ignore_errors=True)
        if job.proc.returncode == 0 and job.result.is_file():
            try:
                result = read_json(job.result)  # bounded: the file sits in the run folder
            except ValueError as e:
                return {"step": job.step, "error": f"{job.result} cannot be read: {e}"}
            if isinstance(result, dict):
                return result
            return {"step": job.step, "error": f"{job.result} is not a JSON object"}
        log.warning("evaluation of step %d failed (exit %s); see %s", job.step, job.proc.returncode, job.log)
        return {"step": job.step, "error": f"exit {job.proc.returncode}, see {job.log}"}

    def poll(self) -> list[dict]:
        """Results finished since the last call (never blocks). Each has ``step`` and ``eval/*`` metrics,
        or ``error``."""
        done = [j for j in self.running if j.proc.poll() is not None]
        self.running = [j for j in self.running if j not in done]
        results = [self._finish(j) for j in done]
        self._launch()
        return results

    def wait(self, timeout: float | None = None) -> list[dict]:
        """Block until every submitted evaluation has finished (``timeout`` seconds each at most)."""
        results = []
        while self.running or self.queue:
            for job in list(self.running):
                try:
                    job.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning("evaluation of step %d still running after %ss: stopping it", job.step, timeout)
                    job.proc.kill()
                    job.proc.wait()
            results += self.poll()
        return results

    def close(self, timeout: float = 5.0) -> None:
        """Stop what is still running or queued (a run that stops early, preempted or failed): SIGTERM, and
        SIGKILL for what still runs ``timeout`` seconds later (all jobs together)."""
        self.queue.clear()
        running, self.running = self.running, []
        for job in running:
            job.proc.terminate()
        deadline = time.monotonic() + timeout
        for job in running:
            try:
                job.proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                job.proc.kill()
                job.proc.wait()
            try:
                self._finish(job)
            except (OSError, ValueError) as e:  # a half-written result or log: the job was stopped anyway
                log.warning("evaluation of step %d stopped: %s", job.step, e)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.queue)
