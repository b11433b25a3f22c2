"""What a run leaves behind besides checkpoints: the held-out validation loss, exported pipelines,
sample grids, eval images and their FID / CLIP scores. A mixin of the ``Trainer`` (``loop.py``), which
holds the state these read: the config, the family, the strategy, the run directory and the trackers."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import torch

from . import distributed
from .data import build_train_loader
from .evaluation.async_eval import AsyncEvaluator
from .evaluation.evaluate import EvalSettings, evaluate_images
from .evaluation.fid import image_files
from .export import read_prompts
from .families.base import SampleSettings
from .run_dir import copy_dir_atomically

log = logging.getLogger("sd_training.loop")


class RunOutputs:
    """Validation, exports, samples and evaluation of the ``Trainer``."""

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
