"""Sources: what a unit of work is (a tar shard, a parquet row group, a chunk of files) and how to read one.

Every source turns its units into *raw samples*, plain dicts with the same fields whatever the format:

  ``key``         the sample's name (tar member prefix, row key, file stem)
  ``url``         the unit it came from (for messages)
  ``image``       encoded image bytes, or None
  ``image_path``  a local path or http(s) URL to load the image from instead (parquet/CSV/folder), or None
  ``caption``     caption bytes or str, or None
  ``meta``        a dict of metadata, or ``meta_raw`` json bytes parsed later (so bad json is counted, not fatal)
  ``cls``         the class index (bytes/str/int) for classification datasets, or None
  ``references``  edit training: one ``(bytes, path)`` or None per reference image (see :mod:`.references`)

Nothing here decodes an image: sources are cheap, decoding happens after the metadata filters.
Units are plain picklable values; a source is rebuilt nowhere - it is pickled into the worker processes.
"""

from __future__ import annotations

import abc
import glob
import io
import json
import os
import re
import select
import signal
import stat
import subprocess
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

from ..config.dataset import DatasetConfigError
from .masks import source_mask_key
from .references import source_reference_key, tar_references
from .stats import Stats, describe_error, error_reason

REMOTE = re.compile(r"^(https?|pipe|s3|gs|ais|hf|scp|sftp|ftps)[:]")


class ShardError(Exception):
    """A unit that could not be read (missing, unreachable, truncated); ``reason`` is the counter name."""

    def __init__(self, reason: str, msg: str):
        super().__init__(msg)
        self.reason = reason


class ShardAbandoned(ShardError):
    """A tar shard whose headers cannot be trusted (a member claims more bytes than the stream holds, or
    skipping it would walk more than the limit): the reader stops it after a bounded amount of work."""


@dataclass
class Source(abc.ABC):
    """One source (one element of a '::'-joined path) and its units of work."""

    name: str
    units: List[Any] = field(default_factory=list)
    num_samples: Optional[int] = None  # known without reading (sizes.json, row counts), else None

    @abc.abstractmethod
    def read(self, unit: Any, stats: Stats) -> Iterator[Dict[str, Any]]:
        """Raw samples of ``unit`` in a fixed order; raises :class:`ShardError` if the unit is unusable."""

    def describe(self, unit: Any) -> str:
        return str(unit)


# --------------------------------------------------------------------------------------------------
# WebDataset tar shards
# --------------------------------------------------------------------------------------------------


def split_sources(path: str) -> List[str]:
    """'a::b' -> ['a', 'b'] (WebDataset's separator for several sources)."""
    return [p.strip() for p in str(path).split("::") if p.strip()]


def expand_shards(spec: str) -> List[str]:
    """Brace-expand one source; a local folder stands for its ``*.tar`` files (img2dataset's layout)."""
    import braceexpand

    if not REMOTE.match(spec) and os.path.isdir(spec):
        tars = sorted(glob.glob(os.path.join(spec, "*.tar")))
        if not tars:
            raise DatasetConfigError(f"dataset.params.path: folder {spec} holds no .tar shard")
        return tars
    return list(braceexpand.braceexpand(spec))


