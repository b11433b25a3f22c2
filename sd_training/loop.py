"""The Trainer: set-up, the step loop and the step. What it delegates: the run folder (``run_dir``), the
model and optimizer parts (``build``), checkpoints (``checkpoint.CheckpointManager``), exports, samples
and validation (``outputs.RunOutputs``), metrics (``metrics.StepMetrics``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from . import distributed
from .distributed import heartbeat
from .run import preemption, progress
from .build import build_model, build_optimizer_parts
from .checkpoint import CheckpointManager, ModelState, complete_steps
from .checkpoint.layout import GRAD_SCALER, LR_SCHEDULER
from .config import ConfigError
from .config.loading import public_dict, to_yaml
from .config.schema import SHARDED_STRATEGIES, TrainConfig
from .data import build_train_loader
from .outputs.metrics import LogWindow, StepMetrics
from .optim import clip_gradients
from .outputs.run_outputs import RunOutputs, validation_batches
from .speed.precision import autocast
from .run.preemption import StopFlag, requeue_job, under_slurm
from .run.run_dir import RunDir, release_run_folder
from .outputs.trackers import build_trackers
from .run.train_state import NonFiniteLossError, Plan, TrainState
from .run.step_guards import StepGuards

log = logging.getLogger(__name__)
WRITER_WAIT_S = 15.0  # a failed run waits this long for the checkpoint in flight (inside preemption.FAILED_EXIT_S)


def main(cfg: TrainConfig, stop: StopFlag | None = None, prepare: Callable | None = None) -> dict:
    """Train as configured; returns a summary (final step, paths). Tests call this directly.

    ``stop``: a flag installed by the entry point before set-up (else installed here). ``prepare(info)``:
    called on every rank once the process group is up, before anything is built (generated inputs)."""
    d = cfg.distributed
    info = distributed.setup(cfg.system.device, d.dist_backend, d.dist_url, d.timeout_minutes,
                             one_rank_group=d.strategy in SHARDED_STRATEGIES,
                             hsdp_shard=d.hsdp_shard_size if d.strategy == "hsdp" else None)
    failed = True
    try:
        # From here a peer that dies or stops unnoticed ends this rank with PEER_LOST_EXIT (75) for a requeue.
        with heartbeat.watching(d.peer_timeout_s, info.rank, info.world_size, cfg.experiment.requeue) as follow:
            if prepare is not None:
                prepare(info)
            trainer = Trainer(cfg, info)
            follow(lambda: trainer.state.step)
            summary = trainer.run(stop)  # a failure in it arms the exit deadline (train.py's processes)
        failed = False
        return summary
    finally:
        distributed.teardown(failed=failed)


class Trainer:
    def __init__(self, cfg: TrainConfig, info: distributed.DistInfo):
        self.cfg, self.info = cfg, info
        self.device = info.device
        distributed.configure_math(self.device, cfg.system.tf32)  # also for Trainers built by tests and benchmarks
        self.plan = Plan.make(cfg, info.world_size)
        self.run_dir = RunDir(cfg.experiment.log_dir, cfg.experiment.name)
        self.state = TrainState(global_batch=self.plan.global_batch)
        self.bar = None  # the live progress bar (rank 0, interactive terminals)
        self.trackers = self.outputs = None
        self._lock = None
        self._side_times: dict[str, float] = {}  # seconds of saves and exports since the last log line

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Run folder, model, optimizer, data, checkpoints (resume), trackers and outputs, in that order."""
        cfg, info = self.cfg, self.info
        self._prepare_run_folder()
        parts = build_model(cfg, info, self.plan, self.run_dir)
        self.family, self.net, self.ema, self.strategy = parts.family, parts.net, parts.ema, parts.strategy
        self.model, self.autocast_dtype, self.scaler = parts.model, parts.autocast_dtype, parts.scaler
        self.models, self.net_name = self.family.models, self.family.net_name
        opt = build_optimizer_parts(cfg, info, self.plan, parts)
        self.optimizer, self.lr_scheduler = opt.optimizer, opt.lr_scheduler
        self.encoders, self.encoder_models, self.device_side_skip = opt.encoders, opt.encoder_models, opt.device_side_skip
        self.guards = StepGuards(self.device, cfg.experiment.max_zero_weight_steps, cfg.dataset.params)  # skipped steps
        self.loader = build_train_loader(cfg.dataset, tokenizer=self.family.tokenizers, rank=info.rank,
                                         world_size=info.world_size, seed=cfg.system.seed)
        self.checkpoints = CheckpointManager(
            cfg, self.run_dir, info, self.plan, self.state,
            ModelState(self.strategy, self.net, self.net_name, self.optimizer, self.ema),
            {LR_SCHEDULER: self.lr_scheduler, GRAD_SCALER: self.scaler, **self.encoders}, self.lr_scheduler,
            self.loader)
        self.checkpoints.check_disk()
        self.family.check_data(self.loader)
        val_batches = validation_batches(cfg, self.family, info) if cfg.validation.path else None
        if cfg.experiment.resume:
            self.checkpoints.resume()
        if info.is_main:
            self.trackers = build_trackers(cfg, self.run_dir, self.state.wandb_id, public_dict(cfg))
            self.state.wandb_id = self.trackers.wandb_id
        self.outputs = RunOutputs(cfg, self.family, self.strategy, self.run_dir, info, self.trackers,
                                  self.autocast_dtype, val_batches, self.state, self.optimizer)
        self.metrics = StepMetrics(cfg, self.family, self.plan, info, self.trackers, self.autocast_dtype)

    def _prepare_run_folder(self) -> None:
        """One run per folder (locked); the config written; logging to train.log; interrupted exports repaired."""
        cfg, info, run_dir = self.cfg, self.info, self.run_dir
        refused = None
        if info.is_main:
            try:  # an earlier run's checkpoints are continued or moved aside, never mixed in
                self._lock = run_dir.lock()
                run_dir.refuse_or_move_aside(complete_steps(run_dir.checkpoints), cfg.experiment.resume,
                                             cfg.experiment.start_fresh)
            except ConfigError as e:
                refused = e
        if distributed.any_rank(refused is not None, self.device):
            raise refused or ConfigError(f"rank 0 refused the run folder {run_dir.root} (its error says why)")
        if info.is_main:
            run_dir.create()
            run_dir.config.write_text(to_yaml(cfg))
        distributed.barrier()
        run_dir.setup_logging(info.rank)  # (rank 0: says so if the lock's last holder died holding it)
        if info.is_main:
            for path in run_dir.repair_exports():
                log.warning("restored %s from the previous export (a kill interrupted its replacement)", path)
        cpus = distributed.usable_cpus()
        log.info("launcher=%s world_size=%d device=%s cpus=%d global_batch=%d total_steps=%d%s", info.launcher,
                 info.world_size, self.device, cpus, self.plan.global_batch, self.plan.total_steps, self.plan.note)
        distributed.warn_starved_loader(cpus, cfg.system.workers, self.device)

    # ---- the step (public): after setup(), plan.accumulation micro_steps (sync on the last), optimizer_step
    def micro_step(self, batch: dict, sync: bool):
        """Forward (the family's loss) and backward of one micro-batch; gradients are all-reduced only
        when ``sync``. Returns the family's ``LossOut``. A batch may carry fixed ``noise`` / ``timesteps``
        (tests compare runs at the same ones); else they are drawn."""
        fixed = {k: batch[k].to(self.device) for k in ("noise", "timesteps") if k in batch}
        with contextlib.ExitStack() as no_sync:
            no_sync.enter_context(self.strategy.sync_context(self.model, sync))
            if not sync:
                for wrapped in self.encoder_models.values():
                    if hasattr(wrapped, "no_sync"):  # DDP
                        no_sync.enter_context(wrapped.no_sync())
            out = self.family.loss(self.model, batch, autocast(self.device, self.autocast_dtype), fixed or None)
            self.scaler.scale(out.loss / self.plan.accumulation).backward()
        return out

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step, schedule, EMA. A non-finite or zero gradient norm skips the update (``run.step_guards``).

        With a fused optimizer (the CUDA default) the skip happens on the device: the optimizer gets the
        non-finite flag as its ``found_inf`` (as GradScaler does) and the counters stay device tensors,
        read at log time, so the step never waits for the host. Other optimizers read the flag on the
        host (one scalar per step; free on the CPU)."""
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.optimizer, self.cfg.optimizer.params.max_grad_norm)  # (in_backward: its norm)
        # The gradients are already all-reduced, so every rank sees the same norm and takes the same branch.
        bad, zero = self.guards.count(grad_norm)  # zero: no sample had loss weight; an update would only decay
        if self.scaler.is_enabled():
            # fp16 loss scaling: an overflow is the scaler's to skip (and lower the scale); it reads on the host.
            if not bool(zero):
                self.scaler.step(self.optimizer)
            self.scaler.update()
        elif self.device_side_skip:
            self.optimizer.found_inf = (bad | zero).float()
            self.optimizer.step()
            self.optimizer.found_inf = None
        elif not bool(bad | zero):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        if self.ema is not None:
            # After a skipped step the weights are unchanged: the EMA moves towards the last good weights.
            self.ema.update(self.net, self.state.step + 1)
        return grad_norm

    # ------------------------------------------------------------------ the loop
    def run(self, stop: StopFlag | None = None) -> dict:
        stop = stop if stop is not None else StopFlag().install()
        stop.set_timeout(self.cfg.system.stop_timeout_s)
        failed = False
        try:
            self.setup()
            return self._loop(stop)
        except BaseException as e:
            # From here the process has preemption.FAILED_EXIT_S to end (when train.py runs it).
            failed = True
            preemption.failed(e)
            if self.outputs is not None and not isinstance(e, (KeyboardInterrupt, ConfigError)):  # in train.log too
                log.exception("training failed at step %d: %s", self.state.step, e)
            raise
        finally:
            stop.uninstall()
            self._shut_down(stop_now=failed or stop.requested, failed=failed)

    def _shut_down(self, stop_now: bool, failed: bool) -> None:
        """Each step on its own (one that raises is logged and the rest run); after a failure or a signal the
        evaluator is stopped, not waited for, and the checkpoint in flight gets WRITER_WAIT_S at most (a rank
        that died before writing its file would keep rank 0's writer waiting)."""
        data_iter, lock, self._data_iter, self._lock = getattr(self, "_data_iter", None), self._lock, None, None
        writer = [("waiting for the checkpoint writer", lambda: preemption.within(WRITER_WAIT_S, self.checkpoints.wait,
                   "the checkpoint in flight (it stays incomplete, ignored on resume; the previous one is intact)"))]
        preemption.shut_down([
            ("stopping the loader workers", lambda: data_iter is not None and data_iter.close()),
            ("closing the background evaluator", lambda: self.outputs and self.outputs.close(self.state.step, stop_now)),
            ("closing the trackers (metrics.jsonl, wandb, tensorboard)", lambda: self.trackers and self.trackers.close()),
            *(writer if failed and getattr(self, "checkpoints", None) is not None else []),
            ("releasing the run folder's lock", lambda: release_run_folder(lock)),  # empties its holder line
        ], failed)

    def _loop(self, stop: StopFlag) -> dict:
        cfg, state = self.cfg, self.state
        stopped_by = None
        if distributed.any_rank(stop.requested, self.device):
            # Asked to stop during set-up: nothing new to save; requeue (under SLURM) without training.
            stopped_by = stop.signal_name or "signal on another rank"
            log.warning("stop requested during set-up (%s): not training; the state at step %d stands",
                        stopped_by, state.step)
        elif self.outputs.val_batches is not None and state.step == 0:
            self.outputs.validate(0, self.model)  # the untrained model's figure, to compare with
        self.keys_file = (self.run_dir.open_sample_keys(self.info.rank, self.info.world_size, state.step)
                          if cfg.experiment.record_sample_keys else None)
        if self.info.is_main and not stopped_by and progress.wanted(cfg.experiment.progress_bar):
            self.bar = progress.ProgressBar(self.plan.total_steps, state.step, self.plan.global_batch)
        try:
            if not stopped_by:
                stopped_by = self._steps(stop)
            return self._finish(stopped_by)
        finally:
            if self.bar is not None:
                self.bar.close()
            if self.keys_file is not None:
                self.keys_file.file.close()

    def _steps(self, stop: StopFlag) -> str | None:
        """Optimizer steps to the end, or to a stop signal (returns its name after saving)."""
        cfg, plan, state = self.cfg, self.plan, self.state
        data_iter, window, last_ckpt_time = iter(self.loader), LogWindow(), time.time()
        self._data_iter = data_iter  # closed by _shut_down (its workers), whatever ends the loop
        val_every = cfg.validation.every or cfg.experiment.save_every
        while state.step < plan.total_steps:
            t_step, keys = time.perf_counter(), []
            for micro in range(plan.accumulation):
                t_data = time.perf_counter()
                batch = next(data_iter)
                window.data_time += time.perf_counter() - t_data
                self.guards.see_batch(batch, state.step + 1)
                keys += batch.get("keys", [])
                out = self.micro_step(batch, sync=(micro == plan.accumulation - 1))
                window.add_loss(out.loss.detach(), out.per_sample, out.timesteps, self.family.num_timesteps)
                if out.parts:
                    window.add_parts(out.parts)
            window.grad_norm = self.optimizer_step()
            state.step += 1
            state.images_seen += plan.global_batch
            window.step_time += time.perf_counter() - t_step
            window.steps += 1
            if self.keys_file is not None:
                self.keys_file.write(state.step, keys)
            if self.bar is not None:
                self.bar.step()

            last = state.step >= plan.total_steps
            logging_now = state.step % cfg.experiment.log_every == 0 or last
            # What needs the host (a sync point) happens only every distributed.flag_sync_every steps, at
            # log lines and at the end, at the same steps on every rank: the non-finite counters, and the
            # ranks' agreement to stop (a signal) or to save (save_every_minutes).
            check = logging_now or state.step % cfg.distributed.flag_sync_every == 0
            stop_now = timed = False
            if check:
                self._check_nonfinite(window)
                self.guards.check(state.step, before_stop=lambda: self._log(window))  # zero-gradient steps
                minutes = cfg.experiment.save_every_minutes
                timed = distributed.any_rank(minutes is not None and time.time() - last_ckpt_time >= minutes * 60,
                                             self.device)
                stop_now = distributed.any_rank(stop.requested, self.device)
            if logging_now:
                self._log(window)
                window = LogWindow()
            # Saves and exports are timed apart from the steps (step_time, images/s and MFU exclude them);
            # the next log line carries their times since the previous one.
            if stop_now or timed or last or state.step % plan.checkpoint_every == 0:
                self.checkpoints.save()
                last_ckpt_time = time.time()
                self._add_side_time("time/checkpoint_stall_s", self.checkpoints.last_stall_s)
            if self.outputs.val_batches is not None and (last or state.step % val_every == 0):
                self.outputs.validate(state.step, self.model)
            if last or state.step % cfg.experiment.save_every == 0:
                self._export()
            if stop_now:
                return stop.signal_name or "signal on another rank"
        return None

    def _finish(self, stopped_by: str | None) -> dict:
        """The last export if a kill skipped it, the last checkpoint on disk, a requeue when stopped."""
        state = self.state
        if not stopped_by and state.last_export_step < state.step:
            # Resumed from a checkpoint written at the last step but killed before its export finished.
            self._export()
        self.checkpoints.wait()  # the last checkpoint is on disk before a requeue or the end
        requeued = False
        if stopped_by:
            log.warning("stopped at step %d by %s after saving", state.step, stopped_by)
            if self.info.is_main and self.cfg.experiment.requeue and under_slurm() and stopped_by != "SIGINT":
                requeued = requeue_job()
            requeued = distributed.any_rank(requeued, self.device)  # rank 0's outcome, on every rank
            if not requeued:
                log.warning("stopped early at step %d of %d and not requeued: exit code 75; run the same command "
                            "to resume", state.step, self.plan.total_steps)
        return {"step": state.step, "total_steps": self.plan.total_steps, "images_seen": state.images_seen,
                "stopped_by": stopped_by, "requeued": requeued, "run_dir": str(self.run_dir.root)}

    def _export(self) -> None:
        t_export = time.perf_counter()
        self.outputs.export(self.state.step, self.net, self.ema)
        self.state.last_export_step = self.state.step
        took = time.perf_counter() - t_export
        self._add_side_time("time/export_s", took)
        log.info("step %d: exports, sample grid and eval images took %.1fs", self.state.step, took)

    def _add_side_time(self, key: str, seconds: float) -> None:
        self._side_times[key] = self._side_times.get(key, 0.0) + seconds

    def _log(self, window: LogWindow) -> None:
        self.metrics.log(window, self.state, self.lr_scheduler.get_last_lr()[0], self._side_times,
                         self.loader.stats() if hasattr(self.loader, "stats") else {},
                         self.ema.current_decay() if self.ema is not None else None, self.bar)
        self._side_times = {}
        if self.info.is_main:
            self.outputs.log_eval_results(self.state.step)

    def _check_nonfinite(self, window: LogWindow) -> None:
        """Read the device-side counters of skipped (non-finite) steps; after too many in a row, save the last
        good weights (skipped steps never changed them) and stop with advice."""
        skipped = int(self.guards.nonfinite_total)
        if skipped:
            self.state.nonfinite_steps += skipped
            self.guards.nonfinite_total.zero_()
            log.warning("%d optimizer step(s) up to step %d had a non-finite gradient norm: their updates were "
                        "skipped (%d in a row now)", skipped, self.state.step, int(self.guards.nonfinite_streak))
        if int(self.guards.nonfinite_streak) < self.cfg.experiment.max_nonfinite_steps:
            return
        self._log(window)
        self.checkpoints.save()
        self.checkpoints.wait()
        raise NonFiniteLossError(
            f"{int(self.guards.nonfinite_streak)} consecutive optimizer steps up to step {self.state.step} had a "
            f"non-finite loss or gradient (last loss {float(window.last_loss):.4g}); the updates were skipped and "
            f"the last good state is saved in {self.run_dir.checkpoints}. Try: a lower optimizer.params.learning_rate "
            "or a longer lr_scheduler.params.warmup_length; optimizer.params.max_grad_norm (clipping); "
            "model.mixed_precision=bf16 instead of fp16; model.vae.dtype=fp32; or look for bad samples in the data"
        )
