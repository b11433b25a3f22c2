"""The run's checkpoints: one owner saves and resumes everything a run needs to continue exactly.

The :class:`CheckpointManager` takes the objects that have a ``state_dict()`` (the LR schedule, the
gradient scaler, trained encoders), the model state (net, optimizer, EMA in the strategy's layout),
the loader and the train state, and offers :meth:`~CheckpointManager.save` and
:meth:`~CheckpointManager.resume`. Names inside a checkpoint: ``layout``; the folder format, asynchronous
writes and retention: ``store``; resharding between layouts and rank counts: ``model_state``.

A checkpoint is verified before it is trusted (:meth:`CheckpointManager.resume`): its files against the
marker's sizes and checksums (the ranks share the reading), ``train_state.json``'s values, the names it
lists, every rank file, and each tensor's shape against this run's model, all before anything is loaded.
One that fails is named in one log line (file and problem), left in place with a ``DAMAGED`` note, and the
next older one is tried; the ranks decide together, so none loads another step. The ranks agree on the
sizes and checksums of every file before any rank reads one. If none can be used, or step folders exist
that lack their marker, the run stops with a message naming them all and the remedies (it does not start
over: that would lose their training and overwrite the run's metrics, exports and sample grids).
An optimizer state written by another optimizer is refused, or dropped with a warning when the user allows
config changes (:meth:`CheckpointManager._optimizer_changed`).
"""

from __future__ import annotations

import logging
import zlib

import torch.distributed as dist

from ..config import ConfigError
from ..config.loading import public_dict, to_yaml
from ..config.schema import TrainConfig
from ..distributed import DistInfo
from ..run.run_dir import RunDir, step_folders, step_name
from ..run.train_state import Plan, TrainState
from .integrity import CheckpointDamaged, mark_damaged, verify
from .layout import CONFIG, DAMAGED, MARKER, RANK_DATA, RANK_RNG
from .model_state import ModelState
from .resume_config import check_resume_config, saved_optimizer_name
from .store import Checkpointer, check_writable, complete_steps, rng_state, set_rng_state

log = logging.getLogger(__name__)


