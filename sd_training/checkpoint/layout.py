"""The names inside a checkpoint folder, spelled once. Everything that writes or reads a checkpoint
(``store``, ``model_state``, ``manager``, ``init_from``) takes them from here.

    checkpoints/step_00001000/
      <net>.pt           the trained module's weights (``Family.net_name``: unet, vae ...), full tensors
      ema.pt             EMA weights and scalars (model.use_ema)
      optimizer.pt       optimizer state (state keyed by parameter index)
      lr_scheduler.pt    LR scheduler state
      grad_scaler.pt     fp16 gradient scaler state
      <encoder>.pt       a text encoder trained with the net (model.text_encoder.train)
      sharded/           FSDP instead of <net>/ema/optimizer.pt: every rank's shards (DCP), keys below
      ema_meta.pt        FSDP: the EMA's scalars (its weights are in sharded/)
      rank_<R>.pt        per rank: RNG states (python, numpy, torch CPU and CUDA) and data-loader position
      train_state.json   step, images seen, tracker run id ...; ``checkpoint_files``: the <name>.pt files
      config.yaml        the resolved config of the run that wrote it
      COMPLETE           written last: only folders that have it are ever resumed from. JSON: every file
                         above with its size and CRC32 (``experiment.checkpoint_verify``), each rank's
                         files hashed by that rank (``manifest_rank_<R>.json`` while the save runs).
                         Before the records existed it held a timestamp only: such folders still resume
      DAMAGED            written by a resume that found the folder damaged: the one-line reason. The
                         folder is kept (never deleted, nor counted as kept by retention)
"""

from __future__ import annotations

from pathlib import Path

MARKER = "COMPLETE"
TRAIN_STATE = "train_state.json"
CONFIG = "config.yaml"
SHARDED = "sharded"
OPTIMIZER = "optimizer"
EMA = "ema"
EMA_META = "ema_meta"
LR_SCHEDULER = "lr_scheduler"
GRAD_SCALER = "grad_scaler"
# Keys inside sharded/: the trained module stays "unet" whatever the family, as in checkpoints written
# before model families existed (they resume).
DCP_NET = "unet"
DCP_OPTIMIZER = OPTIMIZER
DCP_EMA = EMA
RANK_PREFIX = "rank_"
MANIFEST_PREFIX = "manifest_rank_"  # a rank's written files (sizes, checksums): merged into MARKER, then removed
DAMAGED = "DAMAGED"
DCP_METADATA = ".metadata"


def shared_file(folder: Path, name: str) -> Path:
    """The file rank 0 writes for the state called ``name``."""
    return Path(folder) / f"{name}.pt"


def rank_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"{RANK_PREFIX}{rank}.pt"


def rank_files(folder: Path) -> list[Path]:
    """Every ``rank_<R>.pt`` of a checkpoint folder, in rank order."""
    files = [p for p in Path(folder).glob(f"{RANK_PREFIX}*.pt") if _digits(p.stem[len(RANK_PREFIX):])]
    return sorted(files, key=rank_of)


def _digits(s: str) -> bool:
    return s.isascii() and s.isdigit()


def rank_of(path: Path) -> int:
    return int(Path(path).stem[len(RANK_PREFIX):])


def is_sharded(folder: Path) -> bool:
    return (Path(folder) / SHARDED).is_dir()


def manifest_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"{MANIFEST_PREFIX}{rank}.json"


def dcp_files(sharded: Path, rank: int) -> list[Path]:
    """The files DCP's file-system writer wrote for ``rank`` in ``sharded/``: its ``__<R>_<i>.distcp``
    (one per rank in the default mode) and, on rank 0 (DCP's coordinator), ``.metadata``."""
    files = sorted(Path(sharded).glob(f"__{rank}_*.distcp"))
    meta = Path(sharded) / DCP_METADATA
    return files + [meta] if rank == 0 and meta.exists() else files


def plain_name(name) -> bool:
    """A file name that stays in its folder: not empty, no separator, not ``.`` or ``..``, no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def member_path(name) -> bool:
    """A path the marker may record: a plain name, or ``sharded/<plain name>`` (DCP's files)."""
    if not isinstance(name, str):
        return False
    parts = name.split("/")
    return plain_name(parts[0]) if len(parts) == 1 else (len(parts) == 2 and parts[0] == SHARDED and plain_name(parts[1]))

# Keys of a rank file: that rank's RNG states and its data-loader position.
RANK_RNG = "rng"
RANK_DATA = "data"
