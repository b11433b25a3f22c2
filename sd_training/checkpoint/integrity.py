"""Whether a complete checkpoint folder can be trusted, checked before anything in it is loaded.

Each rank records the size and CRC32 of every file it wrote (:func:`file_record`) and rank 0 merges the
records into the ``COMPLETE`` marker (``store``). :func:`verify` checks a folder against its marker (the
ranks share the reading), :func:`read_marker` and :func:`read_train_state` check every value read back,
and :class:`CheckpointDamaged` names the first bad file and its problem. A damaged folder is left in place
with a ``DAMAGED`` note (:func:`mark_damaged`). Checksum cost: see ``store``'s docstring (about 0.4-0.5 s
per GB and core).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..run.run_dir import STEP_RE
from ..run.train_state import check_train_state
from .layout import DAMAGED, MARKER, SHARDED, TRAIN_STATE, member_path, rank_file

log = logging.getLogger(__name__)


class CheckpointDamaged(RuntimeError):
    """A complete checkpoint folder that cannot be trusted: ``file`` (the first found) and ``problem``
    (a phrase that follows the file's name: "is missing", "fails its checksum ...")."""

    def __init__(self, file: Path, problem: str):
        self.file, self.problem = Path(file), problem
        super().__init__(f"{file} {problem}")


CHECKSUM = "crc32"
_CHUNK = 1 << 20  # 1 MiB reads: as fast as 4 and 8 MiB (measured), less memory per hashing thread
MARKER_FORMAT = 2  # 1: a timestamp only (before the file records)


def file_record(path: Path, checksum: bool = True) -> dict:
    """``{"size": bytes, "crc32": "8 hex digits"}`` of a file; the size only when not ``checksum``."""
    if not checksum:
        return {"size": os.stat(path).st_size}
    crc = size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)  # releases the GIL: the training thread runs meanwhile
            size += n
    return {"size": size, CHECKSUM: f"{crc:08x}"}


def read_marker(folder: Path) -> dict | None:
    """The ``COMPLETE`` marker of ``folder``: ``{"files": {path: {"size", "crc32"?}}, "ranks", ...}``,
    checked to name only paths inside the folder; None for a marker of the earlier format (a timestamp),
    which records no files. Raises :class:`CheckpointDamaged`."""
    path = Path(folder) / MARKER
    try:
        _regular(path)  # a FIFO would block the read, a link would read another folder's marker
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointDamaged(path, f"cannot be read ({e})") from None
    try:
        float(text.strip())
        return None  # the earlier format: the time it was written
    except ValueError:
        pass
    try:
        marker = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointDamaged(path, f"is neither a file list nor a timestamp ({str(e)[:100]})") from None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or not files:
        raise CheckpointDamaged(path, "holds no file list")
    for name, rec in files.items():
        if not member_path(name):
            raise CheckpointDamaged(path, f"lists {name[:200]!r}, a path outside the step folder (checkpoints hold "
                                          f"plain names and {SHARDED}/<name> only)")
        if (not isinstance(rec, dict) or not _count(rec.get("size"))
                or not isinstance(rec.get(CHECKSUM, ""), str)):
            raise CheckpointDamaged(path, f"has an invalid record for {name}: {str(rec)[:200]}")
    ranks = marker.get("ranks")
    if not _count(ranks) or ranks < 1:
        raise CheckpointDamaged(path, f"records {ranks!r} ranks, not a positive whole number")
    return marker


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def verify(folder: Path, checksums: bool = True, rank: int = 0, world: int = 1) -> dict | None:
    """Check a complete folder against its marker: every recorded file present with its recorded size and,
    when ``checksums``, its CRC32 (this rank reads every ``world``-th file, so the ranks share the reading:
    call it on every rank; up to 4 files at once). Returns the marker; None for an earlier-format marker (nothing to compare:
    loading checks what it can). Raises :class:`CheckpointDamaged` naming the first bad file."""
    folder = Path(folder)
    marker = read_marker(folder)
    check_members(folder, marker["files"] if marker is not None else None)
    if marker is None:
        return None
    files = marker["files"]
    for name, rec in sorted(files.items()):
        path = folder / name
        try:
            size = _regular(path).st_size
        except FileNotFoundError:
            raise CheckpointDamaged(path, "is missing (the COMPLETE marker records it)") from None
        except OSError as e:
            raise CheckpointDamaged(path, f"cannot be read ({e.strerror})") from None
        if size != rec["size"]:
            raise CheckpointDamaged(path, f"holds {size:,} bytes, the COMPLETE marker records {rec['size']:,} (cut "
                                          "short, or replaced after the save)")
    for r in range(marker["ranks"]):
        if rank_file(folder, r).name not in files:
            raise CheckpointDamaged(folder / MARKER, f"records no {rank_file(folder, r).name} of its {marker['ranks']} ranks")
    if checksums:
        share = sorted(n for n, rec in files.items() if CHECKSUM in rec)[rank::world]
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="checkpoint-verify") as pool:
            futures = {name: pool.submit(file_record, folder / name) for name in share}
            for name in share:  # the first bad file in name order, whichever thread finishes first
                try:
                    got = futures[name].result()[CHECKSUM]
                except OSError as e:
                    for f in futures.values():
                        f.cancel()
                    raise CheckpointDamaged(folder / name, f"cannot be read ({e.strerror})") from None
                if got != files[name][CHECKSUM]:
                    for f in futures.values():
                        f.cancel()
                    raise CheckpointDamaged(folder / name, f"fails its checksum (CRC32 {got}, the COMPLETE marker "
                                                           f"records {files[name][CHECKSUM]}): its bytes changed "
                                                           "after the save")
    return marker


