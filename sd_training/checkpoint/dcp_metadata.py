"""DCP's index of a sharded checkpoint (``sharded/.metadata``), read without running anything it holds.

DCP writes its index with ``pickle``, and torch's own reader loads it with ``pickle.load``: a planted
index would run its command on every rank that reads it. Here it is read with an unpickler that builds
only DCP's own metadata classes, torch sizes, dtypes and layouts, paths and plain containers; anything
else (``os.system``, ``builtins.eval``, a persistent id ...) is refused before it is built, and the
folder is reported damaged. Storing the index in a plain format instead would need a second reader for
the checkpoints already written (their ``.metadata`` is a pickle and must still load), so both old and
new folders go through this one reader; DCP's own tensors and byte entries are read with
``torch.load(weights_only=True)`` by DCP itself.

:func:`safe_reader` is a ``FileSystemReader`` that reads its index here, for ``dcp.load``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from .integrity import CheckpointDamaged
from .layout import DCP_METADATA

_MD = "torch.distributed.checkpoint.metadata"
# The classes a DCP index is made of (torch 2.4-2.14), and the small callables its pickle calls to
# rebuild them; nothing here reads or writes a file or runs a command with its arguments.
ALLOWED = frozenset({
    *((_MD, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout's name -> torch.strided ... (a table look-up)
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),  # Python 3.13's home of the classes
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
})


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)  # torch.float32, torch.contiguous_format ...: values, not callables
        raise pickle.UnpicklingError(f"it names {module}.{name}"[:200] + ", which is no part of DCP's metadata")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id, which DCP's metadata never does")


def read_metadata(path: Path):
    """DCP's ``Metadata`` from the index file ``path``. Raises :class:`CheckpointDamaged` naming it: a
    garbled or cut file, or one that would build anything other than DCP's metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    try:
        with open(path, "rb") as fh:
            md = _IndexUnpickler(fh).load()
    except FileNotFoundError:
        raise CheckpointDamaged(path, "is missing (DCP's index of the shards)") from None
    except pickle.UnpicklingError as e:
        raise CheckpointDamaged(path, f"is refused: {str(e)[:300]}. DCP's index holds its own metadata classes only; "
                                      "it was not written by sd-training and nothing in it was run") from None
    except MemoryError:
        raise
    except Exception as e:  # a cut or garbled pickle: EOFError, an opcode error ...
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointDamaged(path, f"cannot be read ({type(e).__name__}: {first}): cut short or garbled") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CheckpointDamaged(path, f"holds a {type(md).__name__}, not DCP's metadata with its index")
    return md


def safe_reader(folder: Path):
    """A ``FileSystemReader`` of ``folder`` (a ``sharded/`` folder) whose index is :func:`read_metadata`'s."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = read_metadata(Path(folder) / DCP_METADATA)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _Reader(str(folder))
