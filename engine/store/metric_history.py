"""The engine's figures over any span the store still holds: arrivals, finishes, TTFT and
tokens per second in equal buckets, from the request journal, with the times of the changes,
drift events, pauses and resumes, engine restarts and process starts inside the span. The console's
in-memory history holds minutes; this is what its charts read for anything older."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from engine.stats import quantile
from engine.store.models import (
    ConfigChangeRow,
    DriftEventRow,
    EngineFaultRow,
    JournalRow,
    PauseRow,
    SessionStartRow,
)


@dataclass(frozen=True)
class MetricBucket:
    """One bucket of a stored history; times are wall-clock seconds."""

    end: float
    arrivals_per_s: float
    finished_per_s: float
    tokens_per_s: float  # prompt and output tokens of the requests finished in it
    ttft_p50_ms: float | None  # of the requests whose first token came in it
    ttft_p99_ms: float | None


@dataclass(frozen=True)
class StoredMetrics:
    start: float
    end: float
    buckets: tuple[MetricBucket, ...]
    changes: tuple[float, ...]  # when a configuration change was stored
    drift: tuple[float, ...]  # when a drift event was stored
    restarts: tuple[float, ...]  # when the engine restarted after a fault
    pauses: tuple[float, ...]  # when the operator paused stepping or resumed it
    starts: tuple[float, ...] = ()  # when a process (re)started the engine on the store


def stored_metrics(session: Session, start: float, end: float,
                   buckets: int) -> StoredMetrics:
    """The journal's figures over [start, end) in `buckets` equal buckets."""
    if not end > start or buckets < 1:
        raise ValueError(f"a history needs end > start and buckets >= 1, got [{start}, {end}) "
                         f"in {buckets}")
    width = (end - start) / buckets
    arrived = [0] * buckets
    finished = [0] * buckets
    tokens = [0] * buckets
    ttfts: list[list[float]] = [[] for _ in range(buckets)]

    def index(at: float | None) -> int | None:
        if at is None or not start <= at < end:
            return None
        return min(int((at - start) / width), buckets - 1)

    j = JournalRow
    rows = session.execute(
        select(j.added_at, j.first_token_at, j.finished_at, j.ttft_s, j.prefilled_tokens,
               j.generated_tokens)
        .where(j.added_at < end, or_(j.finished_at.is_(None), j.finished_at >= start)))
    for added, first, done, ttft, prefilled, generated in rows:
        if (i := index(added)) is not None:
            arrived[i] += 1
        if (i := index(done)) is not None:
            finished[i] += 1
            tokens[i] += prefilled + generated
        if ttft is not None and (i := index(first)) is not None:
            ttfts[i].append(ttft * 1000)
    out = tuple(
        MetricBucket(start + (i + 1) * width, arrived[i] / width, finished[i] / width,
                     tokens[i] / width, quantile(ttfts[i], 0.5), quantile(ttfts[i], 0.99))
        for i in range(buckets))

    def times(row: type[ConfigChangeRow | DriftEventRow | EngineFaultRow | PauseRow
                        | SessionStartRow]) -> tuple[float, ...]:
        return tuple(session.scalars(select(row.created_at).where(
            row.created_at >= start, row.created_at < end).order_by(row.created_at)))

    return StoredMetrics(start, end, out, times(ConfigChangeRow), times(DriftEventRow),
                         times(EngineFaultRow), times(PauseRow), times(SessionStartRow))
