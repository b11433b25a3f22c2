"""The Trainer: set-up, the step loop, logging and checkpoints. Its outputs (exports, samples, eval) are in
``outputs.py``, its small state types in ``train_state.py``; everything else is built by the modules it calls."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch

from . import distributed, families, progress, quickstart
from .checkpoint import Checkpointer, check_writable, complete_steps, rng_state, set_rng_state
from .config import ConfigError, TrainConfig, public_dict, to_yaml
from .data import build_train_loader
from .ema import EMA, decay_from_strength
from .flops import mfu, peak_flops
from .loading import load_component
from .memory_plan import as_dicts, format_plan, memory_plan
from .models import component_sources
from .optim import build_lr_scheduler, build_optimizer, lr_scale, param_groups
from .outputs import RunOutputs
from .parallel import Strategy
from .precision import autocast_dtype
from .preemption import StopFlag, requeue_job, under_slurm
from .progress import PROGRESS
from .reshard import load_model_state
from .run_dir import RunDir, repair_swaps
from .run_guard import check_resume_config, cut_metrics_back, lock_run_folder, prepare_fresh_start
from .trackers import build_trackers
from .train_state import EMAMeta, LogWindow, NonFiniteLossError, Plan, TrainState, hms, seed_everything

log = logging.getLogger(__name__)

def main(cfg: TrainConfig, stop: StopFlag | None = None) -> dict:
    """Train as configured; returns a summary (final step, paths). Tests call this directly.

    ``stop``: a flag installed by the entry point before set-up (else installed here)."""
    info = distributed.setup(
        cfg.system.device, cfg.distributed.dist_backend, cfg.distributed.dist_url, cfg.distributed.timeout_minutes
    )
    try:
        return Trainer(cfg, info).run(stop)
    finally:
        distributed.teardown()


class Trainer(RunOutputs):
    def __init__(self, cfg: TrainConfig, info: distributed.DistInfo):
        self.cfg, self.info = cfg, info
        self.device = info.device
        distributed.configure_math(self.device, cfg.system.tf32)  # also for Trainers built by tests and benchmarks
        self.plan = Plan.make(cfg, info.world_size)
        self.run_dir = RunDir(cfg.experiment.log_dir, cfg.experiment.name)
        self.state = TrainState(global_batch=self.plan.global_batch)
        self.config_yaml = to_yaml(cfg)
        self.bar = None  # the live progress bar (rank 0, interactive terminals)
        self._side_times: dict[str, float] = {}  # seconds of saves and exports since the last log line

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        """Run folder, model family, EMA, strategy, optimizer, data, resume and trackers, in that order."""
        self._prepare_run_folder()
        self._build_model()
        self._build_optimizer()
        self._build_data()
        self.evaluator = None
        if self.cfg.experiment.resume:
            self._maybe_resume()
        self.trackers = None
        if self.info.is_main:
            self.trackers = build_trackers(
                self.cfg, self.run_dir.root, self.run_dir.metrics, self.state.wandb_id, public_dict(self.cfg)
            )
            self.state.wandb_id = self.trackers.wandb_id

    def _prepare_run_folder(self) -> None:
        """One run per folder (locked); the config written; logging to train.log; interrupted exports repaired."""
        cfg, info = self.cfg, self.info
        refused = None
        if info.is_main:
            try:  # one run per folder; an earlier run's checkpoints are continued or moved aside, never mixed in
                self._lock = lock_run_folder(self.run_dir.root)
                prepare_fresh_start(self.run_dir.root, complete_steps(self.run_dir.checkpoints),
                                    cfg.experiment.resume, cfg.experiment.start_fresh)
            except ConfigError as e:
                refused = e
        if distributed.any_rank(refused is not None, self.device):
            raise refused or ConfigError(f"rank 0 refused the run folder {self.run_dir.root} (its error says why)")
        if info.is_main:
            self.run_dir.create()
            (self.run_dir.root / "config.yaml").write_text(self.config_yaml)
        distributed.barrier()
        self.run_dir.setup_logging(info.rank)
        if info.is_main:
            for path in repair_swaps(self.run_dir.root, self.run_dir.root / "pipelines"):
                log.warning("restored %s from the previous export (a kill interrupted its replacement)", path)
        cpus = distributed.usable_cpus()
        log.info(
            "launcher=%s world_size=%d device=%s cpus=%d global_batch=%d total_steps=%d",
            info.launcher, info.world_size, self.device, cpus, self.plan.global_batch, self.plan.total_steps,
        )
        if cfg.system.workers + 1 > cpus:
            log.warning(
                "this process may run on %d CPU(s) but starts %d loader worker(s) besides the trainer: the loader "
                "will starve the %s. Give each task more CPUs (SLURM: --cpus-per-task, which srun since 22.05 "
                "only applies with SRUN_CPUS_PER_TASK exported, as batch_files/ do) or lower system.workers",
                cpus, cfg.system.workers, self.device.type.upper() if self.device.type == "cuda" else "step")

    def _build_model(self) -> None:
        """The family's components (seeded), init_from, the EMA, the precision and the strategy's wrapper."""
        cfg, info = self.cfg, self.info
        # Per-rank seed: different noise and timesteps on every rank, reproducible across restarts.
        quickstart.prepare(cfg.quickstart, info.is_main)
        # Seeded after the generated inputs: building them (on the first run only) must not move the
        # training RNG, or a first run and a rerun of the same config would train differently.
        seed_everything(cfg.system.seed + info.rank)
        self.family = families.create(cfg, self.device, cfg.system.seed, info.is_main)
        self.models = self.family.models
        if info.is_main:  # the run directory says where its components came from
            sources = component_sources(cfg.model)
            (self.run_dir.root / "sources.json").write_text(json.dumps(sources, indent=1) + "\n")
            for name, entry in sources.items():
                if "provenance" in entry:
                    log.info("%s from %s: %s", name, entry["source"], entry["provenance"].get("what", "see sources.json"))
        self.net_name = self.family.net_name  # the trained module's name in checkpoints
        self.net = self.family.net
        if cfg.model.init_from:
            self._init_from(cfg.model.init_from)
        self.ema = None
        if cfg.model.use_ema:
            e = cfg.model.ema
            decay = e.decay
            if e.strength_target is not None:
                decay = decay_from_strength(e.strength_target, self.plan.total_steps, e.update_every)
                log.info("EMA decay %.8f derived from model.ema.strength_target=%s", decay, e.strength_target)
            ema_device = torch.device("cpu") if e.device == "cpu" else self.device
            self.ema = EMA(self.net, decay, e.update_every, e.start_step, e.warmup, ema_device)
            if e.path:
                src = load_component(type(self.net).from_pretrained, e.path, self.net_name, "model.ema.path")
                self.ema.load_weights(src)
        mp = cfg.model.mixed_precision
        self.autocast_dtype = autocast_dtype(mp)
        # fp16 needs loss scaling (its range underflows small gradients); bf16 does not.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=(mp == "fp16"))
        # Only the trained UNet (and its EMA) is wrapped; the frozen VAE and text encoder never are.
        self.strategy = Strategy(cfg.distributed.strategy, info.is_distributed, self.device, self.autocast_dtype,
                                 cfg.distributed)
        self._log_memory_plan()
        self.model = self.strategy.wrap(self.family.loss_module, self.ema.shadow if self.ema is not None else None,
                                        self.family.shard_units)
        if cfg.model.compile:
            # The compiled wrapper is only called; weights are always read from self.net (no _orig_mod keys).
            self.model = torch.compile(self.model)

    def _build_optimizer(self) -> None:
        """Parameter groups (after wrapping: FSDP2 has replaced the parameters by sharded DTensors), trained
        encoders under DDP, the optimizer, the LR schedule and the non-finite counters."""
        cfg, info = self.cfg, self.info
        o = cfg.optimizer
        self.peak_lr = o.params.learning_rate * lr_scale(o, self.plan.global_batch)
        if o.scale_lr:
            log.info("optimizer.scale_lr: peak LR %.3g = %.3g x (global batch %d)^0.55",
                     self.peak_lr, o.params.learning_rate, self.plan.global_batch)
        groups = param_groups(self.net, o.params.weight_decay, o.no_decay_norm_and_bias)
        groups += self.family.extra_param_groups(self.peak_lr, lr_scale(o, self.plan.global_batch))
        # Encoders trained with the net (a text encoder) are replicated with plain DDP, never sharded.
        self.encoders = self.family.trained_encoders()
        self.encoder_models = dict(self.encoders)
        if info.is_distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.encoder_models = {name: torch.nn.parallel.DistributedDataParallel(m, device_ids=ids)
                                   for name, m in self.encoders.items()}
        self.family.use_wrapped_encoders(self.encoder_models)
        self.optimizer = build_optimizer(groups, o, self.strategy.optimizer_device, self.peak_lr)
        # A fused optimizer takes the non-finite flag as a device tensor: no host sync per step.
        self.device_side_skip = bool(getattr(self.optimizer, "_step_supports_amp_scaling", False)) and any(
            g.get("fused") for g in self.optimizer.param_groups)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, self.plan.total_steps)
        self.nonfinite_streak = torch.zeros((), dtype=torch.long, device=self.device)  # consecutive skips
        self.nonfinite_total = torch.zeros((), dtype=torch.long, device=self.device)  # since the last check

    def _build_data(self) -> None:
        """The loader, the checkpointer (the disk checked now), validation batches and the FLOPs per image."""
        cfg, info = self.cfg, self.info
        self.loader = build_train_loader(
            cfg.dataset, tokenizer=self.family.tokenizers, rank=info.rank, world_size=info.world_size, seed=cfg.system.seed
        )
        self.checkpointer = Checkpointer(
            self.run_dir.checkpoints, cfg.experiment.keep_last_checkpoints, cfg.experiment.keep_checkpoint_every,
            asynchronous=cfg.experiment.checkpoint_async, rank_files_timeout_s=60 * cfg.distributed.timeout_minutes,
        )
        # Weights, two AdamW moments, the EMA: found unwritable or nearly full now, not at the first save.
        weight_bytes = sum(p.numel() * 4 for p in self.net.parameters())
        check_writable(self.run_dir.checkpoints, weight_bytes * (3 + (self.ema is not None)))
        self.family.check_data(self.loader)
        self.val_batches = self._validation_batches() if cfg.validation.path else None
        self.peak = None
        self.step_flops = self.family.step_flops()
        if self.step_flops is not None:
            dtype = self.autocast_dtype or torch.float32
            self.peak = peak_flops(self.device, dtype, cfg.experiment.peak_tflops * 1e12 if cfg.experiment.peak_tflops else None)
            log.info("FLOPs per training image: model %.3g, hardware %.3g; device peak %s",
                     self.step_flops.model, self.step_flops.hardware, f"{self.peak:.3g}" if self.peak else "unknown (no MFU)")

    def _log_memory_plan(self) -> None:
        """Per-GPU bytes of the trained and frozen modules under each strategy, before the first step."""
        cfg = self.cfg
        rows = memory_plan(
            self.net, self.family.frozen_modules(), cfg.optimizer.name, self.info.world_size, self.ema is not None,
            cfg.model.ema.device == "cpu", 2 if self.autocast_dtype is not None else 4, self.family.shard_units,
            cfg.distributed.fsdp_unit, replicated=self.family.trained_encoders().values(),
        )
        if self.info.is_main:
            log.info("%s", format_plan(rows, self.strategy.plan_name, self.info.world_size))
            (self.run_dir.root / "memory_plan.json").write_text(json.dumps(
                {"strategy": self.strategy.plan_name, "world_size": self.info.world_size, "rows": as_dicts(rows)},
                indent=1) + "\n")

    def _init_from(self, src: str) -> None:
        """Stage 2: the trained module's weights from another run (dir or checkpoint) or an exported pipeline."""
        path = Path(src)
        want_ema = self.cfg.model.init_weights == "ema"
        ckpt = None
        if (path / "checkpoints").is_dir():
            ckpt = Checkpointer(path / "checkpoints").latest()
            if ckpt is None:
                raise ConfigError(f"'model.init_from': {path}/checkpoints holds no complete checkpoint")
        elif (path / "COMPLETE").exists():
            ckpt = path
        if ckpt is not None:
            if (ckpt / "sharded").is_dir():
                raise ConfigError(f"'model.init_from': {ckpt} is an FSDP checkpoint; use the run's exported pipeline")
            name = "ema" if want_ema and (ckpt / "ema.pt").exists() else self.net_name
            sd = torch.load(ckpt / f"{name}.pt", map_location="cpu", weights_only=True)
            self.net.load_state_dict(sd["shadow"] if name == "ema" else sd)
            log.info("model.init_from: %s (%s weights) from checkpoint %s", self.net_name, name, ckpt)
            return
        folder = path
        if want_ema and path.name == "current_pipeline" and (path.parent / "current_pipeline_ema").is_dir():
            folder = path.parent / "current_pipeline_ema"
        elif (path / "current_pipeline").is_dir():  # a run directory without checkpoints
            folder = path / ("current_pipeline_ema" if want_ema and (path / "current_pipeline_ema").is_dir() else "current_pipeline")
        src_net = load_component(type(self.net).from_pretrained, str(folder), self.net_name, "model.init_from")
        self.net.load_state_dict(src_net.state_dict())
        log.info("model.init_from: %s weights from %s", self.net_name, folder)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def _resumable(self) -> dict:
        """What rank 0 writes as plain files; under FSDP the UNet, EMA and optimizer go to DCP instead (either
        layout resumes under either strategy: reshard.load_model_state)."""
        objs = {"lr_scheduler": self.lr_scheduler, "grad_scaler": self.scaler}
        objs.update(self.encoders)
        if not self.strategy.sharded:
            objs.update({self.net_name: self.net, "optimizer": self.optimizer})
            if self.ema is not None:
                objs["ema"] = self.ema
        elif self.ema is not None:
            objs["ema_meta"] = EMAMeta(self.ema)
        return objs

    def _maybe_resume(self) -> None:
        latest = self.checkpointer.latest()
        if latest is None:
            if self.info.is_main:
                cut_metrics_back(self.run_dir.metrics, 0)  # a run killed before its first checkpoint
            return
        applied = []
        if (latest / "config.yaml").exists():
            applied = check_resume_config((latest / "config.yaml").read_text(), public_dict(self.cfg),
                                          self.cfg.experiment.allow_config_change, latest)
        new_peaks = [g["initial_lr"] for g in self.optimizer.param_groups]
        shared, per_rank, train_state = Checkpointer.load(latest, self.info.rank)
        model_state = {self.net_name, "optimizer", "ema", "ema_meta"}  # in either layout: load_model_state
        for name, obj in self._resumable().items():
            if name in model_state:
                continue
            if name not in shared:
                raise RuntimeError(
                    f"checkpoint {latest} has no '{name}' state: it was written with other settings "
                    "(model.text_encoder.train); resume with those, or start a new run name"
                )
            obj.load_state_dict(shared[name])
        # Written by ddp or fsdp on any number of ranks: converted to this run's strategy and rank count.
        converted = load_model_state(latest, shared, self.strategy, self.net, self.optimizer, self.ema, self.net_name,
                                     self.info.world_size)
        if converted:
            log.info("%s", converted)
        self.state.load_state_dict(train_state)
        self._resume_layout(latest)
        if applied:  # a new learning rate: the schedule continues from this step with the new peaks
            self.lr_scheduler.base_lrs = list(new_peaks)
            factor = self.lr_scheduler.lr_lambdas[0](self.lr_scheduler.last_epoch)
            for g, peak in zip(self.optimizer.param_groups, new_peaks):
                g["initial_lr"], g["lr"] = peak, peak * factor
        if self.info.is_main:
            cut_metrics_back(self.run_dir.metrics, self.state.step)
        log.info("resumed from %s at step %d (%d images seen)", latest, self.state.step, self.state.images_seen)

    def _resume_layout(self, latest: Path) -> None:
        """The data position of every saved rank (on another layout each canonical reader's goes to its new
        owner), this rank's RNG when the rank count is unchanged, and one line when the layout changed."""
        ranks = Checkpointer.rank_states(latest)
        self.loader.load_state_dict([r["data"] for r in ranks])
        if len(ranks) == self.info.world_size:
            set_rng_state(ranks[self.info.rank]["rng"])  # the training step's draws are the samples' own
        p, saved_batch = self.plan, self.state.global_batch
        if self.loader.resumed_from:
            log.info("resumed on %s from a checkpoint of %s (%d canonical readers); global batch %d = %d x %d "
                     "accumulation x %d ranks", self.loader.layout, self.loader.resumed_from, self.loader.plan.readers,
                     p.global_batch, self.cfg.system.batch_size, p.accumulation, self.info.world_size)
        if saved_batch and saved_batch != p.global_batch:
            log.warning("the global batch changes from %d (checkpoint) to %d: set system.global_batch_size=%d to keep "
                        "it whatever the rank count", saved_batch, p.global_batch, saved_batch)
        self.state.global_batch = p.global_batch

    # ------------------------------------------------------------------ loop
    def run(self, stop: StopFlag | None = None) -> dict:
        stop = stop if stop is not None else StopFlag().install()
        self._lock = None
        try:
            self._setup()
        except BaseException:
            self._release_lock()
            raise
        try:
            return self._loop(stop)
        except ConfigError:
            raise
        except BaseException as e:
            if not isinstance(e, KeyboardInterrupt):  # the error in train.log too, not only on the console
                log.exception("training failed at step %d: %s", self.state.step, e)
            raise
        finally:
            stop.uninstall()
            if self.evaluator is not None:
                if stop.requested:
                    self.evaluator.close()  # preempted: do not hold the job for an evaluation
                else:
                    self._log_eval_results(wait=True)
            if self.trackers:
                self.trackers.close()
            self._release_lock()

    def _release_lock(self) -> None:
        if getattr(self, "_lock", None) is not None:
            self._lock.close()  # closing the file releases the flock
            self._lock = None

    def _micro_step(self, batch: dict, sync: bool):
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
            out = self.family.loss(self.model, batch, self._autocast(), fixed or None)
            self.scaler.scale(out.loss / self.plan.accumulation).backward()
        return out

    def _optimizer_step(self) -> torch.Tensor:
        """Clip, step, schedule, EMA. A non-finite gradient norm skips the update (counted).

        With a fused optimizer (the CUDA default) the skip happens on the device: the optimizer gets the
        non-finite flag as its ``found_inf`` (as GradScaler does) and the counters stay device tensors,
        read at log time, so the step never waits for the host. Other optimizers read the flag on the
        host (one scalar per step; free on the CPU)."""
        self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.optimizer.params.max_grad_norm
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        # The gradients are already all-reduced, so every rank sees the same norm and takes the same branch.
        bad = ~torch.isfinite(grad_norm)
        if self.scaler.is_enabled():
            # fp16 loss scaling: an overflow is the scaler's to skip (and lower the scale).
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif self.device_side_skip:
            self.optimizer.found_inf = bad.float()
            self.optimizer.step()
            self.optimizer.found_inf = None
        elif not bool(bad):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        if self.ema is not None:
            # After a skipped step the weights are unchanged: the EMA moves towards the last good weights.
            self.ema.update(self.net, self.state.step + 1)
        bad = bad.long().to(self.nonfinite_total.device, non_blocking=True)  # CPU under FSDP offload
        self.nonfinite_total = self.nonfinite_total + bad
        self.nonfinite_streak = (self.nonfinite_streak + 1) * bad
        return grad_norm

    def _loop(self, stop: StopFlag) -> dict:
        cfg, plan, state = self.cfg, self.plan, self.state
        data_iter = iter(self.loader)
        val_every = cfg.validation.every or cfg.experiment.save_every
        stopped_by = None
        if distributed.any_rank(stop.requested, self.device):
            # Asked to stop during set-up: nothing new to save; requeue (under SLURM) without training.
            stopped_by = stop.signal_name or "signal on another rank"
            log.warning("stop requested during set-up (%s): not training; the state at step %d stands",
                        stopped_by, state.step)
        elif self.val_batches is not None and state.step == 0:
            self._validate()  # the untrained model's figure, to compare with
        window = LogWindow()
        last_ckpt_time = time.time()
        self.keys_file = None
        if cfg.experiment.record_sample_keys:
            path = self.run_dir.sample_keys(self.info.rank)
            path.parent.mkdir(exist_ok=True)
            self.keys_file = open(path, "a", buffering=1)  # a line per step; a resumed run appends
            # Which process wrote a line: a step written twice (killed after it, before its checkpoint) is
            # the later attempt's, the one that started from the newer checkpoint.
            self.keys_attempt = {"rank": self.info.rank, "world_size": self.info.world_size,
                                 "start_step": state.step, "started": time.time()}
        self.bar = None
        if self.info.is_main and not stopped_by and progress.wanted(cfg.experiment.progress_bar):
            self.bar = progress.ProgressBar(plan.total_steps, state.step, plan.global_batch)
        try:
            return self._steps(stop, data_iter, val_every, window, last_ckpt_time, stopped_by)
        finally:
            if self.bar is not None:
                self.bar.close()
            if self.keys_file is not None:
                self.keys_file.close()

    def _steps(self, stop: StopFlag, data_iter, val_every: int, window: "LogWindow", last_ckpt_time: float,
               stopped_by: str | None) -> dict:
        cfg, plan, state = self.cfg, self.plan, self.state
        accum = plan.accumulation
        while state.step < plan.total_steps and not stopped_by:
            t_step = time.perf_counter()
            keys = []
            for micro in range(accum):
                t_data = time.perf_counter()
                batch = next(data_iter)
                window.data_time += time.perf_counter() - t_data
                keys += batch.get("keys", [])
                out = self._micro_step(batch, sync=(micro == accum - 1))
                window.add_loss(out.loss.detach(), out.per_sample, out.timesteps, self.family.num_timesteps)
                if out.parts:
                    window.add_parts(out.parts)
            grad_norm = self._optimizer_step()
            state.step += 1
            if self.keys_file is not None:
                self.keys_file.write(json.dumps({"step": state.step, "keys": keys, **self.keys_attempt}) + "\n")
            if self.bar is not None:
                self.bar.step()
            state.images_seen += plan.global_batch
            window.grad_norm = grad_norm
            window.step_time += time.perf_counter() - t_step
            window.steps += 1

            last = state.step >= plan.total_steps
            logging_now = state.step % cfg.experiment.log_every == 0 or last
            # What needs the host (a sync point) happens only every distributed.flag_sync_every steps, at
            # log lines and at the end, at the same steps on every rank: the non-finite counters, and the
            # ranks' agreement to stop (a signal) or to save (save_every_minutes).
            check = logging_now or state.step % cfg.distributed.flag_sync_every == 0
            if check:
                self._check_nonfinite(window)
            if logging_now:
                self._log(window)
                window = LogWindow()
            stop_now = timed = False
            if check:
                minutes = cfg.experiment.save_every_minutes
                timed = minutes is not None and (time.time() - last_ckpt_time) >= minutes * 60
                stop_now = distributed.any_rank(stop.requested, self.device)
                timed = distributed.any_rank(timed, self.device)
            # Saves and exports are timed apart from the steps (step_time, images/s and MFU exclude them);
            # the next log line carries their times since the previous one.
            side = self._side_times
            if stop_now or timed or last or state.step % plan.checkpoint_every == 0:
                self._save_checkpoint()
                last_ckpt_time = time.time()
                stall = self.checkpointer.last_stall_s
                side["time/checkpoint_stall_s"] = side.get("time/checkpoint_stall_s", 0.0) + stall
            if self.val_batches is not None and (last or state.step % val_every == 0):
                self._validate()
            if last or state.step % cfg.experiment.save_every == 0:
                t_export = time.perf_counter()
                self._export()
                took = time.perf_counter() - t_export
                side["time/export_s"] = side.get("time/export_s", 0.0) + took
                log.info("step %d: exports, sample grid and eval images took %.1fs", state.step, took)
            if stop_now:
                stopped_by = stop.signal_name or "signal on another rank"
                break
        if not stopped_by and state.last_export_step < state.step:
            # Resumed from a checkpoint written at the last step but killed before its export finished.
            self._export()
        self.checkpointer.wait()  # the last checkpoint is on disk before a requeue or the end
        requeued = False
        if stopped_by:
            log.warning("stopped at step %d by %s after saving", state.step, stopped_by)
            if self.info.is_main and cfg.experiment.requeue and under_slurm() and stopped_by != "SIGINT":
                requeued = requeue_job()
            requeued = distributed.any_rank(requeued, self.device)  # rank 0's outcome, on every rank
            if not requeued:
                log.warning("stopped early at step %d of %d and not requeued: exit code 75; run the same command "
                            "to resume", state.step, plan.total_steps)
        return {
            "step": state.step,
            "total_steps": plan.total_steps,
            "images_seen": state.images_seen,
            "stopped_by": stopped_by,
            "requeued": requeued,
            "run_dir": str(self.run_dir.root),
        }

    def _check_nonfinite(self, window: "LogWindow") -> None:
        """Read the device-side counters of skipped (non-finite) steps; stop after too many in a row."""
        skipped = int(self.nonfinite_total)
        if skipped:
            self.state.nonfinite_steps += skipped
            self.nonfinite_total.zero_()
            log.warning("%d optimizer step(s) up to step %d had a non-finite gradient norm: their updates were "
                        "skipped (%d in a row now)", skipped, self.state.step, int(self.nonfinite_streak))
        if int(self.nonfinite_streak) >= self.cfg.experiment.max_nonfinite_steps:
            self._stop_nonfinite(window)

    def _stop_nonfinite(self, window: "LogWindow") -> None:
        """Save the last good weights (skipped steps never changed them) and stop with advice."""
        self._log(window)
        self._save_checkpoint()
        self.checkpointer.wait()
        raise NonFiniteLossError(
            f"{int(self.nonfinite_streak)} consecutive optimizer steps up to step {self.state.step} had a non-finite "
            f"loss or gradient (last loss {float(window.last_loss):.4g}); the updates were skipped and the last good "
            f"state is saved in {self.run_dir.checkpoints}. Try: a lower optimizer.params.learning_rate or a "
            "longer lr_scheduler.params.warmup_length; optimizer.params.max_grad_norm (clipping); "
            "model.mixed_precision=bf16 instead of fp16; model.vae.dtype=fp32; or look for bad samples in the data"
        )

    # ------------------------------------------------------------------ side effects
    def _log(self, w: "LogWindow") -> None:
        loss = distributed.all_reduce_mean(w.loss_sum / max(w.loss_count, 1)).item()
        n_images = w.steps * self.plan.global_batch
        metrics = {"loss": loss, **self._side_times}
        self._side_times.clear()
        if self.family.num_timesteps is not None:
            q = distributed.all_reduce_mean(w.q_sum / w.q_count.clamp(min=1)).tolist()
            metrics.update({f"loss_q{i}": q[i] for i in range(4)})
        for k, v in w.parts.items():  # this rank's mean (the total loss above is the all-rank one)
            metrics[f"{self.family.metric_prefix}{k}"] = float(v) / max(w.parts_count, 1)
        metrics.update({
            "lr": self.lr_scheduler.get_last_lr()[0],
            "grad_norm": float(w.grad_norm),
            "images_seen": self.state.images_seen,
            "images_per_sec": n_images / max(w.step_time, 1e-9),
            "images_per_sec_per_device": n_images / max(w.step_time, 1e-9) / self.info.world_size,
            "step_time": w.step_time / max(w.steps, 1),
            "data_wait_fraction": w.data_time / max(w.step_time, 1e-9),
            "nonfinite_steps": self.state.nonfinite_steps,
        })
        if self.ema is not None:
            metrics["ema_decay"] = self.ema.current_decay()
        if self.step_flops is not None:
            per_device = metrics["images_per_sec_per_device"]
            metrics["model_tflops_per_image"] = self.step_flops.model / 1e12
            if self.peak:
                metrics["mfu"] = mfu(per_device, self.step_flops.model, self.peak)
                metrics["hfu"] = mfu(per_device, self.step_flops.hardware, self.peak)
        if self.device.type == "cuda":
            metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        stats = self.loader.stats() if hasattr(self.loader, "stats") else {}
        for k, v in stats.items():
            if isinstance(v, (int, float)):
                metrics[f"data/{k}"] = v
        if self.info.is_main:
            self.trackers.log(metrics, self.state.step)
            self._log_eval_results()
            eta = (self.plan.total_steps - self.state.step) * metrics["step_time"]
            log.info(
                "step %d/%d loss %.4f lr %.2e grad_norm %.3f %.1f img/s (%.1f/device) data_wait %.0f%% ETA %s",
                self.state.step, self.plan.total_steps, loss, metrics["lr"], metrics["grad_norm"],
                metrics["images_per_sec"], metrics["images_per_sec_per_device"], 100 * metrics["data_wait_fraction"],
                hms(eta), extra={PROGRESS: True},
            )
            if self.bar is not None:
                self.bar.show(loss, metrics["images_per_sec"])

    def _save_checkpoint(self) -> None:
        shared = {name: obj.state_dict() for name, obj in self._resumable().items()} if self.info.is_main else {}
        per_rank = {"rng": rng_state(), "data": self.loader.state_dict()}
        write_sharded = None
        if self.strategy.sharded:
            state = self.strategy.sharded_state(self.net, self.optimizer, self.ema.shadow if self.ema else None)
            save = self.strategy.save_sharded_async if self.checkpointer.asynchronous else self.strategy.save_sharded
            write_sharded = lambda folder: save(state, folder)  # noqa: E731
        self.checkpointer.save(
            self.state.step, shared, per_rank, self.state.state_dict(), self.config_yaml, self.info.rank, write_sharded
        )

