"""Statistics, written once: nearest-rank quantiles, the p50/p90/p99 triple and seconds to ms."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from engine.snapshot import Percentiles

MS_PER_S = 1000.0


def quantile(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank `q` quantile (0 <= q <= 1) of `values`; None when there are none."""
    return _nearest_rank(sorted(values), q)


def _nearest_rank(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def percentiles(values: Iterable[float]) -> Percentiles:
    ordered = sorted(values)  # once: a run's inter-token gaps number in the hundreds of thousands
    return Percentiles(p50=_nearest_rank(ordered, 0.50), p90=_nearest_rank(ordered, 0.90),
                       p99=_nearest_rank(ordered, 0.99))


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * MS_PER_S


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    magnitude = abs(seconds)
    if magnitude < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if magnitude < 1:
        return f"{seconds * MS_PER_S:.1f} ms"
    return f"{seconds:.2f} s" if magnitude < 10 else f"{seconds:.1f} s"


def percentiles_ms(seconds: Iterable[float]) -> Percentiles:
    p = percentiles(seconds)
    return Percentiles(p50=ms(p.p50), p90=ms(p.p90), p99=ms(p.p99))


def interpolated_quantile(ordered: list[int] | list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (lengths; latencies are nearest-rank)."""
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class LengthStats:

    p50: float
    p90: float
    p99: float
    max: int
    mean: float
    total: int

    @classmethod
    def of(cls, values: Iterable[int]) -> LengthStats:
        ordered = sorted(values)
        if not ordered:
            raise ValueError("LengthStats.of needs at least one length")

        def at(q: float) -> float:
            return round(interpolated_quantile(ordered, q), 2)

        return cls(p50=at(0.50), p90=at(0.90), p99=at(0.99), max=ordered[-1],
                   mean=round(sum(ordered) / len(ordered), 2), total=sum(ordered))
