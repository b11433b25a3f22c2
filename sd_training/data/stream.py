"""The stream of one *canonical reader* and its exact, cheap-to-restore position.

Readers, ranks and workers
--------------------------
A run has ``C`` canonical readers (``dataset.params.canonical_readers``; by default ``world_size x
workers`` of the first start, then kept by every resume). Each is a deterministic stream of
micro-batches that depends on the seed, the data, the batch size and ``C`` only. The run's sequence of
micro-batches is layout-free: micro-batch ``n`` is reader ``n mod C``'s batch number ``n div C``, and
optimizer step ``s`` takes micro-batches ``[s N, (s + 1) N)`` (``N`` = global batch / batch size).
Rank ``r`` of ``R`` (``R`` divides ``C``) takes the micro-batches ``n = r (mod R)``: its ``t``-th is
reader ``r + R (t mod C/R)``, so it owns the readers ``r, r + R, ...`` and no other rank reads them. Its
loader workers (a divisor ``W`` of ``C/R``) take its batches round-robin, worker ``t mod W`` the
``t``-th, so worker ``w`` serves the readers at ``w, w + W, ...`` of the rank's list. Whatever ``R`` and
``W``, step ``s`` trains on the same samples; see :class:`~.loader.TrainLoader` for the resume.

Which unit (shard) a reader reads
---------------------------------
Reader ``k``'s ``i``-th unit is the one at global index ``g = base + k + i x C`` of an infinite sequence:

* finite mode: the sequence is epoch 0's permutation of the units, then epoch 1's, ... (epoch ``e``
  shuffled by ``numpy.random.default_rng(seed + e)``). Every unit goes to exactly one slot per epoch: no
  duplicates, no loss, and no reader idles or repeats when the unit count is not a multiple of ``C``
  (epochs simply continue into each other, as ``with_epoch`` does in open_clip). Every rank yields
  batches forever, so no rank ever waits for another at an epoch end (no DDP hang).
* resampled mode: unit ``g`` is drawn uniformly with replacement by ``default_rng([seed, g])``.

Either way the unit of any ``(reader, i)`` is computed directly, never by replaying history.

Position and restore
--------------------
Stages (see :meth:`SlotStream.__iter__`): read unit -> select (metadata, filters) -> shuffle buffer ->
process (decode, augment) -> bucket -> batch. Every sample is named by ``ref = (i, j)``: the ``j``-th
sample of the reader's ``i``-th unit; its random augmentations come from its own generator seeded by
``(seed, g, j)``, and its ``sample_seed`` (which the training step draws its noise and timesteps from) is a
function of the same three numbers. The position attached to each batch is: the read cursor ``(i, j)``, the refs of the
samples waiting in the shuffle buffer and in each bucket, and the shuffle generator's state. Restoring
re-reads only the units those refs point to (a few shards), rebuilds the buffer and buckets, and goes on:
the batches that follow are identical to an uninterrupted run's.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np
import torch

from .samples import SampleProcessor
from .sources import ShardError, Source
from .stats import Stats, log

# Rule for "this source yields no valid sample at all" (checked per slot, per source): no sample was
# ever selected after trying every unit of the source or this many units, or no sample ever decoded
# after this many decode failures.
NO_VALID_MAX_UNITS = 64
NO_VALID_MAX_FAILURES = 64


@dataclass
class Plan:
    """Everything a slot needs to know which unit to read next. Built once, pickled to the workers."""

    sources: List[Source]
    units: List[Tuple[int, Any]]  # (source index, unit)
    seed: int
    rank: int
    world_size: int
    workers: int  # as configured (0: read in the training process)
    resampled: bool
    batch_size: int
    shuffle_buffer: int
    readers: int = 0  # canonical readers C (0: world_size x max(workers, 1))

    def __post_init__(self):
        if self.readers <= 0:
            self.readers = self.world_size * max(1, self.workers)

    def layout_error(self) -> Optional[str]:
        """Why this rank count cannot serve the readers, or None."""
        if self.readers % self.world_size:
            return (f"{self.readers} canonical readers cannot be split over {self.world_size} ranks; the rank "
                    f"count must divide them ({_divisors(self.readers)})")
        return None

    @property
    def readers_per_rank(self) -> int:
        return self.readers // self.world_size

    @property
    def workers_per_rank(self) -> int:
        """Loader processes of one rank (1 when reading in-process): the largest divisor of the rank's
        reader count not above ``workers``, so every worker serves the same number of readers."""
        k = self.readers_per_rank
        return max(d for d in range(1, max(1, min(self.workers, k)) + 1) if k % d == 0)

    @property
    def n_slots(self) -> int:
        return self.readers

    def reader_of(self, t: int) -> int:
        """The canonical reader of this rank's ``t``-th micro-batch."""
        return self.rank + self.world_size * (t % self.readers_per_rank)

    def global_index(self, reader: int, base: int, i: int) -> int:
        return base + reader + i * self.readers

    def unit_at(self, g: int) -> Tuple[int, int]:
        """(unit index, epoch) at global index ``g``."""
        n = len(self.units)
        epoch = g // n
        if self.resampled:
            return int(np.random.default_rng([self.seed, g]).integers(n)), epoch
        return int(_permutation(self.seed + epoch, n)[g % n]), epoch


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def _sample_rng(seed: int, g: int, j: int) -> np.random.Generator:
    return np.random.default_rng([seed, g, j, 0x5A])


