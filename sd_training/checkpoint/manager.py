"""The run's checkpoints: one owner saves and resumes everything a run needs to continue exactly.

The :class:`CheckpointManager` takes the objects that have a ``state_dict()`` (the LR schedule, the
gradient scaler, trained encoders), the model state (net, optimizer, EMA in the strategy's layout),
the loader and the train state, and offers :meth:`~CheckpointManager.save` and
:meth:`~CheckpointManager.resume`. Names inside a checkpoint: ``layout``; the folder format, asynchronous
writes and retention: ``store``; resharding between layouts and rank counts: ``model_state``.
"""

from __future__ import annotations

import logging

from ..config.loading import public_dict, to_yaml
from ..config.schema import TrainConfig
from ..distributed import DistInfo
from ..run_dir import RunDir
from ..train_state import Plan, TrainState
from .layout import CONFIG, RANK_DATA, RANK_RNG
from .model_state import ModelState
from .resume_config import check_resume_config
from .store import Checkpointer, check_writable, rng_state, set_rng_state

log = logging.getLogger(__name__)


class CheckpointManager:
    def __init__(self, cfg: TrainConfig, run_dir: RunDir, info: DistInfo, plan: Plan, state: TrainState,
                 model: ModelState, stateful: dict, lr_scheduler, loader):
        """``stateful``: name -> object with ``state_dict()``/``load_state_dict()`` written by rank 0 (the LR
        schedule, the gradient scaler, trained encoders); ``model``: the net, optimizer and EMA."""
        self.cfg, self.run_dir, self.info, self.plan, self.state = cfg, run_dir, info, plan, state
        self.model, self.stateful, self.lr_scheduler, self.loader = model, dict(stateful), lr_scheduler, loader
        e = cfg.experiment
        self.store = Checkpointer(run_dir.checkpoints, e.keep_last_checkpoints, e.keep_checkpoint_every,
                                  asynchronous=e.checkpoint_async,
                                  rank_files_timeout_s=60 * cfg.distributed.timeout_minutes)
        self.config_yaml = to_yaml(cfg)

    def check_disk(self) -> None:
        """Weights, two AdamW moments, the EMA: the folder found unwritable or nearly full now, not at
        the first save hours later."""
        weight_bytes = sum(p.numel() * 4 for p in self.model.net.parameters())
        check_writable(self.run_dir.checkpoints, weight_bytes * (3 + (self.model.ema is not None)))

    @property
    def last_stall_s(self) -> float:
        """Seconds the last save held the training loop."""
        return self.store.last_stall_s

    def wait(self) -> None:
        """The save in flight is on disk (or its error raised)."""
        self.store.wait()

    # -- save -------------------------------------------------------------------------------------
    def plain_objects(self) -> dict:
        """Name -> object whose ``state_dict()`` rank 0 writes as ``<name>.pt`` (the rest: DCP shards)."""
        return {**self.stateful, **self.model.plain_objects()}

    def save(self) -> None:
        """Collective: the state at ``state.step``, in the strategy's layout (asynchronous if configured)."""
        shared = {name: obj.state_dict() for name, obj in self.plain_objects().items()} if self.info.is_main else {}
        per_rank = {RANK_RNG: rng_state(), RANK_DATA: self.loader.state_dict()}
        self.store.save(self.state.step, shared, per_rank, self.state.state_dict(), self.config_yaml, self.info.rank,
                        self.model.sharded_writer(self.store.asynchronous))

    # -- resume -----------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Continue from the newest complete checkpoint, whichever layout and rank count wrote it; False
        when there is none. Collective under fsdp."""
        latest = self.store.latest()
        if latest is None:
            if self.info.is_main:
                self.run_dir.cut_metrics_back(0)  # a run killed before its first checkpoint
            return False
        applied = []
        if (latest / CONFIG).exists():
            applied = check_resume_config((latest / CONFIG).read_text(), public_dict(self.cfg),
                                          self.cfg.experiment.allow_config_change, latest)
        new_peaks = [g["initial_lr"] for g in self.model.optimizer.param_groups]
        shared, _, train_state = Checkpointer.load(latest, self.info.rank)
        for name, obj in self.stateful.items():
            if name not in shared:
                raise RuntimeError(
                    f"checkpoint {latest} has no '{name}' state: it was written with other settings "
                    "(model.text_encoder.train); resume with those, or start a new run name")
            obj.load_state_dict(shared[name])
        converted = self.model.load(latest, shared, self.info.world_size)
        if converted:
            log.info("%s", converted)
        self.state.load_state_dict(train_state)
        self._resume_data_and_rng(latest)
        if applied:
            self._apply_new_peaks(new_peaks)
        if self.info.is_main:
            self.run_dir.cut_metrics_back(self.state.step)
        log.info("resumed from %s at step %d (%d images seen)", latest, self.state.step, self.state.images_seen)
        return True

    def _resume_data_and_rng(self, latest) -> None:
        """The data position of every saved rank (on another layout each canonical reader's goes to its new
        owner), this rank's RNG when the rank count is unchanged, and one line when the layout changed."""
        ranks = Checkpointer.rank_states(latest)
        self.loader.load_state_dict([r[RANK_DATA] for r in ranks])
        if len(ranks) == self.info.world_size:
            set_rng_state(ranks[self.info.rank][RANK_RNG])  # the training step's draws are the samples' own
        p, saved_batch = self.plan, self.state.global_batch
        if self.loader.resumed_from:
            log.info("resumed on %s from a checkpoint of %s (%d canonical readers); global batch %d = %d x %d "
                     "accumulation x %d ranks", self.loader.layout, self.loader.resumed_from, self.loader.plan.readers,
                     p.global_batch, self.cfg.system.batch_size, p.accumulation, self.info.world_size)
        if saved_batch and saved_batch != p.global_batch:
            log.warning("the global batch changes from %d (checkpoint) to %d: set system.global_batch_size=%d to keep "
                        "it whatever the rank count", saved_batch, p.global_batch, saved_batch)
        self.state.global_batch = p.global_batch

    def _apply_new_peaks(self, new_peaks: list[float]) -> None:
        """A new learning rate on resume: the schedule continues from this step with the new peaks."""
        sched = self.lr_scheduler
        sched.base_lrs = list(new_peaks)
        factor = sched.lr_lambdas[0](sched.last_epoch)
        for g, peak in zip(self.model.optimizer.param_groups, new_peaks):
            g["initial_lr"], g["lr"] = peak, peak * factor
