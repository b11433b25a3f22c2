"""``TrainLoader``: the per-rank iterable the training loop consumes, with ``state_dict`` and ``stats``.

The rank's ``t``-th micro-batch is canonical reader ``rank + world_size x (t mod C/R)``'s next batch (see
:mod:`.stream`). With ``workers > 0`` a torch ``DataLoader`` runs ``W`` processes; it takes batches from
them strictly round-robin (worker 0, 1, ..., W-1, 0, ...) and every stream is infinite, so batch ``t``
always comes from logical worker ``t mod W``, which serves the readers of the batches ``t = w (mod W)``.
Each batch carries its reader's position (``_state``) and counter deltas (``_stats``); the loader strips
both before yielding, keeps the latest position per reader, and sums the counters, so ``state_dict()``
describes exactly the batches the loop has received (not the ones still prefetched).

After a restore at batch ``t``, physical worker ``p`` plays logical worker ``(p + t) mod W``, so the
round-robin continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Union

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..run.preemption import loader_worker_init
from .samples import SampleProcessor
from .stats import log, summarize
from .stream import Plan, SlotStream

STATE_VERSION = 2
PREFETCH_BATCHES = 2  # per worker (torch's default prefetch_factor)


class _ReaderDataset(IterableDataset):
    """What each DataLoader worker iterates: the batches ``t = w (mod W)`` of its rank from ``start`` on,
    each from the canonical reader it belongs to."""

    def __init__(self, plan: Plan, proc: SampleProcessor, states: Dict[int, Dict], start: int):
        self.plan, self.proc, self.states, self.start = plan, proc, states, start

    def __iter__(self):
        info = get_worker_info()
        physical = info.id if info is not None else 0
        W = self.plan.workers_per_rank
        logical = (physical + self.start) % W
        if info is not None:
            torch.set_num_threads(1)  # workers are processes already; intra-op threads only oversubscribe
        streams: Dict[int, Iterator] = {}
        t = self.start + (logical - self.start) % W
        while True:
            c = self.plan.reader_of(t)
            if c not in streams:
                streams[c] = iter(SlotStream(self.plan, self.proc, c, self.states.get(c)))
            batch = next(streams[c])
            batch["_worker"] = logical
            yield _to_wire(batch) if info is not None else batch
            t += W


# Tensors up to this size leave a worker pickled in the message itself (as numpy arrays) rather than
# through shared memory. torch sends every tensor storage as a file descriptor, and receiving one costs
# the main process a connection to the worker's resource sharer with an authentication handshake (about
# 0.7 ms each, measured): a batch's five small tensors (token ids, sizes, seeds) cost more than its pixels.
INBAND_MAX_BYTES = 64 * 1024


def _to_wire(batch: Dict[str, Any]) -> Dict[str, Any]:
    """In a worker: small tensors become numpy arrays, so they travel inside the pickled batch."""
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.numel() * v.element_size() <= INBAND_MAX_BYTES:
            batch[k] = _Inband(v.numpy())
    return batch


def _from_wire(batch: Dict[str, Any]) -> None:
    """In the main process: the small tensors back (``torch.from_numpy``: no copy)."""
    for k, v in batch.items():
        if isinstance(v, _Inband):
            batch[k] = torch.from_numpy(v.array)


class _Inband:
    """A numpy array marked as a tensor in transit (a batch may hold numpy arrays of its own)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __reduce__(self):
        return (_Inband, (self.array,))


