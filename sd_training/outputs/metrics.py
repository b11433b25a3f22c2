"""What a log line reports: the sums of one log interval (:class:`LogWindow`, kept on the device) and the
metrics computed from them at log time (:class:`StepMetrics`): loss (and by timestep quartile), learning
rate, gradient norm, images/s per device, MFU, data wait, the loader's counters."""

from __future__ import annotations

import logging

import torch

from .. import distributed
from ..config.schema import TrainConfig
from ..distributed import DistInfo
from ..families.base import Family
from ..speed.flops import mfu, peak_flops
from ..run.progress import PROGRESS
from .trackers import Trackers
from ..run.train_state import Plan, TrainState, hms

log = logging.getLogger("sd_training.loop")


class LogWindow:
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


def quartile_losses(q_sum: torch.Tensor, q_count: torch.Tensor) -> dict:
    """``loss_q0..q3``: the mean loss of the interval's samples by timestep quartile, over all ranks
    (collective). Sums and counts are reduced, not per-rank means, so a rank without a sample in a quartile
    does not pull its mean to 0; a quartile no sample fell in is left out."""
    q = distributed.all_reduce_mean(torch.cat([q_sum, q_count])).tolist()  # the rank count cancels in the ratio
    return {f"loss_q{i}": q[i] / q[4 + i] for i in range(4) if q[4 + i] > 0}


class StepMetrics:
    """Turns a :class:`LogWindow` into a metrics row (all ranks: the loss is averaged over them) that rank 0
    logs to the trackers and as one line."""

    def __init__(self, cfg: TrainConfig, family: Family, plan: Plan, info: DistInfo, trackers: Trackers | None,
                 autocast_dtype: torch.dtype | None):
        self.cfg, self.family, self.plan, self.info, self.trackers = cfg, family, plan, info, trackers
        self.device = info.device
        self.peak = None
        # Counted on the meta device (~1-3 CPU-seconds for a small net): only rank 0 logs MFU, so only it counts.
        self.step_flops = family.step_flops() if info.is_main else None
        if self.step_flops is not None:
            dtype = autocast_dtype or torch.float32
            given = cfg.experiment.peak_tflops * 1e12 if cfg.experiment.peak_tflops else None
            self.peak = peak_flops(self.device, dtype, given)
            log.info("FLOPs per training image: model %.3g, hardware %.3g; device peak %s", self.step_flops.model,
                     self.step_flops.hardware, f"{self.peak:.3g}" if self.peak else "unknown (no MFU)")

    def log(self, w: LogWindow, state: TrainState, lr: float, extra: dict, loader_stats: dict,
            ema_decay: float | None = None, bar=None) -> None:
        """Collective (the loss is averaged over the ranks). ``extra``: seconds of saves and exports since
        the last line; ``loader_stats``: the loader's counters (numbers are logged as data/<name>)."""
        loss = distributed.all_reduce_mean(w.loss_sum / max(w.loss_count, 1)).item()
        n_images = w.steps * self.plan.global_batch
        metrics = {"loss": loss, **extra}
        if self.family.num_timesteps is not None:
            metrics.update(quartile_losses(w.q_sum, w.q_count))
        for k, v in w.parts.items():  # this rank's mean (the total loss above is the all-rank one)
            metrics[f"{self.family.metric_prefix}{k}"] = float(v) / max(w.parts_count, 1)
        per_sec = n_images / max(w.step_time, 1e-9)
        metrics.update({
            "lr": lr,
            "grad_norm": float(w.grad_norm),
            "images_seen": state.images_seen,
            "images_per_sec": per_sec,
            "images_per_sec_per_device": per_sec / self.info.world_size,
            "step_time": w.step_time / max(w.steps, 1),
            "data_wait_fraction": w.data_time / max(w.step_time, 1e-9),
            "nonfinite_steps": state.nonfinite_steps,
        })
        if ema_decay is not None:
            metrics["ema_decay"] = ema_decay
        if self.step_flops is not None:
            per_device = metrics["images_per_sec_per_device"]
            metrics["model_tflops_per_image"] = self.step_flops.model / 1e12
            if self.peak:
                metrics["mfu"] = mfu(per_device, self.step_flops.model, self.peak)
                metrics["hfu"] = mfu(per_device, self.step_flops.hardware, self.peak)
        if self.device.type == "cuda":
            metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        metrics.update({f"data/{k}": v for k, v in loader_stats.items() if isinstance(v, (int, float))})
        if not self.info.is_main:
            return
        self.trackers.log(metrics, state.step)
        eta = (self.plan.total_steps - state.step) * metrics["step_time"]
        log.info(
            "step %d/%d loss %.4f lr %.2e grad_norm %.3f %.1f img/s (%.1f/device) data_wait %.0f%% ETA %s",
            state.step, self.plan.total_steps, loss, metrics["lr"], metrics["grad_norm"], metrics["images_per_sec"],
            metrics["images_per_sec_per_device"], 100 * metrics["data_wait_fraction"], hms(eta), extra={PROGRESS: True},
        )
        if bar is not None:
            bar.show(loss, metrics["images_per_sec"])