def _kind(mode: int) -> str | None:
    """What a non-regular file is ("a symbolic link" ...); None for a regular file."""
    for test, what in ((stat.S_ISREG, None), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def _regular(path: Path) -> os.stat_result:
    """``path``'s lstat, which must be a regular file's (links are not followed: a checkpoint's bytes are
    its own). Raises FileNotFoundError, or :class:`CheckpointDamaged` naming what it is instead."""
    st = os.lstat(path)
    what = _kind(st.st_mode)
    if what is not None:
        raise CheckpointDamaged(path, f"is {what}, not a regular file: a checkpoint holds regular files only, and "
                                      "nothing is read through it")
    return st


def check_members(folder: Path, listed: dict | None) -> None:
    """Every entry of ``folder`` (and of its ``sharded/``) is a regular file the marker lists (``listed``;
    None for an earlier-format marker, which lists nothing: then only the kind is checked), the marker
    itself or a ``DAMAGED`` note. A file added after the save, or a link, FIFO or device, raises
    :class:`CheckpointDamaged` naming it, before any file of the folder is read."""
    folder = Path(folder)
    for entry in _entries(folder):
        path = folder / entry.name
        if entry.name == SHARDED and entry.is_dir(follow_symlinks=False):
            for sub in _entries(path):
                _listed(path / sub.name, f"{SHARDED}/{sub.name}", listed)
            continue
        if entry.name in (MARKER, DAMAGED):
            _regular(path)
            continue
        _listed(path, entry.name, listed)


def _entries(folder: Path) -> list:
    try:
        return sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
        raise CheckpointDamaged(folder, f"cannot be listed ({e.strerror})") from None


def _listed(path: Path, name: str, listed: dict | None) -> None:
    try:
        _regular(path)
    except FileNotFoundError:  # removed meanwhile (a DAMAGED note cleared by another rank)
        return
    if listed is not None and name not in listed:
        raise CheckpointDamaged(path, "is not recorded by the COMPLETE marker: it was added after the save, and "
                                      "nothing a checkpoint does not record is read (move it out to resume)")


def sizes_intact(folder: Path) -> bool:
    """A cheap look (a stat per file): not marked damaged, and every file the marker records has its size.
    True for an earlier-format marker (nothing recorded to compare)."""
    folder = Path(folder)
    if (folder / DAMAGED).exists():
        return False
    try:
        verify(folder, checksums=False)
    except CheckpointDamaged:
        return False
    return True


def mark_damaged(folder: Path, line: str) -> None:
    """Leave the reason in a damaged folder (``DAMAGED``): retention keeps it, the user sees why."""
    try:
        (Path(folder) / DAMAGED).write_text(line + "\n")
    except OSError as e:  # a read-only folder: the log line says it
        log.warning("could not write %s: %s", Path(folder) / DAMAGED, e)


def read_train_state(folder: Path) -> dict:
    """``train_state.json`` of a checkpoint folder, each value checked (``train_state.check_train_state``;
    its step against the folder's name). Raises :class:`CheckpointDamaged`."""
    folder = Path(folder)
    path = folder / TRAIN_STATE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointDamaged(path, "is missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointDamaged(path, f"cannot be read ({e})") from None
    try:
        sd = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointDamaged(path, f"does not parse as JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointDamaged(path, f"does not parse as JSON ({str(e)[:100]})") from None
    m = STEP_RE.match(folder.name)
    try:
        return check_train_state(sd, int(m.group(1)) if m else None)
    except ValueError as e:
        raise CheckpointDamaged(path, str(e)) from None
