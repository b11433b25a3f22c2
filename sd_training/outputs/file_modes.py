"""Files a run writes get the mode of the process's umask, as ``open()`` gives them (0644 under umask 022),
also those written through a temporary file: safetensors' ``save_file`` (under every diffusers
``save_pretrained`` and ``save_lora_weights``) and ``tempfile.mkstemp`` create theirs 0600, so exported
pipelines, LoRA, kohya and merged files could not be loaded by the group a cluster shares a run with.

:func:`share_file` after a temporary file is made, :func:`share_tree` over a folder once it is written
(an export: every file in it, any depth). Links are never followed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``; else set and put back at once)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def file_mode(mask: int | None = None) -> int:
    """The mode ``open()`` gives a new file: 0o666 less the umask."""
    return 0o666 & ~(umask() if mask is None else mask)


def share_file(path: str | Path, mask: int | None = None) -> None:
    """``path`` (a regular file, not a link) gets :func:`file_mode`."""
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != file_mode(mask):
        os.chmod(path, file_mode(mask))


def share_tree(root: str | Path) -> None:
    """Every regular file under ``root`` gets :func:`file_mode` and every folder ``0o777`` less the umask
    (``mkdtemp`` makes them 0700); links are left alone. The umask is read once."""
    mask = umask()
    dir_mode = 0o777 & ~mask
    for folder, dirs, files in os.walk(root):
        if stat.S_IMODE(os.lstat(folder).st_mode) != dir_mode:
            os.chmod(folder, dir_mode)
        for name in files:
            share_file(os.path.join(folder, name), mask)
