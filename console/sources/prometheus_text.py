"""Reading the Prometheus text format: samples by name, and quantiles from histogram buckets.

Small on purpose (the console does not depend on prometheus_client): names, labels and
values; comments, timestamps and exemplars are skipped.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str) -> dict[str, list[Sample]]:
    """Samples grouped by their full name (`x_bucket`, `x_total`, ...); bad lines are skipped."""
    samples: dict[str, list[Sample]] = defaultdict(list)
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None:  # comments, blank lines, anything we cannot read
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        pairs = {k: _unescape(v) for k, v in _LABEL.findall(labels or "")}
        samples[name].append(Sample(name, pairs, number))
    return dict(samples)


def total(samples: dict[str, list[Sample]], name: str) -> float | None:
    """The sum over every label set of `name`, or None when the server does not export it."""
    found = samples.get(name)
    return None if not found else sum(s.value for s in found)


def histogram_buckets(samples: dict[str, list[Sample]], name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of histogram `name`, summed over label sets, by bound."""
    counts: dict[float, float] = defaultdict(float)
    for sample in samples.get(f"{name}_bucket", []):
        bound = sample.labels.get("le")
        if bound is not None:
            counts[float(bound)] += sample.value  # float("+Inf") is inf
    return sorted(counts.items())


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
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


def _unescape(value: str) -> str:
    return value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
