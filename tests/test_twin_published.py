"""The GPU twin against published GPU measurements (benchmarks/published_gpu_cases.json):
arithmetic only, on the shipped factors."""

from __future__ import annotations

from pathlib import Path

from engine.sim.profiles import FITTED_EFFICIENCY
from engine.sim.published import agreement, load_cases

CASES = Path(__file__).parent.parent / "benchmarks" / "published_gpu_cases.json"


def test_published_table_is_big_and_varied_enough() -> None:
    cases = load_cases(CASES)
    assert len(cases) >= 15 and len({c.source for c in cases}) >= 4
    assert sum(c.held_back for c in cases) >= 5


def test_twin_agrees_with_published_gpu_measurements() -> None:
    cases = load_cases(CASES)
    held = agreement([c for c in cases if c.held_back], FITTED_EFFICIENCY)
    assert held.median_abs <= 0.10 and held.worst_abs <= 0.25, held.errors
    every = agreement(cases, FITTED_EFFICIENCY)
    # the fitted cases include weight-only INT8 (gpt-fast), which the twin prices as W8A8
    assert every.median_abs <= 0.11 and every.worst_abs <= 0.26, every.errors