def sample_seed(seed: int, g: int, j: int) -> int:
    """The 63-bit seed of the training step's draws (noise, timesteps) for sample ``j`` of unit ``g``."""
    a, b = np.random.SeedSequence([seed, g, j, 0x5EED]).generate_state(2, np.uint32)
    return (int(a) << 31) ^ int(b)


class SlotStream:
    """Batches of one canonical reader, forever. ``state`` (from a batch's ``_state``) resumes exactly."""

    def __init__(self, plan: Plan, proc: SampleProcessor, reader: int, state: Optional[Dict] = None):
        self.plan = plan
        self.proc = proc
        self.slot = reader
        self.stats = Stats()
        self.base = 0
        self.i = 0  # index of the unit being read in this slot's sequence
        self.j = 0  # samples of that unit already taken
        self.batches = 0
        self.rng = np.random.default_rng([plan.seed, self.slot, 0xB0FF])
        self.buffer: List[Dict[str, Any]] = []
        self.buckets: Dict[Tuple[int, int], List[Dict[str, Any]]] = {}
        n_src = len(plan.sources)
        self._units_of_source = Counter(s for s, _ in plan.units)
        self._selected = [0] * n_src
        self._ok = [0] * n_src
        self._failed = [0] * n_src
        self._tried: List[Set[int]] = [set() for _ in range(n_src)]
        self._tries = [0] * n_src
        self._state = state

    # -- the stages --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Dict[str, Any]]:
        """read units -> select (json, filters, caption: no decode) -> shuffle buffer (encoded bytes)
        -> process (header, min size, bucket, reduced decode, crop/flip, caption augment) -> bucket -> batch."""
        if self._state is not None:
            self._restore(self._state)
            self._state = None
        batch_size = self.plan.batch_size
        for sample in self._shuffle(self._select(self._read())):
            out = self._process(sample)
            if out is None:
                continue
            bucket = self.buckets.setdefault(out["bucket"], [])
            bucket.append(out)
            if len(bucket) == batch_size:
                del self.buckets[out["bucket"]]
                yield self._emit(bucket)

    def _read(self) -> Iterator[Dict[str, Any]]:
        """Raw samples of this slot's units, each tagged with its ``ref``; advances the cursor."""
        while True:
            g = self.plan.global_index(self.slot, self.base, self.i)
            unit_idx, epoch = self.plan.unit_at(g)
            src, unit = self.plan.units[unit_idx]
            source = self.plan.sources[src]
            self.stats.add("shards_read")
            self._tries[src] += 1
            self._tried[src].add(unit_idx)
            skip = self.j
            try:
                for j, raw in enumerate(source.read(unit, self.stats)):
                    if j < skip:
                        continue
                    self.j = j + 1  # counted as taken before it is handed on
                    raw.update(ref=(self.i, j), src=src, epoch=epoch, g=g)
                    yield raw
            except ShardError as exn:
                self.stats.skip(exn.reason, f"{exn} (source {source.name})")
            self._check_source(src)
            self.i += 1
            self.j = 0

    def _select(self, raws: Iterator[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        for raw in raws:
            s = self.proc.select(raw, self.stats)
            if s is None:
                continue
            s.update(ref=raw["ref"], src=raw["src"], epoch=raw["epoch"], g=raw["g"])
            self._selected[raw["src"]] += 1
            yield s

    def _shuffle(self, samples: Iterator[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        """A buffer of ``shuffle_buffer`` selected (still encoded) samples; emits a random one per new one."""
        size = self.plan.shuffle_buffer
        buf = self.buffer
        for s in samples:
            buf.append(s)
            if len(buf) >= size:
                k = int(self.rng.integers(len(buf)))
                buf[k], buf[-1] = buf[-1], buf[k]
                yield buf.pop()

    def _process(self, s: Dict[str, Any], stats: Optional[Stats] = None) -> Optional[Dict[str, Any]]:
        rng = _sample_rng(self.plan.seed, s["g"], s["ref"][1])
        out = self.proc.process(s, rng, stats or self.stats)
        src = s["src"]
        if out is None:
            self._failed[src] += 1
            if self._ok[src] == 0 and self._failed[src] >= NO_VALID_MAX_FAILURES:
                self._no_valid(src, f"{self._failed[src]} samples failed to decode and none succeeded")
            return None
        self._ok[src] += 1
        out.update(ref=s["ref"], epoch=s["epoch"], sample_seed=sample_seed(self.plan.seed, s["g"], s["ref"][1]))
        return out

    def _emit(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        batch = self.proc.collate(samples)
        batch["sample_seeds"] = torch.tensor([s["sample_seed"] for s in samples], dtype=torch.int64)
        self.batches += 1
        self.stats.add("samples_seen", len(samples))
        self.stats.add(f"bucket/{samples[0]['bucket'][0]}x{samples[0]['bucket'][1]}", len(samples))
        batch["_reader"] = self.slot
        batch["_state"] = self.state()
        batch["_stats"] = self.stats.take_delta()
        return batch

    # -- errors --------------------------------------------------------------------------------------
    def _check_source(self, src: int) -> None:
        if self._selected[src] or self._ok[src]:
            return
        n_units = self._units_of_source[src]
        if len(self._tried[src]) >= n_units or self._tries[src] >= NO_VALID_MAX_UNITS:
            self._no_valid(src, f"{self._tries[src]} unit(s) read ({len(self._tried[src])} of its {n_units} distinct)")

    def _no_valid(self, src: int, what: str) -> None:
        skipped = {k[len("skipped/") :]: v for k, v in self.stats.counts.most_common() if k.startswith("skipped/")}
        raise RuntimeError(
            f"dataset source {self.plan.sources[src].name!r} yields no valid sample: {what} "
            f"in reader {self.slot} of rank {self.plan.rank}; skipped so far by reason: {skipped or 'none'}. "
            "Check dataset.params.path, the filters, and the image/caption member or column names."
        )

    # -- position ------------------------------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        """Plain lists and ints only (safe for ``torch.load(weights_only=True)``)."""
        return {
            "base": self.base,
            "i": self.i,
            "j": self.j,
            "batches": self.batches,
            "rng": self.rng.bit_generator.state,
            "buffer": [list(s["ref"]) for s in self.buffer],
            "buckets": {f"{w}x{h}": [list(s["ref"]) for s in v] for (w, h), v in self.buckets.items()},
        }

    def _restore(self, st: Dict[str, Any]) -> None:
        self.base, self.i, self.j, self.batches = int(st["base"]), int(st["i"]), int(st["j"]), int(st["batches"])
        if st.get("rng") is not None:
            self.rng.bit_generator.state = st["rng"]
        buffer_refs = [tuple(r) for r in st["buffer"]]
        bucket_refs = {k: [tuple(r) for r in v] for k, v in st["buckets"].items()}
        wanted: Dict[int, Set[int]] = {}
        for i, j in buffer_refs + [r for refs in bucket_refs.values() for r in refs]:
            wanted.setdefault(i, set()).add(j)
        quiet = Stats()  # re-reading must not count samples twice
        raws: Dict[Tuple[int, int], Dict[str, Any]] = {}
        for i in sorted(wanted):
            g = self.plan.global_index(self.slot, self.base, i)
            unit_idx, epoch = self.plan.unit_at(g)
            src, unit = self.plan.units[unit_idx]
            need = wanted[i]
            try:
                for j, raw in enumerate(self.plan.sources[src].read(unit, quiet)):
                    if j in need:
                        raw.update(ref=(i, j), src=src, epoch=epoch, g=g)
                        raws[(i, j)] = raw
                        if sum(1 for jj in need if (i, jj) in raws) == len(need):
                            break
            except ShardError as exn:
                log.warning("data: restoring reader %d: %s; its buffered samples are lost", self.slot, exn)

        def selected(ref):
            raw = raws.get(ref)
            s = self.proc.select(raw, quiet) if raw is not None else None
            if s is not None:
                s.update(ref=raw["ref"], src=raw["src"], epoch=raw["epoch"], g=raw["g"])
            return s

        lost = 0
        self.buffer = []
        for ref in buffer_refs:
            s = selected(ref)
            if s is None:
                lost += 1
            else:
                self.buffer.append(s)
                self._selected[s["src"]] += 1
        self.buckets = {}
        for key, refs in bucket_refs.items():
            w, h = (int(x) for x in key.split("x"))
            for ref in refs:
                s = selected(ref)
                out = self._process(s, quiet) if s is not None else None
                if out is None:
                    lost += 1
                else:
                    self.buckets.setdefault((w, h), []).append(out)
        if lost:
            log.warning("data: restoring reader %d: %d buffered samples could not be re-read", self.slot, lost)
