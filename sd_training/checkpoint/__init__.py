"""Resume checkpoints: one owner (:class:`CheckpointManager`) saves and resumes the run.

- ``layout``: the names inside a checkpoint folder, spelled once;
- ``store``: the folder format (atomic, asynchronous, retained, every file's size and CRC32 recorded),
  read back with weights_only;
- ``integrity``: whether a complete folder can be trusted (only regular files its marker lists, sizes, checksums,
  every value read back);
- ``model_state``: the net, optimizer and EMA in full tensors or DCP shards, resharded as they are read;
- ``dcp_metadata``: DCP's index read with an unpickler that builds DCP's metadata classes only;
- ``optimizer_state``: whether a checkpoint's optimizer state is this run's optimizer's;
- ``resume_config``: which config changes a resume accepts;
- ``manager``: :class:`CheckpointManager`, ``save()`` and ``resume()`` of everything a run continues from;
- ``init_from``: stage 2, the trained module's weights from another run or pipeline (and ``model.ema.path``'s),
  checked before they are loaded.
"""

from .init_from import init_weights_from, load_weights_checked
from .integrity import CheckpointDamaged, verify
from .layout import MARKER
from .manager import CheckpointManager
from .model_state import Layout, ModelState
from .store import Checkpointer, CheckpointWriteError, check_writable, complete_steps, rng_state, set_rng_state

__all__ = ["MARKER", "CheckpointManager", "CheckpointWriteError", "Checkpointer", "Layout", "ModelState",
           "check_writable", "complete_steps", "init_weights_from", "load_weights_checked", "rng_state",
           "set_rng_state", "CheckpointDamaged", "verify"]