class PipeStream(io.RawIOBase):
    """The stdout of a ``pipe:`` command (run by the shell: configs are code), with a read-inactivity
    timeout: no byte for ``timeout`` seconds kills the command's process group and raises
    :class:`ShardError` (``shard_stalled``), so a hung ``curl`` or ``aws s3 cp`` costs one shard, not the
    run (and never blocks the signal save). A command that exits non-zero is an error at close."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url, timeout
        self.proc = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=subprocess.PIPE, start_new_session=True)
        self.fd = self.proc.stdout.fileno()
        self.killed = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        ready, _, _ = select.select([self.fd], [], [], self.timeout)
        if not ready:
            self._kill()
            raise ShardError("shard_stalled", f"{self.url}: no data for {self.timeout:g} s "
                             "(dataset.params.io_timeout); the command was killed")
        data = os.read(self.fd, len(buf))
        buf[: len(data)] = data
        return len(data)

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.killed = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self.closed:
            return
        if self.proc.poll() is None:  # closed before the end (the reader stopped early): not an error
            self._kill()
        rc = self.proc.wait()
        self.proc.stdout.close()
        super().close()
        if rc != 0 and not self.killed:
            raise OSError(f"{self.url}: the command exited with status {rc}")


def open_stream(url: str, timeout: float):
    """A readable binary stream for a local path, ``http(s)://`` URL or ``pipe:`` command (or any scheme
    ``webdataset.gopen`` knows). http(s) uses urllib with a timeout, so an unreachable host fails fast
    (webdataset's curl retries for about a minute)."""
    if url.startswith(("http://", "https://")):
        try:
            return urllib.request.urlopen(url, timeout=timeout)
        except (urllib.error.URLError, OSError, ValueError) as exn:
            raise ShardError("shard_unreachable", f"{url}: {exn}") from exn
    if url.startswith("pipe:"):
        return io.BufferedReader(PipeStream(url, timeout), buffer_size=1 << 20)
    if not REMOTE.match(url) and not url.startswith("file:"):
        if not os.path.exists(url):
            raise ShardError("shard_missing", f"{url}: no such file")
    from webdataset.gopen import gopen

    try:
        return gopen(url)
    except FileNotFoundError as exn:
        raise ShardError("shard_missing", f"{url}: {exn}") from exn
    except Exception as exn:  # any scheme-specific failure: the shard is skipped, the run goes on
        raise ShardError("shard_unreadable", f"{url}: {exn}") from exn


def _split_name(name: str):
    """'dir/abc.seg.jpg' -> ('dir/abc', 'seg.jpg'): webdataset's rule (the key ends at the first dot of
    the basename)."""
    from webdataset.tariterators import base_plus_ext

    return base_plus_ext(name)


DEFAULT_MAX_MEMBER_BYTES = 64 * 2**20
# Skipping a member the reader does not keep (over max_member_bytes, a link, a directory...) walks its data
# when the stream's length is unknown (pipe:, a URL without Content-Length) or the shard is compressed: at
# most this many times max_member_bytes per member, then the shard is abandoned (a decompression bomb or a
# forged header cannot hold a reader for long). Where the length is known, claims are checked against it.
SKIP_WALK_MEMBERS = 16
WALK_CHUNK = 1 << 20
# Extended headers (pax, GNU long names) are read whole by tarfile: one claiming more is a lying header.
MAX_EXTENDED_HEADER_BYTES = 1 << 20
_EXTENDED_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                   tarfile.SOLARIS_XHDTYPE)


def stream_length(stream) -> Optional[int]:
    """Bytes the raw stream holds from its start: a regular file's size, an http response's
    Content-Length; None when unknown (a pipe, a chunked response, another scheme)."""
    try:
        st = os.fstat(stream.fileno())
        if stat.S_ISREG(st.st_mode):
            return int(st.st_size)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    length = getattr(stream, "length", None)  # http.client.HTTPResponse: Content-Length (None if chunked)
    return int(length) if isinstance(length, int) and length >= 0 else None


def _checked_tarinfo(length: Optional[int], slack: int):
    """A TarInfo class whose headers are checked before tarfile acts on them: an extended header over
    MAX_EXTENDED_HEADER_BYTES, or (an uncompressed stream of known length) a member whose data would end
    more than ``slack`` bytes past the stream, abandons the shard before a byte of the claim is read or
    walked. A smaller overrun is a shard cut short (an interrupted copy): reading finds its end within
    ``slack`` bytes and counts it as ``shard_truncated``."""

    class CheckedTarInfo(tarfile.TarInfo):
        def _proc_member(self, tf):
            known = length if getattr(tf.fileobj, "comptype", None) == "tar" else None
            if self.type in _EXTENDED_TYPES:
                if self.size > MAX_EXTENDED_HEADER_BYTES:
                    raise ShardAbandoned("lying_header", f"an extended header at byte {self.offset:,} claims "
                                         f"{self.size:,} bytes (at most {MAX_EXTENDED_HEADER_BYTES:,} are read)")
                if known is not None and self.offset + tarfile.BLOCKSIZE + self.size - known > slack:
                    raise ShardAbandoned("lying_header", f"an extended header at byte {self.offset:,} claims "
                                         f"{self.size:,} bytes; the shard has {known:,} in all")
            out = super()._proc_member(tf)
            # tf.offset: where the next header starts (this member's data rounded up to a block).
            if known is not None and tf.offset - known > max(slack, tarfile.BLOCKSIZE - 1):
                raise ShardAbandoned("lying_header", f"{out.name} claims {out.size:,} bytes from byte "
                                     f"{out.offset_data:,}; the shard has {known:,} in all")
            return out

    return CheckedTarInfo


