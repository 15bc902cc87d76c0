"""Prometheus text read with prometheus_client's parser, and what the console derives from it.

A scrape is grouped by sample name (`x_bucket`, `x_total`, ...). Counters and histograms are
cumulative over the server's life, so `MetricWindow` keeps recent scrapes and answers rates
and quantiles from the change over a stated window: never the lifetime, never the raw
difference between two polls.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from console.sources.base import SourceError
from engine.snapshot import Percentiles

Samples = dict[str, list[Sample]]
Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), by bound

WINDOW_S = 60.0  # rates and percentiles cover the last minute, as `rate(x[1m])` would
MIN_WINDOW_S = 10.0  # below this a window is two polls apart: too noisy to show


def parse_samples(text: str) -> Samples:
    """Every sample of a /metrics body, grouped by its full name."""
    grouped: Samples = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                grouped[sample.name].append(sample)
    except ValueError as exc:  # the parser names the line it could not read
        raise SourceError(f"unreadable Prometheus text: {exc}") from exc
    return dict(grouped)


def total(samples: Samples, name: str) -> float | None:
    """The sum over every label set of `name`, or None when the server does not export it;
    SourceError when a value is not finite (the figure is unknown, never shown as live)."""
    found = samples.get(name)
    return None if not found else sum(_finite(s) for s in found)


def first(samples: Samples, *names: str) -> float | None:
    """The total of the first of `names` the server exports (newer names first)."""
    return next((v for v in (total(samples, n) for n in names) if v is not None), None)


def label(samples: Samples, name: str, key: str) -> str | None:
    """Label `key` of the first sample of `name` (info gauges carry their data in labels)."""
    for sample in samples.get(name, ()):
        if key in sample.labels:
            return sample.labels[key]
    return None


def histogram_buckets(samples: Samples, name: str) -> Buckets:
    """(upper bound, cumulative count) of histogram `name`, summed over label sets, by bound."""
    counts: dict[float, float] = defaultdict(float)
    for sample in samples.get(f"{name}_bucket", []):
        bound = sample.labels.get("le")
        if bound is not None:
            counts[float(bound)] += _finite(sample)  # float("+Inf") is inf: a bound, fine
    return tuple(sorted(counts.items()))


def _finite(sample: Sample) -> float:
    if not math.isfinite(sample.value):
        raise SourceError(f"{sample.name} is {sample.value}: its figures are unknown until "
                          "the server answers numbers")
    return sample.value


def histogram_quantile(buckets: Buckets, q: float) -> float | None:
    """Prometheus' estimate: linear inside the bucket holding rank q·count; None if empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):  # past the last finite bucket: its bound is all we know
                return lower_bound
            if count == lower_count:
                return bound
            share = (rank - lower_count) / (count - lower_count)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def percentiles(buckets: Buckets, scale: float = 1.0) -> Percentiles:
    """p50/p90/p99 of a (delta) histogram, times `scale` (1000 for seconds to ms)."""
    def at(q: float) -> float | None:
        value = histogram_quantile(buckets, q)
        return None if value is None else value * scale

    return Percentiles(p50=at(0.50), p90=at(0.90), p99=at(0.99))


@dataclass(frozen=True)
class Reading:
    """The cumulative series one scrape holds that the window differences."""

    ts: float
    counters: dict[str, float]
    histograms: dict[str, Buckets]

    @classmethod
    def of(cls, ts: float, samples: Samples, counters: tuple[str, ...],
           histograms: tuple[str, ...]) -> Reading:
        found = {n: v for n in counters if (v := total(samples, n)) is not None}
        return cls(ts, found, {n: b for n in histograms if (b := histogram_buckets(samples, n))})


MAX_READINGS = 4096


class MetricWindow:
    """Recent readings; each figure is the newest minus the reading about WINDOW_S older.

    A counter that went down means the server restarted: the window starts again.
    """

    def __init__(self, span_s: float = WINDOW_S, min_span_s: float = MIN_WINDOW_S) -> None:
        self.span_s = span_s
        self.min_span_s = min_span_s
        # bounded: a clock that does not move never ages a reading out
        self.readings: deque[Reading] = deque(maxlen=MAX_READINGS)

    def add(self, reading: Reading) -> None:
        if self.readings and _went_down(self.readings[-1], reading):
            self.readings.clear()
        self.readings.append(reading)
        # Keep the newest reading that is at least span_s old as the base, drop older ones.
        while len(self.readings) > 2 and reading.ts - self.readings[1].ts >= self.span_s:
            self.readings.popleft()

    @property
    def seconds(self) -> float:
        """The span the figures cover; 0 until it reaches min_span_s."""
        if len(self.readings) < 2:
            return 0.0
        span = self.readings[-1].ts - self.readings[0].ts
        return span if span >= self.min_span_s else 0.0

    def delta(self, name: str) -> float | None:
        if not self.seconds:
            return None
        new, old = self.readings[-1].counters.get(name), self.readings[0].counters.get(name)
        return None if new is None or old is None else new - old

    def rate(self, name: str) -> float | None:
        change = self.delta(name)
        return None if change is None else change / self.seconds

    def histogram(self, name: str) -> Buckets:
        """The histogram of what was observed inside the window (empty before it fills)."""
        if not self.seconds:
            return ()
        new, old = self.readings[-1].histograms.get(name), self.readings[0].histograms.get(name)
        if not new:
            return ()
        before = dict(old or ())
        return tuple((bound, count - before.get(bound, 0.0)) for bound, count in new)


def _went_down(old: Reading, new: Reading) -> bool:
    return any(new.counters.get(name, value) < value for name, value in old.counters.items())


# Re-exported so sources name one module for everything Prometheus.
__all__ = ["Buckets", "MetricWindow", "Reading", "Sample", "Samples", "first", "histogram_buckets",
           "histogram_quantile", "label", "parse_samples", "percentiles", "total"]
