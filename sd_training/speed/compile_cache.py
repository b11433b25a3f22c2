"""The compiler's cache kept where a requeued job finds it (``model.compile_cache``, else the run folder's
``compile_cache/``): torch's portable cache artifacts ("mega-cache", torch >= 2.7:
``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``), i.e. what inductor, AOTAutograd and the
autotuner produced for this run's graphs (on CUDA the Triton kernels' binaries too).

Loaded at start-up, before anything compiles: a requeued job (a fresh machine, an empty
``/tmp/torchinductor_*``) then finds every graph's compiled code in the cache and skips inductor's
lowering, code generation and kernel builds; dynamo still traces the Python (seconds). Saved by rank 0
once the first optimizer step has run (its forward and backward are compiled by then), in one file per
torch version and device kind, written atomically (jobs sharing a folder never read half a file).

Where torch lacks the API, or the file cannot be read, nothing is loaded and the run compiles as usual
(logged); a failed save is logged, never fatal."""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from ..outputs.file_modes import share_file

log = logging.getLogger(__name__)

FOLDER = "compile_cache"


def supported() -> bool:
    """Whether this torch has the portable cache artifacts (torch >= 2.7)."""
    c = getattr(torch, "compiler", None)
    return hasattr(c, "save_cache_artifacts") and hasattr(c, "load_cache_artifacts")


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def artifact_file(folder: str | os.PathLike, device: torch.device) -> Path:
    """One file per torch version and device kind: another GPU or torch finds none (its kernels differ)."""
    name = f"torch-{torch.__version__}-{device_kind(device)}"
    return Path(folder) / (re.sub(r"[^A-Za-z0-9.+-]+", "_", name) + ".bin")


class CompileCache:
    """The cache artifacts of one run: :meth:`load` before compiling, :meth:`save` after the first step."""

    def __init__(self, folder: str | os.PathLike, device: torch.device, save: bool = True):
        self.path = artifact_file(folder, device)
        self.may_save = save  # rank 0 only: every rank compiles the same graphs
        self.loaded: dict[str, int] = {}  # kind -> entries loaded (inductor, aot_autograd, autotune ...)
        self.load_s: float | None = None
        self.saved_bytes = 0
        self._hook = None

    def load(self) -> bool:
        """Put the saved artifacts into torch's caches; False when there is nothing to load (or no API)."""
        if not supported():
            log.info("model.compile: torch %s has no portable compile cache (torch >= 2.7): compiling from scratch",
                     torch.__version__)
            return False
        if not self.path.is_file():
            log.info("model.compile: no compile cache at %s yet: compiling from scratch (saved after the first step)",
                     self.path)
            return False
        t0 = time.perf_counter()
        try:
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
        except Exception as e:  # a file of another torch build, cut short ...: compile as usual
            log.warning("model.compile: the compile cache %s could not be loaded (%s: %s): compiling from scratch",
                        self.path, type(e).__name__, str(e)[:200])
            return False
        if info is None:  # torch read nothing (it logged why: e.g. a file cut short or of another torch)
            log.warning("model.compile: the compile cache %s could not be loaded (see torch's warning): compiling "
                        "from scratch", self.path)
            return False
        self.load_s = time.perf_counter() - t0
        self.loaded = {kind: len(keys) for kind, keys in (getattr(info, "artifacts", None) or {}).items()}
        log.info("model.compile: loaded the compile cache %s (%s) in %.1f s", self.path,
                 ", ".join(f"{n} {k}" for k, n in self.loaded.items()) or "no entries", self.load_s)
        return True

    def save(self) -> bool:
        """Write this process's cache artifacts (all graphs compiled or loaded so far); False if none."""
        if not (self.may_save and supported()):
            return False
        try:
            out = torch.compiler.save_cache_artifacts()
            if not out or not out[0]:
                return False
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
            share_file(tmp)  # mkstemp makes it 0600: the umask's mode, as the run's other files
            with os.fdopen(fd, "wb") as fh:
                fh.write(out[0])
            os.replace(tmp, self.path)
        except Exception as e:
            log.warning("model.compile: could not save the compile cache to %s (%s: %s)", self.path,
                        type(e).__name__, str(e)[:200])
            return False
        self.saved_bytes = len(out[0])
        log.info("model.compile: saved the compile cache (%.1f MB) to %s", self.saved_bytes / 2**20, self.path)
        return True

    def save_after_first_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Save once the first optimizer step has run (a step post-hook, idle after its first call: removing
        itself while the optimizer iterates over its hooks would break that iteration when others follow)."""
        if not self.may_save:
            return
        done = []

        def hook(*_):
            if not done:
                done.append(True)
                self.save()

        self._hook = optimizer.register_step_post_hook(hook)


def for_run(configured: str | None, run_root: str | os.PathLike, device: torch.device, is_main: bool) -> CompileCache:
    """``model.compile_cache`` (a folder shared by jobs) or the run folder's ``compile_cache/``."""
    return CompileCache(configured or Path(run_root) / FOLDER, device, save=is_main)
