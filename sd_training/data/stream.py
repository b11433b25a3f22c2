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

Weighted mixtures
-----------------
With ``dataset.params.sources`` weights, each source is a stream of its own (its units, its epochs, the
same reader rule), and a reader takes its next *selected* sample (one that passed the metadata filters)
from the source a smooth weighted round-robin names: every source's credit grows by its weight, the
largest credit wins and pays the total. Over any window each source's share of the selected samples is
its weight to within one sample per reader, however many of its samples the filters reject. A finite
source set to ``exhausted: drop`` leaves the mixture of a reader when that reader reaches its second epoch.

Position and restore
--------------------
Stages (see :meth:`SlotStream.__iter__`): read unit -> select (metadata, filters) -> shuffle buffer ->
process (decode, augment) -> bucket -> batch. A sample on which a stage raises anything (an
``Exception``: RecursionError on deeply nested json, MemoryError in a decode, a type nobody foresaw) is
skipped and counted as ``skipped/sample_error:<type>``, logged with its shard and key; a unit whose reader
fails keeps the samples read so far (``shard_error:<type>``); a batch that does not collate is dropped
(``collate_error:<type>``, one count per sample). ``KeyboardInterrupt``/``SystemExit``, a stalled shard
(:class:`~.sources.ShardError`) and the "yields no valid sample" stop are not caught. Every sample is named by ``ref = (q, i, j)``: the ``j``-th
sample of the reader's ``i``-th unit of stream ``q`` (0 without a mixture, the source with one); its random augmentations come from its own generator seeded by
``(seed, g, j)``, and its ``sample_seed`` (which the training step draws its noise and timesteps from) is a
function of the same three numbers. The position attached to each batch is: the read cursor ``(i, j)``, the refs of the
samples waiting in the shuffle buffer and in each bucket, and the shuffle generator's state. Restoring
re-reads only the units those refs point to (a few shards), rebuilds the buffer and buckets, and goes on:
the batches that follow are identical to an uninterrupted run's. The mixture's credits are part of it.
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
from .stats import Stats, describe_error, error_reason, log

# Rule for "this source yields no valid sample at all" (checked per slot, per source): no sample was
# ever selected after trying every unit of the source or this many units, or no sample ever decoded
# after this many decode failures.
NO_VALID_MAX_UNITS = 64
NO_VALID_MAX_FAILURES = 64


@dataclass
class Plan:
    """Everything a reader needs to know which unit to read next. Built once, pickled to the workers."""

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
    weights: Optional[List[float]] = None  # a weighted mixture: one stream per source (None: one pooled stream)
    exhausted: Optional[List[str]] = None  # per source with weights: "restart" or "drop"

    def __post_init__(self):
        if self.readers <= 0:
            self.readers = self.world_size * max(1, self.workers)
        if self.weights is None:
            self.streams = [list(range(len(self.units)))]
        else:
            self.streams = [[u for u, (s, _) in enumerate(self.units) if s == k] for k in range(len(self.sources))]

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

    def unit_at(self, g: int, q: int = 0) -> Tuple[int, int]:
        """(unit index, epoch) at global index ``g`` of stream ``q``."""
        stream = self.streams[q]
        n = len(stream)
        epoch = g // n
        if self.weights is None:  # the pooled stream
            if self.resampled:
                return int(np.random.default_rng([self.seed, g]).integers(n)), epoch
            return int(_permutation(self.seed + epoch, n)[g % n]), epoch
        if self.resampled:
            return stream[int(np.random.default_rng([self.seed, q, g, 0x317]).integers(n))], epoch
        return stream[int(_permutation((self.seed, q, epoch), n)[g % n])], epoch

    def sample_key(self, g: int, q: int) -> int:
        """A number naming unit ``g`` of stream ``q`` across all streams (the samples' generators use it)."""
        return g if self.weights is None else g * len(self.streams) + q


@functools.lru_cache(maxsize=16)
def _permutation(seed, n: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n)


def _sample_rng(seed: int, g: int, j: int) -> np.random.Generator:
    return np.random.default_rng([seed, g, j, 0x5A])


def sample_seed(seed: int, g: int, j: int) -> int:
    """The 63-bit seed of the training step's draws (noise, timesteps) for sample ``j`` of unit ``g``."""
    a, b = np.random.SeedSequence([seed, g, j, 0x5EED]).generate_state(2, np.uint32)
    return (int(a) << 31) ^ int(b)


class Mixer:
    """Smooth weighted round-robin over the sources of a mixture: exact shares over any window."""

    def __init__(self, weights: List[float]):
        self.weights = [float(w) for w in weights]
        self.credit = [0.0] * len(weights)
        self.active = [True] * len(weights)

    def next(self) -> int:
        live = [k for k, a in enumerate(self.active) if a]
        total = sum(self.weights[k] for k in live)
        for k in live:
            self.credit[k] += self.weights[k]
        best = max(live, key=lambda k: self.credit[k])
        self.credit[best] -= total
        return best

    def drop(self, k: int) -> None:
        self.active[k], self.credit[k] = False, 0.0
        if not any(self.active):
            raise RuntimeError("data: every source of the mixture is exhausted (exhausted: drop on all of them)")

    def state(self) -> Dict[str, Any]:
        return {"credit": list(self.credit), "active": list(self.active)}

    def load(self, st: Dict[str, Any]) -> None:
        self.credit, self.active = [float(c) for c in st["credit"]], [bool(a) for a in st["active"]]