class NoUsableCheckpoint(ConfigError):
    """Every complete checkpoint of the run failed its checks: the run stops rather than start over."""



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
                                  rank_files_timeout_s=60 * cfg.distributed.timeout_minutes,
                                  checksum=e.checkpoint_verify == "full")
        self.config_yaml = to_yaml(cfg)
        self._drop_optimizer = False  # the checkpoint's optimizer state is another optimizer's (allowed change)
        self._rank_states = None  # every rank's file of the checkpoint being resumed, read while it was checked
        # Asynchronous saves copy the state into host buffers: allocate them after the first optimizer step
        # (its state exists then), in the background, so the first save does not wait for them.
        self._reserve_hook = None
        if self.store.asynchronous and info.is_main and model.optimizer is not None:
            self._reserve_hook = model.optimizer.register_step_post_hook(self._reserve_buffers)

    def _reserve_buffers(self, *_) -> None:
        if self._reserve_hook is None:  # once; not removed here: the optimizer is iterating over its hooks
            return
        self._reserve_hook = None
        self.store.reserve({name: obj.state_dict() for name, obj in self.plain_objects().items()}, {})

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
        """Continue from the newest usable checkpoint, whichever layout and rank count wrote it; False when
        there is none. Collective (every rank takes the same one)."""
        chosen = self._choose()
        if chosen is None:
            if self.info.is_main:
                self.run_dir.cut_metrics_back(0)  # a run killed before its first checkpoint
            return False
        latest, shared, self._rank_states, train_state, applied = chosen
        new_peaks = [g["initial_lr"] for g in self.model.optimizer.param_groups]
        for name, obj in self.stateful.items():
            if name not in shared:
                raise RuntimeError(
                    f"checkpoint {latest} has no '{name}' state: it was written with other settings "
                    "(model.text_encoder.train); resume with those, or start a new run name")
            obj.load_state_dict(shared[name])
        converted = self.model.load(latest, shared, self.info.world_size, optimizer=not self._drop_optimizer)
        if converted:
            log.info("%s", converted)
        self.state.load_state_dict(train_state)
        self._resume_data_and_rng(latest)
        if applied or self._drop_optimizer:  # a fresh optimizer's groups hold the peaks, not the step's rates
            self._apply_new_peaks(new_peaks)
        if self.info.is_main:
            self.run_dir.cut_metrics_back(self.state.step)
        log.info("resumed from %s at step %d (%d images seen)", latest, self.state.step, self.state.images_seen)
        return True

    def _choose(self):
        """Collective: (folder, shared states, rank states, train state, applied config changes) of the newest
        complete checkpoint that passes every check on every rank; None when the run has no checkpoint folder.
        Rank 0's list of folders is every rank's. Every rank first checks its share of the checksums (and
        every file's size and kind) and the ranks agree on the result before any rank reads a file of the
        folder; a problem found on any rank rejects the folder on all."""
        steps = _broadcast(complete_steps(self.store.root))
        # Step folders without a marker: never a killed save (saves are staged under <step>.tmp and renamed
        # once complete), so a copy cut short or a marker removed: never read, and never started over on.
        unfinished = _broadcast([s for s in step_folders(self.store.root)
                                 if not (self.store.root / step_name(s) / MARKER).exists()])
        if unfinished and self.info.is_main:
            log.warning("checkpoint folder(s) %s have no %s marker: they cannot be verified and are not read",
                        ", ".join(step_name(s) for s in unfinished[-8:]), MARKER)
        rejected = []
        for i, step in enumerate(reversed(steps)):
            folder = self.store.root / step_name(step)
            digest, damaged = self._on_every_rank(self._verify, folder)
            if damaged is None and len(set(_gather(digest))) > 1:
                damaged = (f"{folder / MARKER} is not the same file on every rank: the ranks do not see the same "
                           "folder (a node-local copy?)")
            read = None
            if damaged is None:  # every rank's share of the checksums passed: now the files are read
                read, damaged = self._on_every_rank(self._read_checked, folder)
            if damaged is None:
                if self.info.is_main and (folder / DAMAGED).exists():
                    (folder / DAMAGED).unlink(missing_ok=True)
                    log.info("%s passes every check now: its %s note was removed", folder, DAMAGED)
                return (folder, *read)
            rejected.append((folder, damaged))
            if self.info.is_main:
                older = steps[len(steps) - 2 - i] if i + 1 < len(steps) else None
                log.warning("checkpoint %s cannot be used: %s. It is left in place (the reason is in its %s file); %s",
                            folder.name, damaged, DAMAGED,
                            f"trying the older {step_name(older)}" if older is not None else "no older checkpoint")
                mark_damaged(folder, damaged)
        unverifiable = [(self.store.root / step_name(s), f"has no {MARKER} marker (a copy cut short, or the marker "
                                                          "was removed): it cannot be verified, so it is not read")
                        for s in unfinished]
        if rejected or unverifiable:
            found = sorted(rejected + unverifiable, key=lambda fp: fp[0].name, reverse=True)
            raise NoUsableCheckpoint(
                f"no checkpoint in {self.store.root} can be resumed from: "
                + "; ".join(f"{f.name}: {p}" for f, p in found)
                + ". They are left in place and nothing was deleted or changed (metrics.jsonl, the exported pipelines "
                "and the sample grids included): the run stops rather than start over. Repair them (e.g. copy the "
                "files again), move the damaged ones aside to resume from an older copy, or set "
                "experiment.start_fresh=true to move the run folder's contents aside and start over")
        return None

    def _on_every_rank(self, fn, folder):
        """Collective: ``fn(folder)`` on every rank; (its value here, the first rank's CheckpointDamaged text or
        None). A refused config change or any other error on any rank is raised on every rank (not left to
        hang the others)."""
        outcome, value, error = None, None, None
        try:
            value = fn(folder)
        except CheckpointDamaged as e:
            outcome = ("damaged", str(e))
        except ConfigError as e:  # a refused config change: not the folder's fault, no fallback
            outcome, error = ("refused", str(e)), e
        except Exception as e:
            outcome, error = ("error", f"{type(e).__name__}: {e}"), e
        outcomes = _gather(outcome)
        damaged = next((o[1] for o in outcomes if o and o[0] == "damaged"), None)
        if damaged is None:
            for r, o in enumerate(outcomes):
                if o is not None:
                    if error is not None:
                        raise error
                    raise (ConfigError if o[0] == "refused" else RuntimeError)(
                        o[1] if o[0] == "refused" else f"rank {r} failed reading checkpoint {folder}: {o[1]}")
        return value, damaged

    def _verify(self, folder) -> int:
        """This rank's share of the checks that read no file's content as data: every entry's kind, every
        recorded size, its share of the checksums. Returns the CRC32 of the marker (the ranks compare it)."""
        verify(folder, self.store.checksum, self.info.rank, self.info.world_size)
        return zlib.crc32((folder / MARKER).read_bytes())

    def _read_checked(self, folder):
        """Everything a resume reads from ``folder`` (verified on every rank before), each value checked before
        it is trusted (the config, the train state, the states, every rank file, the optimizer, the shapes).
        Raises CheckpointDamaged (a problem of the folder) or ConfigError (a refused config change)."""
        applied, saved_yaml = [], None
        if (folder / CONFIG).exists():
            try:
                saved_yaml = (folder / CONFIG).read_text()
                applied = check_resume_config(saved_yaml, public_dict(self.cfg), self.cfg.experiment.allow_config_change,
                                              folder)
            except ConfigError:
                raise
            except Exception as e:  # an unreadable or garbled config.yaml (of an older checkpoint: no checksums)
                first = (str(e).splitlines() or [type(e).__name__])[0][:200]
                raise CheckpointDamaged(folder / CONFIG, f"cannot be read as YAML ({first})") from None
        shared, _, train_state = Checkpointer.load(folder, self.info.rank)
        ranks = Checkpointer.rank_states(folder)
        self._drop_optimizer = self._optimizer_changed(folder, shared, saved_yaml)
        self.model.check_shapes(folder, shared, self.stateful, optimizer=not self._drop_optimizer)
        return shared, ranks, train_state, applied

    def _optimizer_changed(self, folder, shared, saved_yaml) -> bool:
        """Whether the checkpoint's optimizer state is another optimizer's (``model_state.optimizer_change``):
        refused (a ConfigError naming the change) unless experiment.allow_config_change, which drops it
        with a warning (the moments restart; the weights, EMA, schedule and data position are kept)."""
        change = self.model.optimizer_change(folder, shared, saved_optimizer_name(saved_yaml),
                                             self.cfg.optimizer.name)
        if change is None:
            return False
        if not self.cfg.experiment.allow_config_change:
            raise ConfigError(f"checkpoint {folder} cannot resume this run's optimizer: {change}. Resume with the "
                              "optimizer it was written with, or set experiment.allow_config_change=true to drop its "
                              "optimizer state (the optimizer's moments restart; weights, EMA and schedule are kept)")
        if self.info.is_main:
            log.warning("experiment.allow_config_change: the optimizer state of %s is dropped (%s): the optimizer's "
                        "moments restart from zero; the weights, EMA, LR schedule and data position are resumed",
                        folder.name, change)
        return True

    def _resume_data_and_rng(self, latest) -> None:
        """The data position of every saved rank (on another layout each canonical reader's goes to its new
        owner), this rank's RNG when the rank count is unchanged, and one line when the layout changed."""
        ranks = self._rank_states or Checkpointer.rank_states(latest)
        self._rank_states = None
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


def _broadcast(obj):
    """Rank 0's ``obj`` on every rank (itself in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    """Every rank's ``obj``, in rank order."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