class TrainLoader:
    """Infinite batches for one rank: ``{"pixel_values", "input_ids", "captions", "keys", "epochs"}``.

    * ``pixel_values``: uint8 [B, 3, H, W] (H = W = resolution unless aspect buckets are on); the consumer
      moves them to its device and scales them to [-1, 1] there (``transforms.unit_range``);
    * ``input_ids``: int64 [B, tokenizer.model_max_length];
    * ``captions``: the captions after dropout/shuffling ('' when dropped); ``keys``: sample names;
      ``epochs``: the data epoch each sample was read in; ``sample_seeds``: int64 [B], the seed of each
      sample's draws in the training step (a function of the seed and the sample's position only).

    ``dataset.params.references`` = R (edit training, see :mod:`.references`): ``reference_values`` uint8
    [B, R, 3, H, W] beside ``pixel_values`` (``reference_latents`` float32 [B, R, C, h, w] from latent shards).

    ``dataset.type=latents`` (see :mod:`.latents`): ``latents`` float32 [B, C, h, w], already multiplied
    by the VAE scaling factor, replaces ``pixel_values``; with ``text_embeddings`` the batch also holds
    ``encoder_hidden_states`` float32 [B, L, D]. ``latent_scaling_factor`` is the shards' factor and
    ``latents_info`` their ``latents_info.json`` (None for image data or when unreadable): check them
    against the VAE and text encoder the run uses.

    Resume (``state_dict`` / ``load_state_dict``): the position is that of every canonical reader. With
    the same readers and data, the batches after a restore are those an uninterrupted run would have
    given, on the same layout (identical, per rank) and on any other one whose rank count divides the
    readers (the same global micro-batches; ``load_state_dict`` takes every saved rank's state and gives
    each reader's position to its new owner). Otherwise (other data, seed, batch size or readers, or a
    rank count that does not divide them) the position is approximate: finite mode restarts at the oldest
    unit not fully read by every reader (a few shards may repeat; samples in shuffle buffers are lost),
    resampled mode continues with fresh draws; the counters carry over in both cases.
    """

    def __init__(self, plan: Plan, proc: SampleProcessor, *, num_examples_to_see: Optional[int], kind: str,
                 canonical_readers: int = 0):
        self.plan = plan
        self.canonical_readers = canonical_readers  # as configured (0: the first start's layout, then kept)
        self.proc = proc
        self.kind = kind
        self.batches = 0  # batches yielded by this rank since the run started (since the layout's start)
        self._states: Dict[int, Dict] = {}  # canonical reader -> position after its last yielded batch
        self._counts: Counter = Counter()
        self._epoch = 0
        self.resumed_from: Optional[str] = None  # the saved layout, when it differs from this run's
        per_step = plan.world_size * plan.batch_size
        self.steps_total = math.ceil(num_examples_to_see / per_step) if num_examples_to_see else None
        self.num_samples = _known_samples(plan)
        # Set by build_train_loader for latent shards: the shards' scaling factor and latents_info.json.
        self.latent_scaling_factor: Optional[float] = None
        self.latents_info: Optional[Dict[str, Any]] = None

    @property
    def epoch(self) -> int:
        """The oldest data epoch any reader of this rank is still reading."""
        return self._epoch

    def readers(self) -> List[int]:
        """The canonical readers this rank owns."""
        return [self.plan.reader_of(t) for t in range(self.plan.readers_per_rank)]

    @property
    def layout(self) -> str:
        p = self.plan
        return f"{p.world_size} rank(s) x {p.workers_per_rank if p.workers else 0} worker(s)"

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        W = self.plan.workers_per_rank
        dataset = _ReaderDataset(self.plan, self.proc, dict(self._states), self.batches)
        if self.plan.workers == 0:
            source = iter(dataset)
        else:
            source = iter(
                DataLoader(
                    dataset,
                    batch_size=None,
                    num_workers=W,
                    prefetch_factor=PREFETCH_BATCHES,
                    persistent_workers=False,  # a new iter() must start from the loader's current position
                    pin_memory=torch.cuda.is_available(),  # lets the loop's .to(device, non_blocking=True) overlap
                    # Its own generator: without one, creating the iterator draws the workers' base seed
                    # from the global RNG, so a resumed run's noise stream would be one draw off the
                    # uninterrupted run's (every tensor differs after resume). The streams do not use the
                    # workers' torch seeds: every sample's randomness comes from its own position.
                    generator=torch.Generator().manual_seed(0),
                    worker_init_fn=loader_worker_init(),  # ignore stop signals, die with this rank
                )
            )
        try:
            for batch in source:
                _from_wire(batch)
                worker, reader = batch.pop("_worker"), batch.pop("_reader")
                expected = self.batches % W
                if worker != expected or reader != self.plan.reader_of(self.batches):
                    raise RuntimeError(f"data: batch {self.batches} came from worker {worker} (reader {reader}), "
                                       f"expected worker {expected} (reader {self.plan.reader_of(self.batches)})")
                self._states[reader] = batch.pop("_state")
                self._counts.update(batch.pop("_stats"))
                self.batches += 1
                self._epoch = min(self._epoch_of(c, st) for c, st in self._states.items())
                yield batch
        finally:
            # Stop the workers now. Left to the garbage collector (an exception's traceback keeps the
            # iterator alive in a reference cycle), torch's shutdown waits 5 s per worker.
            shutdown = getattr(source, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def _epoch_of(self, reader: int, st: Dict) -> int:
        """The oldest epoch a reader's streams are in (a mixture: each source has its own epochs)."""
        p = self.plan
        return min(p.global_index(reader, int(base), int(i)) // len(p.streams[q])
                   for q, (base, i, _) in enumerate(st["cursors"]))

    # -- the training state -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        p = self.plan
        return {
            "version": STATE_VERSION,
            "type": self.kind,
            "seed": p.seed,
            "rank": p.rank,
            "world_size": p.world_size,
            "workers": p.workers_per_rank if p.workers else 0,  # loader processes (0: in the training process)
            "readers": p.readers,
            "resampled": p.resampled,
            "n_units": len(p.units),
            "streams": len(p.streams),  # 1, or a mixture's sources
            "batch_size": p.batch_size,
            "batches": self.batches,
            "epoch": self._epoch,
            "reader_states": {str(k): v for k, v in self._states.items()},
            "stats": dict(self._counts),
        }

    def load_state_dict(self, saved: Union[Dict[str, Any], List[Dict[str, Any]]]) -> None:
        """Continue from saved positions: every saved rank's ``state_dict()`` (a list, in rank order), or
        this rank's alone when the layout is unchanged."""
        sds = [_upgrade(sd) for sd in (saved if isinstance(saved, list) else [saved])]
        p = self.plan
        first = sds[0]
        old_world = int(first["world_size"])
        if len(sds) == 1 and old_world > 1:  # one rank's state: only good for that same rank and layout
            if int(first["rank"]) != p.rank or old_world != p.world_size:
                raise ValueError(f"data state of rank {first['rank']} of {old_world} given to rank {p.rank} of "
                                 f"{p.world_size}; pass every rank's state")
            sds = [None] * int(first["rank"]) + [first]
        mine = sds[p.rank] if old_world == p.world_size else None
        self._counts = Counter()
        for r, sd in enumerate(sds):  # every saved rank's counters go to one rank: their sum is kept
            if sd is not None and r % p.world_size == p.rank:
                self._counts.update(sd.get("stats", {}))
        self._epoch = int((mine or first).get("epoch", 0))
        states = {int(c): st for sd in sds if sd is not None for c, st in sd["reader_states"].items()}
        saved_layout = f"{old_world} rank(s) x {first['workers']} worker(s)"
        if saved_layout != self.layout:
            self.resumed_from = saved_layout
        changed = {k: (first.get(k), v) for k, v in self._same_data().items() if first.get(k) != v}
        readers = int(first["readers"])
        consumed = int(first["batches"]) * old_world  # every rank takes the same number of micro-batches
        why = None
        if changed:
            why = ", ".join(f"{k}={a!r} (now {b!r})" for k, (a, b) in changed.items())
        elif self.canonical_readers and self.canonical_readers != readers:
            why = f"canonical_readers={readers} (now {self.canonical_readers})"
        elif readers % p.world_size:
            why = f"{readers} canonical readers cannot be split over {p.world_size} ranks"
        elif consumed % p.world_size:
            why = f"{consumed} micro-batches consumed in all cannot be split over {p.world_size} ranks"
        if why is None:
            if readers != p.readers:
                self.plan = dataclasses.replace(p, readers=readers)
            mine = set(self.readers())
            self._states = {c: st for c, st in states.items() if c in mine}
            self.batches = consumed // p.world_size
            log.info("data: resumed rank %d at batch %d (exact position: %d readers%s)", p.rank, self.batches,
                     readers, f", saved by {saved_layout}" if self.resumed_from else "")
            return
        self._restart_approximately(states, readers, why)

    def _same_data(self) -> Dict[str, Any]:
        p = self.plan
        return {"seed": p.seed, "n_units": len(p.units), "resampled": p.resampled, "type": self.kind,
                "batch_size": p.batch_size, "streams": len(p.streams)}

    def _restart_approximately(self, states: Dict[int, Dict], readers: int, why: str) -> None:
        """Every reader of this run from one common unit per stream, agreed by all ranks (they read the
        same states)."""
        p = self.plan
        bases = []
        for q in range(len(p.streams)):
            g = [int(c[0]) + r + int(c[1]) * readers for r, st in states.items()
                 for qq, c in enumerate(st["cursors"]) if qq == q and len(st["cursors"]) == len(p.streams)]
            bases.append((min(g) if not p.resampled else max(g) + 1) if g else 0)
        self._states = {
            c: {"cursors": [[b, 0, 0] for b in bases], "batches": 0, "rng": None, "mix": None, "buffer": [],
                "buckets": {}}
            for c in self.readers()
        }
        self.batches = 0  # the round-robin restarts at worker 0
        log.warning("data: the saved position differs from this run (%s): position is approximate (restarting "
                    "at global unit %s); see TrainLoader docs", why, "/".join(map(str, bases)))

    def stats(self) -> Dict[str, float]:
        """Counters for this rank (see :mod:`.stats`), plus ``epoch`` and ``batches``."""
        out = summarize(self._counts)
        out["epoch"] = self._epoch
        out["batches"] = self.batches
        return out


def _upgrade(sd: Dict[str, Any]) -> Dict[str, Any]:
    """A saved state in this version's form. Version 1 (before canonical readers) kept one position per
    worker slot ``rank x W + w`` with ``world_size x W`` slots: the same unit sequences as that many readers."""
    version = int(sd.get("version", -1))
    if version == STATE_VERSION:
        return sd
    if version != 1:
        raise ValueError(f"data loader state has version {sd.get('version')}, this code reads {STATE_VERSION}")
    W, r = int(sd["workers"]), int(sd["rank"])
    out = {k: v for k, v in sd.items() if k != "worker_states"}

    def reader_state(st):
        return {"cursors": [[int(st["base"]), int(st["i"]), int(st["j"])]], "batches": st["batches"], "rng": st["rng"],
                "mix": None, "buffer": [[0, *ref] for ref in st["buffer"]],
                "buckets": {k: [[0, *ref] for ref in v] for k, v in st["buckets"].items()}}

    out.update(version=STATE_VERSION, readers=int(sd["world_size"]) * W, streams=1,
               reader_states={str(r * W + int(w)): reader_state(st) for w, st in sd["worker_states"].items()})
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
        f"{p.workers_per_rank if p.workers else 0} worker(s), batch {p.batch_size}, {p.readers} canonical readers "
        f"({p.readers_per_rank} on this rank), shuffle buffer {p.shuffle_buffer} per reader"
    ]
    if loader.kind == "latents":
        proc = loader.proc
        lines.append(
            f"data: latent shards ({'/'.join(sorted({str(s) for s in proc.stores}))}), latent_sampling "
            f"{proc.sampling}, scaling factor {loader.latent_scaling_factor}, text embeddings "
            f"{'from the shards' if proc.text_embeddings else 'computed by the loop'}"
        )
    if p.weights is not None:
        total = sum(p.weights)
        lines.append("data: mixture (share of selected samples): " + ", ".join(
            f"{src.name} {w / total:.1%} ({len(p.streams[k])} units{', dropped when read once' if p.exhausted[k] == 'drop' else ''})"
            for k, (src, w) in enumerate(zip(p.sources, p.weights))))
    if loader.proc.filters:
        lines.append("data: metadata filters: " + ", ".join(f"{f.key} {f.text}" for f in loader.proc.filters))
    if loader.num_samples:
        lines.append(f"data: {loader.num_samples} samples before filtering")
        if loader.steps_total:
            seen = loader.steps_total * p.world_size * p.batch_size
            lines.append(f"data: num_examples_to_see ~ {seen / loader.num_samples:.2f} epochs of the unfiltered data")
    return lines
