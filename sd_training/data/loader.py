"""``TrainLoader``: the per-rank iterable the training loop consumes, with ``state_dict`` and ``stats``.

With ``workers > 0`` it runs one :class:`~.stream.SlotStream` per worker process under a torch
``DataLoader``. The DataLoader takes batches from its workers strictly round-robin (worker 0, 1, ...,
W-1, 0, ...) and every worker's stream is infinite, so batch ``t`` of a rank always comes from logical
worker ``t mod W``. Each batch carries its worker's position (``_state``) and counter deltas (``_stats``);
the loader strips both before yielding, keeps the latest position per worker, and sums the counters, so
``state_dict()`` describes exactly the batches the loop has received (not the ones still prefetched).

After a restore, physical worker ``p`` plays logical worker ``(p + t) mod W`` where ``t`` is the number
of batches consumed before the checkpoint, so the round-robin continues where it stopped.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..preemption import ignore_stop_signals
from .samples import SampleProcessor
from .stats import log, summarize
from .stream import Plan, SlotStream

STATE_VERSION = 1
PREFETCH_BATCHES = 2  # per worker (torch's default prefetch_factor)


class _SlotDataset(IterableDataset):
    """What each DataLoader worker iterates: the stream of its logical slot."""

    def __init__(self, plan: Plan, proc: SampleProcessor, states: Dict[int, Dict], shift: int):
        self.plan, self.proc, self.states, self.shift = plan, proc, states, shift

    def __iter__(self):
        info = get_worker_info()
        physical = info.id if info is not None else 0
        logical = (physical + self.shift) % self.plan.workers_per_rank
        if info is not None:
            torch.set_num_threads(1)  # workers are processes already; intra-op threads only oversubscribe
        return iter(SlotStream(self.plan, self.proc, logical, self.states.get(logical)))


class TrainLoader:
    """Infinite batches for one rank: ``{"pixel_values", "input_ids", "captions", "keys", "epochs"}``.

    * ``pixel_values``: uint8 [B, 3, H, W] (H = W = resolution unless aspect buckets are on); the consumer
      moves them to its device and scales them to [-1, 1] there (``transforms.unit_range``);
    * ``input_ids``: int64 [B, tokenizer.model_max_length];
    * ``captions``: the captions after dropout/shuffling ('' when dropped); ``keys``: sample names;
      ``epochs``: the data epoch each sample was read in.

    ``dataset.type=latents`` (see :mod:`.latents`): ``latents`` float32 [B, C, h, w], already multiplied
    by the VAE scaling factor, replaces ``pixel_values``; with ``text_embeddings`` the batch also holds
    ``encoder_hidden_states`` float32 [B, L, D]. ``latent_scaling_factor`` is the shards' factor and
    ``latents_info`` their ``latents_info.json`` (None for image data or when unreadable): check them
    against the VAE and text encoder the run uses.

    Resume (``state_dict`` / ``load_state_dict``): with the same world size and ``workers``, the batches
    after a restore are identical to those of an uninterrupted run, in finite *and* resampled mode (the
    resampled shard draws are a function of ``(seed, global index)``, not of a process-local RNG). With a
    different world size or worker count, the position is approximate: finite mode restarts at the oldest
    unit not fully read by every worker (a few shards may repeat; samples that sat in shuffle buffers are
    lost), resampled mode continues with fresh draws; the counters carry over in both cases.
    """

    def __init__(self, plan: Plan, proc: SampleProcessor, *, num_examples_to_see: Optional[int], kind: str):
        self.plan = plan
        self.proc = proc
        self.kind = kind
        self.batches = 0  # batches yielded by this rank since the run started
        self._states: Dict[int, Dict] = {}
        self._counts: Counter = Counter()
        self._epoch = 0
        per_step = plan.world_size * plan.batch_size
        self.steps_total = math.ceil(num_examples_to_see / per_step) if num_examples_to_see else None
        self.num_samples = _known_samples(plan)
        # Set by build_train_loader for latent shards: the shards' scaling factor and latents_info.json.
        self.latent_scaling_factor: Optional[float] = None
        self.latents_info: Optional[Dict[str, Any]] = None

    @property
    def epoch(self) -> int:
        """The oldest data epoch any worker of this rank is still reading."""
        return self._epoch

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        W = self.plan.workers_per_rank
        shift = self.batches % W
        dataset = _SlotDataset(self.plan, self.proc, dict(self._states), shift)
        if self.plan.workers == 0:
            source = iter(dataset)
        else:
            source = iter(
                DataLoader(
                    dataset,
                    batch_size=None,
                    num_workers=self.plan.workers,
                    prefetch_factor=PREFETCH_BATCHES,
                    persistent_workers=False,  # a new iter() must start from the loader's current position
                    pin_memory=torch.cuda.is_available(),  # lets the loop's .to(device, non_blocking=True) overlap
                    # Its own generator: without one, creating the iterator draws the workers' base seed
                    # from the global RNG, so a resumed run's noise stream would be one draw off the
                    # uninterrupted run's (every tensor differs after resume). The streams do not use the
                    # workers' torch seeds: every sample's randomness comes from its own position.
                    generator=torch.Generator().manual_seed(0),
                    worker_init_fn=ignore_stop_signals,
                )
            )
        try:
            for batch in source:
                worker = batch.pop("_worker")
                expected = self.batches % W
                if worker != expected:  # the round-robin invariant the position relies on
                    raise RuntimeError(f"data: batch {self.batches} came from worker {worker}, expected {expected}")
                self._states[worker] = batch.pop("_state")
                self._counts.update(batch.pop("_stats"))
                self.batches += 1
                if len(self._states) == W:
                    self._epoch = min(self._epoch_of(w, st) for w, st in self._states.items())
                yield batch
        finally:
            # Stop the workers now. Left to the garbage collector (an exception's traceback keeps the
            # iterator alive in a reference cycle), torch's shutdown waits 5 s per worker.
            shutdown = getattr(source, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def _epoch_of(self, worker: int, st: Dict) -> int:
        g = self.plan.global_index(self.plan.slot(worker), int(st["base"]), int(st["i"]))
        return g // len(self.plan.units)

    # -- the training state -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        p = self.plan
        return {
            "version": STATE_VERSION,
            "type": self.kind,
            "seed": p.seed,
            "rank": p.rank,
            "world_size": p.world_size,
            "workers": p.workers_per_rank,
            "resampled": p.resampled,
            "n_units": len(p.units),
            "batch_size": p.batch_size,
            "batches": self.batches,
            "epoch": self._epoch,
            "worker_states": {str(k): v for k, v in self._states.items()},
            "stats": dict(self._counts),
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        p = self.plan
        if int(sd.get("version", -1)) != STATE_VERSION:
            raise ValueError(f"data loader state has version {sd.get('version')}, this code reads {STATE_VERSION}")
        self._counts = Counter(sd.get("stats", {}))
        self.batches = int(sd["batches"])
        self._epoch = int(sd.get("epoch", 0))
        states = {int(k): v for k, v in sd["worker_states"].items()}
        same = {
            "world_size": p.world_size,
            "workers": p.workers_per_rank,
            "n_units": len(p.units),
            "seed": p.seed,
            "resampled": p.resampled,
            "type": self.kind,
            "batch_size": p.batch_size,
            "rank": p.rank,
        }
        changed = {k: (sd.get(k), v) for k, v in same.items() if sd.get(k) != v}
        if not changed:
            self._states = states
            log.info("data: resumed rank %d at batch %d (exact position)", p.rank, self.batches)
            return
        # Approximate resume: restart every slot from a common base.
        saved_slots = int(sd["world_size"]) * int(sd["workers"])
        g = [
            int(st["base"]) + (int(sd["rank"]) * int(sd["workers"]) + w) + int(st["i"]) * saved_slots
            for w, st in states.items()
        ]
        base = (min(g) if not p.resampled else max(g) + 1) if g else 0
        self._states = {
            w: {"base": base, "i": 0, "j": 0, "batches": 0, "rng": None, "buffer": [], "buckets": {}}
            for w in range(p.workers_per_rank)
        }
        self.batches = 0  # the round-robin restarts at worker 0
        log.warning(
            "data: loader state saved with %s differs from this run: position is approximate (restarting at "
            "global unit %d); see TrainLoader docs",
            ", ".join(f"{k}={a!r} (now {b!r})" for k, (a, b) in changed.items()),
            base,
        )

    def stats(self) -> Dict[str, float]:
        """Counters for this rank (see :mod:`.stats`), plus ``epoch`` and ``batches``."""
        out = summarize(self._counts)
        out["epoch"] = self._epoch
        out["batches"] = self.batches
        return out


def _known_samples(plan: Plan) -> Optional[int]:
    sizes = [s.num_samples for s in plan.sources]
    return None if any(n is None for n in sizes) else int(sum(sizes))


def describe(loader: TrainLoader) -> List[str]:
    """Start-up log lines: sources, units, mode, epochs implied by num_examples_to_see."""
    p = loader.plan
    lines = [
        f"data: {loader.kind} from {len(p.sources)} source(s), {len(p.units)} units, "
        f"{'resampled (with replacement)' if p.resampled else 'finite epochs'}; rank {p.rank}/{p.world_size}, "
        f"{p.workers} worker(s), batch {p.batch_size}, shuffle buffer {p.shuffle_buffer}"
    ]
    if loader.kind == "latents":
        proc = loader.proc
        lines.append(
            f"data: latent shards ({'/'.join(sorted({str(s) for s in proc.stores}))}), latent_sampling "
            f"{proc.sampling}, scaling factor {loader.latent_scaling_factor}, text embeddings "
            f"{'from the shards' if proc.text_embeddings else 'computed by the loop'}"
        )
    if loader.proc.filters:
        lines.append("data: metadata filters: " + ", ".join(f"{f.key} {f.text}" for f in loader.proc.filters))
    if loader.num_samples:
        lines.append(f"data: {loader.num_samples} samples before filtering")
        if loader.steps_total:
            seen = loader.steps_total * p.world_size * p.batch_size
            lines.append(f"data: num_examples_to_see ~ {seen / loader.num_samples:.2f} epochs of the unfiltered data")
    return lines
