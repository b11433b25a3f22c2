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
      COMPLETE           written last: only folders that have it are ever resumed from
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


def shared_file(folder: Path, name: str) -> Path:
    """The file rank 0 writes for the state called ``name``."""
    return Path(folder) / f"{name}.pt"


def rank_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"{RANK_PREFIX}{rank}.pt"


def rank_files(folder: Path) -> list[Path]:
    """Every ``rank_<R>.pt`` of a checkpoint folder, in rank order."""
    files = Path(folder).glob(f"{RANK_PREFIX}*.pt")
    return sorted(files, key=lambda p: int(p.stem[len(RANK_PREFIX):]))


def rank_of(path: Path) -> int:
    return int(Path(path).stem[len(RANK_PREFIX):])


def is_sharded(folder: Path) -> bool:
    return (Path(folder) / SHARDED).is_dir()

# Keys of a rank file: that rank's RNG states and its data-loader position.
RANK_RNG = "rng"
RANK_DATA = "data"