class _SourceStats:
    """What select() counts for a sample of a mixture's source, counted for that source too."""

    def __init__(self, stats: Stats, name: str):
        self.stats, self.prefix = stats, f"source/{name}/"

    def add(self, key: str, n: int = 1) -> None:
        self.stats.add(key, n)
        self.stats.add(self.prefix + key, n)

    def skip(self, reason: str, detail: str) -> None:
        self.stats.skip(reason, detail)
        self.stats.add(f"{self.prefix}skipped/{reason}")


class SlotStream:
    """Batches of one canonical reader, forever. ``state`` (from a batch's ``_state``) resumes exactly."""

    def __init__(self, plan: Plan, proc: SampleProcessor, reader: int, state: Optional[Dict] = None):
        self.plan = plan
        self.proc = proc
        self.slot = reader
        self.stats = Stats()
        # Per stream: [base, i (the unit being read), j (samples of it already taken)].
        self.cursors = [[0, 0, 0] for _ in plan.streams]
        self.batches = 0
        self.rng = np.random.default_rng([plan.seed, self.slot, 0xB0FF])
        self.mixer = Mixer(plan.weights) if plan.weights is not None else None
        self.buffer: List[Dict[str, Any]] = []
        self.buckets: Dict[Tuple[int, int], List[Dict[str, Any]]] = {}
        n_src = len(plan.sources)
        self._source_stats = [_SourceStats(self.stats, s.name) for s in plan.sources] if self.mixer else None
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
        selected = self._mixed() if self.mixer is not None else self._select(self._read(0))
        for sample in self._shuffle(selected):
            out = self._process(sample)
            if out is None:
                continue
            bucket = self.buckets.setdefault(out["bucket"], [])
            bucket.append(out)
            if len(bucket) == batch_size:
                del self.buckets[out["bucket"]]
                batch = self._emit(bucket)
                if batch is not None:
                    yield batch

    def _locate(self, q: int, base: int, i: int) -> Tuple[int, int, int, int]:
        """(global index, unit index, epoch, source index) of unit ``i`` of this reader's stream ``q``."""
        g = self.plan.global_index(self.slot, base, i)
        unit_idx, epoch = self.plan.unit_at(g, q)
        return g, unit_idx, epoch, self.plan.units[unit_idx][0]

    def _read(self, q: int) -> Iterator[Dict[str, Any]]:
        """Raw samples of this reader's units of stream ``q``, each tagged with its ``ref``; advances the
        cursor. Ends only when a mixture's finite source set to drop reaches its second epoch."""
        cur = self.cursors[q]
        drops = self.mixer is not None and not self.plan.resampled and self.plan.exhausted[q] == "drop"
        while True:
            g, unit_idx, epoch, src = self._locate(q, cur[0], cur[1])
            if drops and epoch > 0:
                return
            source = self.plan.sources[src]
            self.stats.add("shards_read")
            self._tries[src] += 1
            self._tried[src].add(unit_idx)
            skip = cur[2]
            try:
                for j, raw in enumerate(source.read(self.plan.units[unit_idx][1], self.stats)):
                    if j < skip:
                        continue
                    cur[2] = j + 1  # counted as taken before it is handed on
                    raw.update(ref=(q, cur[1], j), src=src, epoch=epoch, g=self.plan.sample_key(g, q))
                    yield raw
            except ShardError as exn:
                self.stats.skip(exn.reason, f"{exn} (source {source.name})")
            except Exception as exn:  # any other failure of the unit's reader (a parquet row group that
                # does not convert, ...): its samples so far are kept, the unit is skipped and counted
                self.stats.skip(error_reason(exn, "shard_error"), f"{source.describe(self.plan.units[unit_idx][1])}: "
                                f"{describe_error(exn)} (source {source.name})")
            self._check_source(src)
            cur[1] += 1
            cur[2] = 0

    def _select_one(self, raw: Dict[str, Any], stats) -> Optional[Dict[str, Any]]:
        try:
            s = self.proc.select(raw, stats)
        except Exception as exn:  # any failure on one sample (RecursionError on deep json, ...): skip it
            _sample_failed(stats, "select", raw, exn)
            return None
        if s is not None:
            s.update(ref=raw["ref"], src=raw["src"], epoch=raw["epoch"], g=raw["g"])
        return s

    def _select(self, raws: Iterator[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        for raw in raws:
            s = self._select_one(raw, self.stats)
            if s is not None:
                self._selected[raw["src"]] += 1
                yield s

    def _mixed(self) -> Iterator[Dict[str, Any]]:
        """Selected samples of a mixture: each from the source the mixer names, read until one passes."""
        streams = [self._read(q) for q in range(len(self.plan.streams))]
        while True:
            q = self.mixer.next()
            for raw in streams[q]:
                s = self._select_one(raw, self._source_stats[q])
                if s is not None:
                    self._selected[q] += 1
                    self._source_stats[q].add("accepted")
                    yield s
                    break
            else:  # the source is exhausted for this reader
                self.mixer.drop(q)
                self.stats.add(f"source/{self.plan.sources[q].name}/dropped")


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
        rng = _sample_rng(self.plan.seed, s["g"], s["ref"][-1])
        try:
            out = self.proc.process(s, rng, stats or self.stats)
        except Exception as exn:  # any failure on one sample (MemoryError in a decode, ...): skip it
            _sample_failed(stats or self.stats, "process", s, exn)
            out = None
        src = s["src"]
        if out is None:
            self._failed[src] += 1
            if self._ok[src] == 0 and self._failed[src] >= NO_VALID_MAX_FAILURES:
                self._no_valid(src, f"{self._failed[src]} samples failed to decode and none succeeded")
            return None
        self._ok[src] += 1
        out.update(ref=s["ref"], epoch=s["epoch"], src=src, sample_seed=sample_seed(self.plan.seed, s["g"], s["ref"][-1]))
        return out

    def _emit(self, samples: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        try:
            batch = self.proc.collate(samples)
        except Exception as exn:  # samples that do not stack (latents of two channel counts...): all skipped
            self.stats.skip(error_reason(exn, "collate_error"), f"a batch of {len(samples)} samples "
                            f"({', '.join(repr(s['key']) for s in samples[:4])}{', ...' if len(samples) > 4 else ''}) "
                            f"does not collate: {describe_error(exn)}", n=len(samples))
            return None
        batch["sample_seeds"] = torch.tensor([s["sample_seed"] for s in samples], dtype=torch.int64)
        if getattr(self.proc, "preview", False):  # scripts/preview_data.py: each sample's source
            batch["sources"] = [self.plan.sources[s["src"]].name for s in samples]
        self.batches += 1
        self.stats.add("samples_seen", len(samples))
        self.stats.add(f"bucket/{samples[0]['bucket'][0]}x{samples[0]['bucket'][1]}", len(samples))
        if self.mixer is not None:
            for src, n in Counter(s["src"] for s in samples).items():
                self.stats.add(f"source/{self.plan.sources[src].name}/samples_seen", n)
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
            "cursors": [list(c) for c in self.cursors],
            "batches": self.batches,
            "rng": self.rng.bit_generator.state,
            "mix": self.mixer.state() if self.mixer is not None else None,
            "buffer": [list(s["ref"]) for s in self.buffer],
            "buckets": {f"{w}x{h}": [list(s["ref"]) for s in v] for (w, h), v in self.buckets.items()},
        }

    def _restore(self, st: Dict[str, Any]) -> None:
        self.cursors = [[int(x) for x in c] for c in st["cursors"]]
        self.batches = int(st["batches"])
        if st.get("rng") is not None:
            self.rng.bit_generator.state = st["rng"]
        if self.mixer is not None and st.get("mix"):
            self.mixer.load(st["mix"])
        buffer_refs = [tuple(r) for r in st["buffer"]]
        bucket_refs = {k: [tuple(r) for r in v] for k, v in st["buckets"].items()}
        quiet = Stats()  # re-reading must not count samples twice
        raws = self._reread(buffer_refs + [r for refs in bucket_refs.values() for r in refs], quiet)

        def selected(ref):
            raw = raws.get(ref)
            return self._select_one(raw, quiet) if raw is not None else None

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

    def _reread(self, refs: List[Tuple[int, int, int]], quiet: Stats) -> Dict[Tuple[int, int, int], Dict[str, Any]]:
        """The raw samples ``refs`` point to, reading each of their units once."""
        wanted: Dict[Tuple[int, int], Set[int]] = {}
        for q, i, j in refs:
            wanted.setdefault((q, i), set()).add(j)
        raws: Dict[Tuple[int, int, int], Dict[str, Any]] = {}
        for (q, i), need in sorted(wanted.items()):
            g, unit_idx, epoch, src = self._locate(q, self.cursors[q][0], i)
            try:
                found = 0
                for j, raw in enumerate(self.plan.sources[src].read(self.plan.units[unit_idx][1], quiet)):
                    if j in need:
                        raw.update(ref=(q, i, j), src=src, epoch=epoch, g=self.plan.sample_key(g, q))
                        raws[(q, i, j)] = raw
                        found += 1
                        if found == len(need):
                            break
            except Exception as exn:
                log.warning("data: restoring reader %d: %s; its buffered samples are lost", self.slot,
                            exn if isinstance(exn, ShardError) else describe_error(exn))
        return raws


def _sample_failed(stats, stage: str, sample: Dict[str, Any], exn: Exception) -> None:
    """Count and log (rate-limited) a sample whose ``stage`` raised: ``skipped/sample_error:<type>``."""
    stats.skip(error_reason(exn), f"{sample.get('url')} sample {sample.get('key')!r}: {stage} raised "
               f"{describe_error(exn)}")
