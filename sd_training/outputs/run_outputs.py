"""What a run leaves behind besides checkpoints: the held-out validation loss, exported pipelines (each
with its model card, :mod:`.model_card`), sample grids, eval images and their FID / CLIP scores.
:class:`RunOutputs` is built by the ``Trainer`` with everything it reads passed in: the config, the family,
the strategy, the run folder, the trackers and the ranks."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import torch

from .. import adapters, distributed, report
from . import model_card, sample_references
from ..config.schema import TrainConfig
from ..data import build_train_loader
from ..distributed import DistInfo
from ..evaluation.async_eval import AsyncEvaluator
from ..evaluation.evaluate import EvalSettings, evaluate_images
from ..evaluation.fid import image_files
from .export import read_prompts
from .file_modes import share_tree
from ..families.base import Family, SampleSettings
from ..optim import in_eval_weights, lr_scale
from ..distributed.strategy import Strategy
from ..speed.precision import autocast
from ..run.run_dir import RunDir, copy_dir_atomically
from .trackers import Trackers
from ..run.train_state import Plan, TrainState

log = logging.getLogger("sd_training.loop")


def validation_batches(cfg: TrainConfig, family: Family, info: DistInfo) -> list[dict]:
    """The first ``validation.num_batches`` batches of this rank's part of the held-out shards, made
    deterministic by the family (fixed latents, noise, timesteps; no augmentation, no caption dropout)."""
    v, d = cfg.validation, cfg.dataset
    params = dataclasses.replace(d.params, path=v.path, workers=0, resampled=False, caption_dropout=0.0,
                                 random_flip=0.0, center_crop=True, num_examples_to_see=None)
    loader = build_train_loader(dataclasses.replace(d, params=params), tokenizer=family.tokenizers,
                                rank=info.rank, world_size=info.world_size, seed=v.seed)
    it = iter(loader)
    g = torch.Generator().manual_seed(v.seed + info.rank)
    return [family.validation_batch(next(it), g, i) for i in range(v.num_batches)]


class RunOutputs:
    """Validation, exports, samples and evaluation of a run."""

    def __init__(self, cfg: TrainConfig, family: Family, strategy: Strategy, run_dir: RunDir, info: DistInfo,
                 trackers: Trackers | None, autocast_dtype: torch.dtype | None, val_batches: list[dict] | None,
                 state: TrainState | None = None, optimizer: torch.optim.Optimizer | None = None):
        """``trackers``: rank 0's (None elsewhere); ``val_batches``: :func:`validation_batches` (None: no
        validation); ``state``: the run's counters (the model cards' images seen; None: steps x global batch).
        The model card template is rendered once here: a broken one stops the run before it trains."""
        self.cfg, self.family, self.strategy, self.run_dir, self.info = cfg, family, strategy, run_dir, info
        self.device, self.state = info.device, state
        self.optimizer = optimizer  # a schedule-free one's evaluation weights are validated and exported
        self.trackers, self.autocast_dtype, self.val_batches = trackers, autocast_dtype, val_batches
        self.evaluator = None  # background FID / CLIP scoring (evaluation.asynchronous), started at the first
        self.card_run = self._card_run()
        model_card.check_template(self.card_run, run_dir.pipeline(None))

    @torch.no_grad()
    @in_eval_weights
    def validate(self, step: int, model: torch.nn.Module) -> None:
        """Held-out loss at fixed noise and timesteps of ``model`` (the wrapped loss module; all ranks, the
        mean over ranks is logged)."""
        loss_module = self.family.loss_module
        loss_module.eval()
        total = torch.zeros((), device=self.device)
        try:
            for b in self.val_batches:
                fixed = {k: b[k].to(self.device) for k in ("noise", "timesteps") if k in b}
                context = autocast(self.device, self.autocast_dtype)
                total += self.family.loss(model, b, context, fixed, validation=True).loss.float()
        finally:
            loss_module.train()
        val = distributed.all_reduce_mean(total / len(self.val_batches)).item()
        if self.info.is_main:
            self.trackers.log({"val/loss": val}, step)
            log.info("step %d validation loss %.5f", step, val)

    # -- exports, samples, eval images ----------------------------------------------------------------
    @in_eval_weights
    def export(self, step: int, net: torch.nn.Module, ema=None) -> None:
        """Rank 0 exports the pipeline(s) and the sample grid; then every rank makes its share of the
        eval images. Under FSDP every rank first takes part in gathering the full weights."""
        weights = self._weights(self.cfg.experiment.export_weights, ema, default_both=True)
        samples_from = self._weights(self.cfg.experiment.sample_from, ema, default_both=False)
        needed = set(weights) | set(samples_from)
        plain = {}
        if "raw" in needed:
            plain["raw"] = self.strategy.plain_copy(net, self.device)
        if "ema" in needed:
            plain["ema"] = self._ema_net(net, ema, plain.get("raw"))
        if self.info.is_main:
            exported = []
            for w in weights:
                out = self.run_dir.pipeline(None, ema=w == "ema")
                metrics = self._export(plain[w], out)
                if metrics:
                    self.trackers.log(metrics, step)
                exported.append((w, out))
            grids = {w: self._write_samples(step, plain[w], suffix="" if w == samples_from[0] else f"_{w}")
                     for w in samples_from}
            for w, out in exported:
                self._write_card(step, w, out, grids)  # the card embeds this export's sample grid
                if not self.cfg.experiment.save_only_most_recent:
                    copy_dir_atomically(out, self.run_dir.pipeline(step, ema=w == "ema"))
                    self._write_card(step, w, self.run_dir.pipeline(step, ema=w == "ema"), grids)
                log.info("exported pipeline %s", out)
            report.refresh_after_export(self.cfg, self.run_dir.root, self.family, self.info.world_size)
        distributed.barrier()
        if self.family.makes_eval_images:
            self._write_eval_images(step, plain[samples_from[0]])

    def _ema_net(self, net: torch.nn.Module, ema, raw: torch.nn.Module | None) -> torch.nn.Module:
        """The net with the EMA's weights, unsharded: the shadow itself, or (an EMA of the trained parameters
        only, model.adapter) a copy of the net sharing its frozen weights, with the averaged ones."""
        if ema.names is None:
            return self.strategy.plain_copy(ema.shadow, self.device)
        base = raw if raw is not None else self.strategy.plain_copy(net, self.device)
        return ema.applied_to(base, {k: v.to(self.device) for k, v in self.strategy.full_state_dict(ema.shadow).items()})

    def _export(self, net: torch.nn.Module, out: Path) -> dict:
        """The family's pipeline, or with adapters their diffusers LoRA folder (and the merged pipeline), its
        files in the umask's mode (:mod:`.file_modes`)."""
        if self.family.adapters is None:
            metrics = self.family.export(net, out)
        else:
            a = self.cfg.model.adapter
            metrics = adapters.export(self.family.adapters, self.family, net, out, a.export_merged, a.export_kohya)
        share_tree(out)  # safetensors writes every weights file 0600: the group could not load the export
        return metrics

    # -- model cards ----------------------------------------------------------------------------------
    def _card_run(self) -> model_card.RunInfo:
        cfg, fam = self.cfg, self.family
        global_batch = Plan.make(cfg, self.info.world_size).global_batch
        scale = lr_scale(cfg.optimizer, global_batch)
        own = cfg.model.adapter.learning_rate if cfg.model.adapter.enabled else None
        peak = (own if own is not None else cfg.optimizer.params.learning_rate) * scale
        source = fam.component_sources().get(fam.net_name, {}).get("source")
        return model_card.RunInfo(cfg, fam.name, tuple(fam.card_tags), fam.net_name, source, fam.samples_tag,
                                  global_batch, self.info.world_size, peak, self.run_dir.metrics)

    def _write_card(self, step: int, weights: str, folder: Path, grids: dict) -> None:
        """The export's README.md with the grid of its own weights (else the main grid)."""
        shown = weights if grids.get(weights) else next((w for w, g in grids.items() if g), weights)
        seen = self.state.images_seen if self.state is not None else step * self.card_run.global_batch
        model_card.write(self.card_run, model_card.ExportInfo(folder, self.family.adapters is not None, weights, step,
                                                              seen, grids.get(shown), shown))

    @staticmethod
    def _weights(choice: str, ema, default_both: bool) -> list[str]:
        """'auto' | 'raw' | 'ema' | 'both' -> the weights to use, first = the main one."""
        if choice == "auto":
            if ema is None:
                return ["raw"]
            return ["raw", "ema"] if default_both else ["ema"]
        return {"raw": ["raw"], "ema": ["ema"], "both": ["ema", "raw"]}[choice]

    def _sample_settings(self) -> SampleSettings:
        cfg = self.cfg.experiment
        resolution = cfg.sample_resolution or self.cfg.dataset.params.resolution
        return SampleSettings(list(cfg.sample_prompts or []), cfg.sample_per_prompt, cfg.sample_seed, cfg.sample_steps,
                              cfg.sample_guidance_scale, resolution, self.family.sample_dtype(self.autocast_dtype),
                              sample_references.sample_paths(cfg))

    def _write_samples(self, step: int, net, suffix: str = "") -> Path | None:
        """The sample grid of ``net`` (None: the family makes none)."""
        if next(net.parameters()).device != self.device:  # an EMA kept on the CPU (model.ema.device=cpu)
            net = copy.deepcopy(net).to(self.device)
        # Sampling draws from its own generators; the training RNG stream is left untouched.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            grid = self.family.sample_image(net, self._sample_settings())
        if grid is None:
            return None
        path = self.run_dir.sample_grid(step, suffix)
        grid.save(path)
        self.trackers.log_image(f"{self.family.samples_tag}{suffix}", path, step)
        return path

    def _write_eval_images(self, step: int, net) -> None:
        """``num_eval_images`` images from the eval prompts, split across ranks (collective)."""
        cfg = self.cfg.experiment
        if cfg.num_eval_images < 1:
            return
        out = self.run_dir.eval_images(step)
        references = sample_references.eval_paths(cfg.eval_reference_file) if cfg.eval_reference_file else ()
        settings = self._sample_settings()._replace(prompts=read_prompts(cfg.eval_caption_file), references=references)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self.family.eval_images(net, settings, cfg.num_eval_images, out, self.info.rank, self.info.world_size)
        distributed.barrier()
        self._score_eval_images(step, out)

    # -- FID / CLIP scores ----------------------------------------------------------------------------
    def _eval_settings(self) -> EvalSettings | None:
        ev = self.cfg.evaluation
        if not (ev.ref_stats or ev.ref_images or ev.clip_model):
            return None
        return EvalSettings(prompts=self.cfg.experiment.eval_caption_file, ref_stats=ev.ref_stats,
                            ref_images=ev.ref_images, ref_max_images=ev.ref_max_images, clip_model=ev.clip_model,
                            clip_pretrained=ev.clip_pretrained, clip_config=ev.clip_config, device=ev.device)

    def _score_eval_images(self, step: int, folder: Path) -> None:
        """FID / CLIP score of the eval images: in a background process on rank 0 (asynchronous), or
        here, split across ranks (every rank passes the same file list)."""
        settings = self._eval_settings()
        if settings is None:
            return
        if self.cfg.evaluation.asynchronous:
            if self.info.is_main:
                if self.evaluator is None:
                    self.evaluator = AsyncEvaluator(self.run_dir.eval_results, settings,
                                                    threads=self.cfg.evaluation.threads)
                self.evaluator.submit(step, images=folder)
            return
        result = evaluate_images(image_files(folder), settings)
        if self.info.is_main:
            self.trackers.log({**result, "eval/step": step}, step)
            log.info("step %d evaluation %s", step, result)

    def log_eval_results(self, step: int, wait: bool = False) -> None:
        """Results of background evaluations, logged at ``step`` with the step they belong to."""
        if self.evaluator is None:
            return
        for r in (self.evaluator.wait() if wait else self.evaluator.poll()):
            scored = r.pop("step", step)
            if "error" in r:
                log.error("evaluation of step %s failed: %s", scored, r["error"])
                continue
            # Logged now (trackers such as wandb refuse a step lower than their current one), tagged
            # with the step whose weights were evaluated.
            self.trackers.log({**{k: v for k, v in r.items() if k.startswith("eval/")}, "eval/step": scored}, step)
            log.info("step %s evaluation %s", scored, r)

    def close(self, step: int, preempted: bool) -> None:
        """The end of the run: wait for background evaluations, unless ``preempted`` (a stop signal or a
        failure: they are stopped within seconds, so they do not hold the job)."""
        if self.evaluator is None:
            return
        if preempted:
            self.evaluator.close()
        else:
            self.log_eval_results(step, wait=True)
