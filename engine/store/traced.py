"""Drift of traced servers: the windowed median of their measured/predicted prefill ratios."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.config import ConfigError
from engine.store.models import TracedRequestRow

DRIFT_WINDOW_S = 60.0


@dataclass(frozen=True)
class TracedDriftPoint:
    """The median measured/predicted prefill ratio of one source's requests in one window."""

    start: float
    window_s: float
    requests: int
    median_ratio: float
    estimate: str


def traced_drift(session: Session, *, source: str | None = None,
                 window_s: float = DRIFT_WINDOW_S, limit: int = 10_000,
                 ) -> list[TracedDriftPoint]:
    """Windows of scored traced requests (of one source, or all), oldest first."""
    if not window_s > 0:
        raise ConfigError("window_s", f"must be > 0, got {window_s}")
    query = (select(TracedRequestRow.started_at, TracedRequestRow.budget_score,
                    TracedRequestRow.estimate)
             .where(TracedRequestRow.budget_score.is_not(None),
                    TracedRequestRow.estimate.is_not(None))
             .order_by(TracedRequestRow.started_at.desc()).limit(limit))
    if source is not None:
        query = query.where(TracedRequestRow.source == source)
    windows: dict[tuple[float, str], list[float]] = defaultdict(list)
    for started_at, score, estimate in session.execute(query):
        start = started_at - started_at % window_s
        windows[(start, estimate)].append(score)
    return [TracedDriftPoint(start, window_s, len(scores), statistics.median(scores), estimate)
            for (start, estimate), scores in sorted(windows.items())]