def _walk_past(tar, info, limit: Optional[int], slack: int) -> None:
    """Walk the stream to the next header (the data of a member not kept), reading only what is there:
    the stream ending more than ``slack`` bytes short of the claim, or more than ``limit`` bytes walked,
    abandons the shard (a shorter shortfall is a truncated shard: tarfile.ReadError)."""
    f, target, walked = tar.fileobj, tar.offset, 0
    while f.tell() < target:
        want = min(WALK_CHUNK, target - f.tell())
        got = len(f.read(want))
        walked += got
        if got < want:
            if target - f.tell() <= slack:
                raise tarfile.ReadError("unexpected end of data")
            raise ShardAbandoned("lying_header", f"{info.name} claims {info.size:,} bytes; the stream ends "
                                 f"{walked:,} bytes into it")
        if limit is not None and walked > limit and f.tell() < target:
            raise ShardAbandoned("skip_limit", f"{info.name} claims {info.size:,} bytes: skipping it would read "
                                 f"more than {limit:,} (the stream's length is unknown or it is compressed; "
                                 f"{SKIP_WALK_MEMBERS} x dataset.params.max_member_bytes)")


def iter_tar_samples(url: str, timeout: float, stats: Stats,
                     max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES) -> Iterator[Dict[str, Any]]:
    """Members of one tar grouped by key, in order: ``{"__key__": key, ext: bytes, ...}``.

    A missing or unreachable shard raises :class:`ShardError` before anything is yielded; a tar that breaks
    part-way (truncated, corrupt header, any error while reading) yields the complete samples before the
    break and then stops, counted as ``skipped/shard_truncated`` (``skipped/shard_error:<type>`` for an
    error that is not a tar, I/O or value error). A shard whose headers lie (a member claiming more than
    max_member_bytes past the end of the stream) is abandoned after a bounded amount of work: counted as ``skipped/lying_header`` or
    ``skipped/skip_limit`` and ``shards_abandoned``, and named in the log. A stalled stream's
    :class:`ShardError` propagates (the caller counts it).
    """
    stream = open_stream(url, timeout)
    current: Optional[Dict[str, Any]] = None
    n_members = 0
    length = stream_length(stream)
    try:
        try:
            try:
                tar = tarfile.open(fileobj=stream, mode="r|*", tarinfo=_checked_tarinfo(length, max_member_bytes))
            except ShardError:
                raise
            except (tarfile.TarError, OSError, EOFError) as exn:
                raise ShardError("shard_unreadable", f"{url}: not a readable tar ({exn})") from exn
            # Where the stream's length bounds every claim (uncompressed, known length), walking is bounded
            # by the file itself; elsewhere by SKIP_WALK_MEMBERS x max_member_bytes per member.
            walk_limit = None if (length is not None and tar.fileobj.comptype == "tar") else \
                SKIP_WALK_MEMBERS * max_member_bytes
            for info in tar:
                tar.members = []  # streaming: do not keep every TarInfo of the shard in memory
                if not info.isreg():
                    _walk_past(tar, info, walk_limit, max_member_bytes)
                    continue
                prefix, suffix = _split_name(info.name)
                base = os.path.basename(info.name)
                if prefix is None or (base.startswith("__") and base.endswith("__")):
                    _walk_past(tar, info, walk_limit, max_member_bytes)
                    continue
                if info.size > max_member_bytes:  # skipped unread: a decompression bomb never reaches memory
                    stats.skip("member_too_large", f"{url}: {info.name} is {info.size:,} bytes, over "
                               f"dataset.params.max_member_bytes={max_member_bytes:,}")
                    _walk_past(tar, info, walk_limit, max_member_bytes)
                    continue
                data = tar.extractfile(info).read()
                n_members += 1
                suffix = suffix.lower()
                if current is None or current["__key__"] != prefix:
                    if current is not None:
                        yield current
                    current = {"__key__": prefix}
                if suffix in current:
                    stats.skip("duplicate_member", f"{url}: {info.name} appears twice; keeping the first")
                    continue
                current[suffix] = data
        except ShardAbandoned as exn:
            stats.add("shards_abandoned")
            stats.skip(exn.reason, f"{url}: shard abandoned after {n_members} members: {exn}", every=url)
            current = None
        except ShardError:  # a stalled stream: the caller counts it
            raise
        except (tarfile.TarError, OSError, EOFError, ValueError) as exn:
            # Truncated or corrupt: keep what was complete, drop the sample being read, stop the shard.
            if n_members == 0 and current is None:
                raise ShardError("shard_unreadable", f"{url}: {exn}") from exn
            stats.skip("shard_truncated", f"{url}: stopped after {n_members} members ({exn})")
            current = None
        except Exception as exn:  # anything else (zlib.error, MemoryError...): the same, named by its type
            stats.skip(error_reason(exn, "shard_error"), f"{url}: stopped after {n_members} members "
                       f"({describe_error(exn)})")
            current = None
        if current is not None:
            yield current
    finally:
        try:
            stream.close()
        except Exception as exn:  # a pipe: command that failed reports here; its samples were already read
            stats.skip("shard_unreadable", f"{url}: closing the stream failed ({exn})")


