"""The token rates a snapshot reads: the window's sums, found from running totals, equal the
sums over the window's own steps, whatever left it (time passing, or the sample cap)."""

from __future__ import annotations

import random

import pytest

from engine.events import StepComplete, TokensGenerated
from engine.ops.metrics import RATE_WINDOW_S, WINDOW_SAMPLES, Metrics


def walked(steps: list[tuple[float, float, int, int]], now: float) -> tuple[float, float]:
    """The rates by a walk over the steps still held (the last WINDOW_SAMPLES within the
    window of the latest step) that fall in the window ending at `now`."""
    latest = steps[-1][0]
    held = [s for s in steps if s[0] >= latest - RATE_WINDOW_S][-WINDOW_SAMPLES:]
    window = [s for s in held if s[0] >= now - RATE_WINDOW_S]
    if not window:
        return 0.0, 0.0
    span = min(RATE_WINDOW_S, now - (window[0][0] - window[0][1]))
    if span <= 0:
        return 0.0, 0.0
    return sum(s[2] for s in window) / span, sum(s[3] for s in window) / span


@pytest.mark.parametrize("gap_s", [0.0005, 0.01, 0.7])
def test_window_rates_equal_a_walk_over_the_windows_steps(gap_s: float) -> None:
    rng = random.Random(gap_s)
    metrics = Metrics()
    steps: list[tuple[float, float, int, int]] = []
    ts = 100.0
    for _ in range(20_000 if gap_s < 0.001 else 400):  # past the sample cap at the shortest gap
        ts += rng.uniform(0, 2 * gap_s)
        duration, prefill, decodes = rng.uniform(0, gap_s), rng.randrange(64), rng.randrange(8)
        if decodes:
            metrics.observe(TokensGenerated(request_ids=tuple(map(str, range(decodes))),
                                            token_ids=(1,) * decodes, ts=ts))
        metrics.observe(StepComplete(step=len(steps) + 1, prefill_tokens=prefill,
                                     decode_seqs=decodes, duration_s=duration, ts=ts))
        steps.append((ts, duration, prefill + decodes, decodes))
    for now in (ts, ts + 1.0, ts + RATE_WINDOW_S / 2, ts + RATE_WINDOW_S + 1, ts + 3600):
        assert metrics.rates(now) == pytest.approx(walked(steps, now))
