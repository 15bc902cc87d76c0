"""engine.stats: the one nearest-rank quantile, the percentile triple and ms scaling."""

from __future__ import annotations

import pytest

from engine.snapshot import Percentiles
from engine.stats import (
    LengthStats,
    interpolated_quantile,
    ms,
    percentiles,
    percentiles_ms,
    quantile,
)


def test_quantile_is_nearest_rank_and_none_when_empty():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert quantile(values, 0.5) == 3.0
    assert quantile(values, 0.0) == 1.0
    assert quantile(values, 0.99) == 5.0  # an observed value, never one beyond the largest
    assert quantile(range(100), 0.9) == 90
    assert quantile([], 0.5) is None


def test_percentiles_and_ms():
    assert percentiles([]) == Percentiles()
    assert percentiles(range(1, 101)) == Percentiles(p50=51, p90=91, p99=100)
    assert percentiles_ms([0.001, 0.002]) == Percentiles(p50=2.0, p90=2.0, p99=2.0)
    assert ms(None) is None and ms(0.25) == 250.0


def test_interpolated_quantile_and_length_stats():
    assert interpolated_quantile([1, 2, 3, 4], 0.5) == 2.5
    stats = LengthStats.of([4, 1, 3, 2])
    assert stats == LengthStats(p50=2.5, p90=3.7, p99=3.97, max=4, mean=2.5, total=10)
    with pytest.raises(ValueError, match="at least one"):
        LengthStats.of([])
