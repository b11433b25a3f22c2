"""Counters of the data pipeline, and warnings logged at a bounded rate.

Counters live where the work happens (a worker process when ``workers > 0``). Each batch carries the
counter *deltas* accumulated since the previous batch of that worker (key ``"_stats"``); the loader
strips them and sums them in the main process, so ``loader.stats()`` is exact for the batches consumed
(and never double counts a prefetched batch that was not yet yielded).

Counter names:
  ``samples_read``            samples grouped from shards / rows / files
  ``samples_seen``            samples yielded in batches
  ``shards_read``             units of work (tar shard, row group, file chunk) opened
  ``skipped/<reason>``        samples (or shards) dropped, by reason; an unexpected exception while
                              reading or processing a sample is ``sample_error:<ExceptionType>`` (a
                              whole unit: ``shard_error:<ExceptionType>``, a batch: ``collate_error:...``)
  ``shards_abandoned``        tar shards stopped because a header lies (``skipped/lying_header``) or
                              skipping a member would read too much (``skipped/skip_limit``)
  ``filter/<key>/checked``    samples a metadata filter was evaluated on
  ``filter/<key>/passed``     ... and passed
  ``bucket/<W>x<H>``          samples assigned to each aspect-ratio bucket
  ``source/<name>/...``       a mixture's source: ``samples_read``, ``accepted`` (passed the filters),
                              ``skipped/<reason>``, ``filter/...``, ``samples_seen``, ``dropped``; and
                              (derived) ``share`` of the samples seen so far
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Dict, Mapping

log = logging.getLogger("sd_training.data")

# A skip reason is logged at most once per this many seconds per process (plus its first occurrence).
WARN_INTERVAL_S = 30.0


class RateLimitedLog:
    """Logs a message per key at most every ``interval`` seconds, with how many were not logged."""

    def __init__(self, interval: float = WARN_INTERVAL_S):
        self.interval = interval
        self._last: Dict[str, float] = {}
        self._suppressed: Counter = Counter()

    def warn(self, key: str, msg: str) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._suppressed[key] += 1
            return
        n = self._suppressed.pop(key, 0)
        self._last[key] = now
        log.warning("%s%s", msg, f" (+{n} more like it not logged)" if n else "")


class Stats:
    """A counter with ``skip(reason, detail)`` and delta extraction for batches."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._delta: Counter = Counter()
        self.warnings = RateLimitedLog()

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n
        self._delta[name] += n

    def skip(self, reason: str, detail: str, n: int = 1, every: str = "") -> None:
        """Count ``n`` skipped samples (or a shard) and log it at a bounded rate: per reason, or per
        ``(reason, every)`` when ``every`` is given (an abandoned shard is always named: every=its url)."""
        self.add(f"skipped/{reason}", n)
        self.warnings.warn(f"{reason}\0{every}" if every else reason, f"data: skipped ({reason}): {detail}")

    def take_delta(self) -> Dict[str, int]:
        out = dict(self._delta)
        self._delta.clear()
        return out


# Longest exception message a skip line quotes (a message can hold a whole caption or member).
MAX_ERROR_TEXT = 300


def error_reason(exn: BaseException, prefix: str = "sample_error") -> str:
    """The counter name of an unexpected failure: ``<prefix>:<exception type>``."""
    return f"{prefix}:{type(exn).__name__}"


def describe_error(exn: BaseException) -> str:
    """``Type: message`` of an exception, cut to MAX_ERROR_TEXT characters (never raises)."""
    try:
        text = str(exn)
    except Exception:  # an exception whose __str__ fails
        text = "<message unprintable>"
    if len(text) > MAX_ERROR_TEXT:
        text = text[:MAX_ERROR_TEXT] + f"... ({len(text):,} characters)"
    return f"{type(exn).__name__}: {text}" if text else type(exn).__name__


def summarize(counts: Mapping[str, int]) -> Dict[str, float]:
    """The counters plus derived ``filter/<key>/pass_rate`` and ``skipped_total`` (what the loop logs)."""
    out: Dict[str, float] = dict(counts)
    for name, checked in counts.items():
        if name.startswith("filter/") and name.endswith("/checked"):
            key = name[len("filter/") : -len("/checked")]
            passed = counts.get(f"filter/{key}/passed", 0)
            out[f"filter/{key}/pass_rate"] = passed / checked if checked else 0.0
        if name.startswith("source/") and name.endswith("/samples_seen"):  # a mixture's source
            seen = sum(v for k, v in counts.items() if k.startswith("source/") and k.endswith("/samples_seen"))
            out[name[: -len("samples_seen")] + "share"] = counts[name] / seen if seen else 0.0
    out["skipped_total"] = sum(v for k, v in counts.items() if k.startswith("skipped/"))
    out.setdefault("samples_seen", 0)
    out.setdefault("samples_read", 0)
    return out
