"""TrainState and the training loop. Everything else is built by the modules it calls."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import distributed, families, progress, quickstart
from .checkpoint import Checkpointer, check_writable, complete_steps, rng_state, set_rng_state
from .config import ConfigError, TrainConfig, public_dict, to_yaml
from .data import build_train_loader
from .ema import EMA, decay_from_strength
from .evaluation.async_eval import AsyncEvaluator
from .evaluation.evaluate import EvalSettings, evaluate_images
from .evaluation.fid import image_files
from .export import read_prompts
from .families.base import SampleSettings
from .flops import mfu, peak_flops
from .loading import load_component
from .memory_plan import as_dicts, format_plan, memory_plan
from .models import component_sources
from .optim import build_lr_scheduler, build_optimizer, lr_scale, param_groups
from .parallel import Strategy
from .preemption import StopFlag, requeue_job, under_slurm
from .progress import PROGRESS
from .run_dir import RunDir, copy_dir_atomically, repair_swaps
from .run_guard import check_resume_config, cut_metrics_back, lock_run_folder, prepare_fresh_start
from .trackers import build_trackers

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    images_seen: int = 0  # all ranks together
    wandb_id: str | None = None
    last_export_step: int = -1
    nonfinite_steps: int = 0  # optimizer steps skipped for a non-finite gradient, whole run

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            setattr(self, k, v)


@dataclass
class Plan:
    """Numbers derived once from the config and the world size."""

    global_batch: int
    total_steps: int
    checkpoint_every: int

    @classmethod
    def make(cls, cfg: TrainConfig, world_size: int) -> "Plan":
        gb = cfg.system.batch_size * cfg.system.gradient_accumulation * world_size
        return cls(
            global_batch=gb,
            total_steps=math.ceil(cfg.experiment.num_examples_to_see / gb),
            checkpoint_every=cfg.experiment.checkpoint_every or cfg.experiment.save_every,
        )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


class Trainer:
    def __init__(self, cfg: TrainConfig, info: distributed.DistInfo):
        self.cfg, self.info = cfg, info
        self.device = info.device
        distributed.configure_math(self.device, cfg.system.tf32)  # also for Trainers built by tests and benchmarks
        self.plan = Plan.make(cfg, info.world_size)
        self.run_dir = RunDir(cfg.experiment.log_dir, cfg.experiment.name)
        self.state = TrainState()
        self.config_yaml = to_yaml(cfg)
        self.bar = None  # the live progress bar (rank 0, interactive terminals)
        self._side_times: dict[str, float] = {}  # seconds of saves and exports since the last log line

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
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
        log.info(
            "launcher=%s world_size=%d device=%s global_batch=%d total_steps=%d",
            info.launcher, info.world_size, self.device, self.plan.global_batch, self.plan.total_steps,
        )
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
        self.autocast_dtype = AUTOCAST_DTYPES.get(mp)
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
        # After wrapping: FSDP2 replaces the parameters by sharded DTensors.
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
        self.evaluator = None
        if cfg.experiment.resume:
            self._maybe_resume()
        self.trackers = None
        if info.is_main:
            self.trackers = build_trackers(
                cfg, self.run_dir.root, self.run_dir.metrics, self.state.wandb_id, public_dict(cfg)
            )
            self.state.wandb_id = self.trackers.wandb_id

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

    def _validation_batches(self) -> list[dict]:
        """The first ``validation.num_batches`` batches of this rank's part of the held-out shards, made
        deterministic by the family (fixed latents, noise, timesteps; no augmentation, no caption dropout)."""
        v, d = self.cfg.validation, self.cfg.dataset
        params = dataclasses.replace(d.params, path=v.path, workers=0, resampled=False, caption_dropout=0.0,
                                     random_flip=0.0, center_crop=True, num_examples_to_see=None)
        loader = build_train_loader(dataclasses.replace(d, params=params), tokenizer=self.family.tokenizers,
                                    rank=self.info.rank, world_size=self.info.world_size, seed=v.seed)
        it = iter(loader)
        g = torch.Generator().manual_seed(v.seed + self.info.rank)
        return [self.family.validation_batch(next(it), g, i) for i in range(v.num_batches)]

    @torch.no_grad()
    def _validate(self) -> None:
        """Held-out loss at fixed noise and timesteps (all ranks; the mean over ranks is logged)."""
        model = self.family.loss_module
        model.eval()
        total = torch.zeros((), device=self.device)
        try:
            for b in self.val_batches:
                fixed = {k: b[k].to(self.device) for k in ("noise", "timesteps") if k in b}
                total += self.family.loss(self.model, b, self._autocast(), fixed, validation=True).loss.float()
        finally:
            model.train()
        val = distributed.all_reduce_mean(total / len(self.val_batches)).item()
        if self.info.is_main:
            self.trackers.log({"val/loss": val}, self.state.step)
            log.info("step %d validation loss %.5f", self.state.step, val)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def _eval_settings(self):
        ev = self.cfg.evaluation
        if not (ev.ref_stats or ev.ref_images or ev.clip_model):
            return None
        return EvalSettings(prompts=self.cfg.experiment.eval_caption_file, ref_stats=ev.ref_stats, ref_images=ev.ref_images,
                            ref_max_images=ev.ref_max_images, clip_model=ev.clip_model, clip_pretrained=ev.clip_pretrained,
                            clip_config=ev.clip_config, device=ev.device)

    def _score_eval_images(self, folder: Path) -> None:
        """FID / CLIP score of the eval images: in a background process on rank 0 (asynchronous), or
        here, split across ranks (every rank passes the same file list)."""
        settings = self._eval_settings()
        if settings is None:
            return
        if self.cfg.evaluation.asynchronous:
            if self.info.is_main:
                if self.evaluator is None:
                    self.evaluator = AsyncEvaluator(self.run_dir.root / "eval" / "results", settings, threads=self.cfg.evaluation.threads)
                self.evaluator.submit(self.state.step, images=folder)
            return
        result = evaluate_images(image_files(folder), settings)
        if self.info.is_main:
            self.trackers.log({**result, "eval/step": self.state.step}, self.state.step)
            log.info("step %d evaluation %s", self.state.step, result)

    def _log_eval_results(self, wait: bool = False) -> None:
        """Results of background evaluations, logged with the step they belong to."""
        if self.evaluator is None:
            return
        for r in (self.evaluator.wait() if wait else self.evaluator.poll()):
            step = r.pop("step", self.state.step)
            if "error" in r:
                log.error("evaluation of step %s failed: %s", step, r["error"])
                continue
            # Logged now (trackers such as wandb refuse a step lower than their current one), tagged
            # with the step whose weights were evaluated.
            self.trackers.log({**{k: v for k, v in r.items() if k.startswith("eval/")}, "eval/step": step}, self.state.step)
            log.info("step %s evaluation %s", step, r)

    def _resumable(self) -> dict:
        """What rank 0 writes as plain files; under FSDP the UNet, EMA and optimizer go to DCP instead."""
        objs = {"lr_scheduler": self.lr_scheduler, "grad_scaler": self.scaler}
        objs.update(self.encoders)
        if not self.strategy.sharded:
            objs.update({self.net_name: self.net, "optimizer": self.optimizer})
            if self.ema is not None:
                objs["ema"] = self.ema
        elif self.ema is not None:
            objs["ema_meta"] = _EMAMeta(self.ema)
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
        for name, obj in self._resumable().items():
            if name not in shared:
                raise RuntimeError(
                    f"checkpoint {latest} has no '{name}' state: it was written with other settings "
                    "(model.use_ema, distributed.strategy); resume with those, or start a new run name"
                )
            obj.load_state_dict(shared[name])
        if self.strategy.sharded:
            if not (latest / "sharded").is_dir():
                raise RuntimeError(f"checkpoint {latest} was not written by distributed.strategy=fsdp (no sharded/)")
            self.strategy.load_sharded(latest / "sharded", self.net, self.optimizer, self.ema.shadow if self.ema else None)
        self.state.load_state_dict(train_state)
        self.loader.load_state_dict(per_rank["data"])
        set_rng_state(per_rank["rng"])
        if applied:  # a new learning rate: the schedule continues from this step with the new peaks
            self.lr_scheduler.base_lrs = list(new_peaks)
            factor = self.lr_scheduler.lr_lambdas[0](self.lr_scheduler.last_epoch)
            for g, peak in zip(self.optimizer.param_groups, new_peaks):
                g["initial_lr"], g["lr"] = peak, peak * factor
        if self.info.is_main:
            cut_metrics_back(self.run_dir.metrics, self.state.step)
        log.info("resumed from %s at step %d (%d images seen)", latest, self.state.step, self.state.images_seen)

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
            self.scaler.scale(out.loss / self.cfg.system.gradient_accumulation).backward()
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
        window = _Window()
        last_ckpt_time = time.time()
        self.bar = None
        if self.info.is_main and not stopped_by and progress.wanted(cfg.experiment.progress_bar):
            self.bar = progress.ProgressBar(plan.total_steps, state.step, plan.global_batch)
        try:
            return self._steps(stop, data_iter, val_every, window, last_ckpt_time, stopped_by)
        finally:
            if self.bar is not None:
                self.bar.close()

    def _steps(self, stop: StopFlag, data_iter, val_every: int, window: "_Window", last_ckpt_time: float,
               stopped_by: str | None) -> dict:
        cfg, plan, state = self.cfg, self.plan, self.state
        accum = cfg.system.gradient_accumulation
        while state.step < plan.total_steps and not stopped_by:
            t_step = time.perf_counter()
            for micro in range(accum):
                t_data = time.perf_counter()
                batch = next(data_iter)
                window.data_time += time.perf_counter() - t_data
                out = self._micro_step(batch, sync=(micro == accum - 1))
                window.add_loss(out.loss.detach(), out.per_sample, out.timesteps, self.family.num_timesteps)
                if out.parts:
                    window.add_parts(out.parts)
            grad_norm = self._optimizer_step()
            state.step += 1
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
                window = _Window()
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

    def _check_nonfinite(self, window: "_Window") -> None:
        """Read the device-side counters of skipped (non-finite) steps; stop after too many in a row."""
        skipped = int(self.nonfinite_total)
        if skipped:
            self.state.nonfinite_steps += skipped
            self.nonfinite_total.zero_()
            log.warning("%d optimizer step(s) up to step %d had a non-finite gradient norm: their updates were "
                        "skipped (%d in a row now)", skipped, self.state.step, int(self.nonfinite_streak))
        if int(self.nonfinite_streak) >= self.cfg.experiment.max_nonfinite_steps:
            self._stop_nonfinite(window)

    def _stop_nonfinite(self, window: "_Window") -> None:
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
    def _log(self, w: "_Window") -> None:
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
                _hms(eta), extra={PROGRESS: True},
            )
            if self.bar is not None:
                self.bar.show(loss, metrics["images_per_sec"])

    def _save_checkpoint(self) -> None:
        shared = {name: obj.state_dict() for name, obj in self._resumable().items()} if self.info.is_main else {}
        per_rank = {"rng": rng_state(), "data": self.loader.state_dict()}
        write_sharded = None
        if self.strategy.sharded:
            state = self.strategy.sharded_state(self.net, self.optimizer, self.ema.shadow if self.ema else None)
            write_sharded = lambda folder: self.strategy.save_sharded(state, folder)  # noqa: E731
        self.checkpointer.save(
            self.state.step, shared, per_rank, self.state.state_dict(), self.config_yaml, self.info.rank, write_sharded
        )

    def _export(self) -> None:
        """Rank 0 exports the pipeline(s) and the sample grid; then every rank makes its share of the
        eval images. Under FSDP every rank first takes part in gathering the full weights.
        """
        weights = self._weights(self.cfg.experiment.export_weights, default_both=True)
        samples_from = self._weights(self.cfg.experiment.sample_from, default_both=False)
        needed = set(weights) | set(samples_from)
        plain = {}
        if "raw" in needed:
            plain["raw"] = self.strategy.plain_copy(self.net, self.device)
        if "ema" in needed:
            plain["ema"] = self.strategy.plain_copy(self.ema.shadow, self.device)
        targets = [(w == "ema", plain[w]) for w in weights]
        if self.info.is_main:
            cfg = self.cfg.experiment
            for is_ema, net in targets:
                out = self.run_dir.pipeline(None, ema=is_ema)
                metrics = self.family.export(net, out)
                if metrics:
                    self.trackers.log(metrics, self.state.step)
                if not cfg.save_only_most_recent:
                    copy_dir_atomically(out, self.run_dir.pipeline(self.state.step, ema=is_ema))
                log.info("exported pipeline %s", out)
            for w in samples_from:
                self._write_samples(plain[w], suffix="" if w == samples_from[0] else f"_{w}")
        self.state.last_export_step = self.state.step
        distributed.barrier()
        if self.family.makes_eval_images:
            self._write_eval_images(plain[samples_from[0]])

    def _weights(self, choice: str, default_both: bool) -> list[str]:
        """'auto' | 'raw' | 'ema' | 'both' -> the weights to use, first = the main one."""
        if choice == "auto":
            if self.ema is None:
                return ["raw"]
            return ["raw", "ema"] if default_both else ["ema"]
        return {"raw": ["raw"], "ema": ["ema"], "both": ["ema", "raw"]}[choice]

    def _sample_settings(self) -> SampleSettings:
        cfg = self.cfg.experiment
        return SampleSettings(list(cfg.sample_prompts or []), cfg.sample_per_prompt, cfg.sample_seed, cfg.sample_steps,
                              cfg.sample_guidance_scale, self._sample_resolution(), self.family.sample_dtype(self.autocast_dtype))

    def _write_samples(self, net, suffix: str = "") -> None:
        if next(net.parameters()).device != self.device:  # an EMA kept on the CPU (model.ema.device=cpu)
            net = copy.deepcopy(net).to(self.device)
        # Sampling draws from its own generators; the training RNG stream is left untouched.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            grid = self.family.sample_image(net, self._sample_settings())
        if grid is None:
            return
        path = self.run_dir.samples / f"step_{self.state.step:08d}{suffix}.png"
        grid.save(path)
        self.trackers.log_image(f"{self.family.samples_tag}{suffix}", path, self.state.step)

    def _sample_resolution(self) -> int:
        return self.cfg.experiment.sample_resolution or self.cfg.dataset.params.resolution

    def _write_eval_images(self, net) -> None:
        """``num_eval_images`` images from the eval prompts, split across ranks (collective)."""
        cfg = self.cfg.experiment
        if cfg.num_eval_images < 1:
            return
        out = self.run_dir.root / "eval" / f"step_{self.state.step:08d}"
        settings = self._sample_settings()._replace(prompts=read_prompts(cfg.eval_caption_file))
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self.family.eval_images(net, settings, cfg.num_eval_images, out, self.info.rank, self.info.world_size)
        distributed.barrier()
        self._score_eval_images(out)


def _hms(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class NonFiniteLossError(RuntimeError):
    """Too many consecutive non-finite steps: the run saved and stopped."""


class _EMAMeta:
    """The EMA's scalars, saved as a plain file when its weights are sharded (FSDP)."""

    def __init__(self, ema: EMA):
        self.ema = ema

    def state_dict(self) -> dict:
        return self.ema.meta_state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.ema.load_meta_state_dict(sd)


