"""The optimizer steps whose update is skipped: a non-finite gradient norm (the Trainer's non-finite stop reads
these counters) and a zero one, which has nothing to learn from (degenerate data, below).

A step whose gradient is exactly zero everywhere (every sample's loss weight 0: all-black masks with
``dataset.params.unmasked_weight: 0``, a loss weighting that gives 0) trains nothing, yet an optimizer step
would still apply weight decay and momentum to every weight. The Trainer skips such a step's update (as it
skips a non-finite one: no data, no update) and counts it here.

* The flag is the step's global gradient norm == 0. The norm is computed from gradients that are already
  all-reduced, so every rank sees the same flag, counts the same steps and stops at the same check, with
  no collective of its own.
* The counters are device tensors, read at the host checks (every ``distributed.flag_sync_every`` steps,
  at log lines) beside the non-finite ones: no per-step host sync on a GPU.
* Masks are known on the host before the step: the collate counts each batch's samples whose weight is zero
  everywhere (``zero_weight_samples``), so a rank whose batch is all masked out warns at once, at its first
  such step, naming the masks.
* After ``experiment.max_zero_weight_steps`` zero-gradient steps in a row (0: never) the run stops with
  :class:`ZeroWeightSteps`, a data error (exit code 2, one line, as bad data found at set-up). No checkpoint
  is written for the stop: the skipped steps changed no weight, so the newest checkpoint stays as it was and
  holds the same weights; a resume after fixing the data continues from it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch

from ..config.dataset import DatasetConfigError

log = logging.getLogger(__name__)
# A skipped update (a zero or non-finite gradient) at the first step is intended; torch would call it a misuse.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")


class ZeroWeightSteps(DatasetConfigError):
    """Too many consecutive optimizer steps with nothing to learn from: the run stopped."""


class StepGuards:
    """The counters of one rank; :meth:`see_batch` per micro-batch (host), :meth:`count` per optimizer step
    (device), :meth:`check` (zero gradients) at the host checks; the non-finite ones are read by the Trainer."""

    def __init__(self, device: torch.device, limit: int, params) -> None:
        self.nonfinite_streak = torch.zeros((), dtype=torch.long, device=device)  # consecutive skipped steps
        self.nonfinite_total = torch.zeros((), dtype=torch.long, device=device)  # skipped since the last check
        self.limit = limit  # 0: never stop
        self.masked_loss = bool(params.masked_loss)
        self.unmasked_weight = float(params.unmasked_weight)
        self.total = torch.zeros((), dtype=torch.long, device=device)  # zero-gradient steps since the last check
        self.streak = torch.zeros((), dtype=torch.long, device=device)  # ... in a row, up to now
        self.masked_out_steps = 0  # host: this rank's steps since the last check whose every sample had weight 0
        self.masked_out_run = 0  # host: ... in a row, up to now
        self._step_batches = self._step_masked_out = 0  # micro-batches of the step in progress, all masked out
        self._warned_masks = False
        self._last_check = 0

    def see_batch(self, batch: dict, step: int) -> None:
        """Host only (a count the collate made): is every sample of this micro-batch masked out?"""
        n_zero, n = batch.get("zero_weight_samples"), len(batch.get("keys", ()))
        masked_out = n_zero is not None and n > 0 and n_zero >= n
        self._step_batches += 1
        self._step_masked_out += masked_out
        if masked_out and not self._warned_masks:
            self._warned_masks = True
            log.warning("step %d: every sample of this rank's batch has a mask that is black everywhere "
                        "(dataset.params.unmasked_weight=%g), so its loss and gradient are zero: it trains nothing. "
                        "Look at the masks (inverted, empty, or not the image's: 255 trains, 0 does not) or set "
                        "dataset.params.unmasked_weight above 0; zero-gradient steps are skipped, and the run stops "
                        "after experiment.max_zero_weight_steps=%d in a row (0: never)",
                        step, self.unmasked_weight, self.limit)

    def count(self, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Device: this optimizer step's flags (non-finite, zero), from its global gradient norm (the same on
        every rank), counted; returned on the norm's device for the optimizer's skip."""
        bad, zero = ~torch.isfinite(grad_norm), grad_norm == 0
        bad_here = bad.long().to(self.nonfinite_total.device, non_blocking=True)  # (CPU under FSDP offload)
        self.nonfinite_total = self.nonfinite_total + bad_here
        self.nonfinite_streak = (self.nonfinite_streak + 1) * bad_here
        zero_here = zero.long().to(self.total.device, non_blocking=True)
        self.total = self.total + zero_here
        self.streak = (self.streak + 1) * zero_here
        masked_out = 0 < self._step_batches == self._step_masked_out  # (host ints)
        self.masked_out_steps += masked_out
        self.masked_out_run = self.masked_out_run + 1 if masked_out else 0
        self._step_batches = self._step_masked_out = 0
        return bad, zero

    def check(self, step: int, before_stop: Callable[[], None]) -> None:
        """Read the counters (one host sync, at a check step). Warns when steps since the last check had a
        zero gradient; once ``limit`` are in a row, calls ``before_stop`` (the trainer logs its metrics window)
        and raises :class:`ZeroWeightSteps` (logged too: a data error reaches train.log without a traceback).
        Every rank reads the same counts, so all stop at this check."""
        total, streak = torch.stack([self.total, self.streak]).tolist()
        since, masked_out = self._last_check, self.masked_out_steps
        self._last_check, self.masked_out_steps = step, 0
        if not total:
            return
        self.total.zero_()
        if self.limit and streak >= self.limit:
            cause = self._cause(min(self.masked_out_run, streak))
            message = (f"{streak} optimizer steps in a row (steps {step - streak + 1}-{step}) had an exactly zero "
                       f"gradient: every sample's loss weight was 0 ({cause}), the limit is "
                       f"experiment.max_zero_weight_steps={self.limit}. The run stopped, as the data trains nothing; "
                       "those updates were skipped (no weight decay either) and the newest checkpoint is as it was. "
                       "Fix the data, or raise the limit (0: never stop), and run the same command to resume")
            before_stop()
            log.error("%s", message)
            raise ZeroWeightSteps(message)
        cause = self._cause(masked_out)
        what = (f"{total} optimizer step(s) of steps {since + 1}-{step} had an exactly zero gradient (every sample's "
                f"loss weight was 0; {cause})")
        bound = (f"stops at {self.limit} in a row (experiment.max_zero_weight_steps)" if self.limit
                 else "never stops for it (experiment.max_zero_weight_steps=0)")
        log.warning("%s: their updates (weight decay included) were skipped; %d in a row now, the run %s",
                    what, streak, bound)

    def _cause(self, masked_out: int) -> str:
        if masked_out:
            return (f"on this rank, {masked_out} of them had only masks that are black everywhere, with "
                    f"dataset.params.unmasked_weight={self.unmasked_weight:g}: look at the masks")
        if self.masked_loss:
            return "likely causes: black masks on the other ranks, or a loss weighting that gives 0"
        return "likely cause: a loss weighting that gives 0, or no trainable parameter the loss reaches"