class WebDatasetSource(Source):
    """Tar shards (WebDataset / img2dataset layout): ``key.jpg``, ``key.txt``, ``key.json``, ``key.cls``."""

    def __init__(self, spec: str, params):
        super().__init__(name=spec, units=expand_shards(spec))
        self.image_keys = [k.strip().lower() for k in str(params.image_keys).split(";") if k.strip()]
        self.caption_key = str(params.caption_key).lower()
        self.metadata_key = str(params.metadata_key).lower()
        self.cls_key = str(params.cls_key).lower()
        self.timeout = float(params.io_timeout)
        self.max_member_bytes = int(params.max_member_bytes)
        self.num_samples = _sizes_json_total(spec, self.units)
        self.mask_key = source_mask_key(params)  # masked_loss: the member holding the mask (None: not read)
        # edit training: KEY.ref.<ext>, KEY.ref2.<ext>... (None: not read; see references.py)
        self.reference_key, self.references = source_reference_key(params), int(params.references)

    def read(self, unit: str, stats: Stats) -> Iterator[Dict[str, Any]]:
        for members in iter_tar_samples(unit, self.timeout, stats, self.max_member_bytes):
            image = None
            for k in self.image_keys:
                if k in members:
                    image = members[k]
                    break
            yield {
                "key": members["__key__"],
                "url": unit,
                "image": image,
                "image_path": None,
                "caption": members.get(self.caption_key),
                "meta_raw": members.get(self.metadata_key),
                "cls": members.get(self.cls_key),
                "mask": members.get(self.mask_key) if self.mask_key else None,
                "references": tar_references(members, self.reference_key, self.references),
            }


def _sizes_json_total(spec: str, units: Sequence[str]) -> Optional[int]:
    """Total samples from a ``sizes.json`` ({shard basename: count}) next to local shards, if complete."""
    if not units or REMOTE.match(units[0]):
        return None
    folder = os.path.dirname(units[0])
    path = os.path.join(folder, "sizes.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            sizes = json.load(fh)
        return int(sum(int(sizes[os.path.basename(u)]) for u in units))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def outside_root_error(path: str, root: str, allowed: bool):
    """The per-sample error for a local image path that resolves outside ``root`` (``..``, an absolute
    path, a symlink), or None. Such paths are refused unless dataset.params.allow_paths_outside_root: a
    CSV or metadata file must not make the trainer read arbitrary files."""
    if allowed or path.startswith(("http://", "https://")):
        return None
    real, base = os.path.realpath(path), os.path.realpath(root)
    if real == base or real.startswith(base.rstrip(os.sep) + os.sep):
        return None
    return ("path_outside_root", f"{path} is outside {root} (set dataset.params.allow_paths_outside_root=true "
                                 "if the dataset means it)")


def read_image_path(path: str, timeout: float) -> bytes:
    """Bytes of an image given by a local path or an http(s) URL (parquet/CSV/folder sources)."""
    if path.startswith(("http://", "https://")):
        with urllib.request.urlopen(path, timeout=timeout) as resp:
            return resp.read()
    with open(path, "rb") as fh:
        return fh.read()