class _Window:
    """Sums over one log interval (kept on the device: no sync until the interval is logged)."""

    def __init__(self):
        self.loss_sum = 0.0
        self.loss_count = 0
        self.q_sum = torch.zeros(4)
        self.q_count = torch.zeros(4)
        self.grad_norm = 0.0
        self.last_loss = float("nan")
        self.parts: dict = {}
        self.parts_count = 0
        self.data_time = 0.0
        self.step_time = 0.0
        self.steps = 0

    def add_parts(self, parts: dict) -> None:
        """Named loss terms (e.g. the VAE's reconstruction and KL), averaged over the interval."""
        for k, v in parts.items():  # kept on the device until the interval is logged
            self.parts[k] = self.parts.get(k, 0.0) + (v.detach().float() if isinstance(v, torch.Tensor) else float(v))
        self.parts_count += 1

    def add_loss(self, loss: torch.Tensor, per_sample: torch.Tensor, timesteps: torch.Tensor, num_timesteps: int) -> None:
        if not isinstance(self.loss_sum, torch.Tensor):
            self.loss_sum = torch.zeros((), device=loss.device)
            self.q_sum = self.q_sum.to(loss.device)
            self.q_count = self.q_count.to(loss.device)
        self.loss_sum = self.loss_sum + loss.float()
        self.last_loss = loss
        self.loss_count += 1
        if timesteps is None:  # autoencoder stage: no timesteps
            return
        # Loss by timestep quartile (as guided-diffusion logs): where in the noise range the model struggles.
        q = (timesteps * 4 // num_timesteps).clamp(max=3)
        self.q_sum.index_add_(0, q, per_sample.float())
        self.q_count.index_add_(0, q, torch.ones_like(per_sample, dtype=torch.float))
