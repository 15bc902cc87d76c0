"""The charts' time range (the `t` key): the last minutes from the console's own memory, or
hours, a day or the whole session with everything older read from the source's store.

A stored history comes in equal buckets on the wall clock; the charts run on the engine's
clock, so a bucket is placed at its end less the snapshot's wall offset. Only the figures
the store can rebuild (arrivals, finishes, TTFT, tokens/s) reach back; the others (queue,
C*, ITL) hold what the console has seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from console.tui.history import MetricHistory

if TYPE_CHECKING:  # the store pulls in SQLAlchemy: kept off the launch path
    from console.sources.base import StoredMetrics

BUCKETS = 120  # about one per column of a chart
RELOAD_S = 30.0  # a stored view is read again this often (of the engine's clock)
# the series a stored history rebuilds, and the bucket field each reads
STORED = {"ttft_p50": "ttft_p50_ms", "ttft_p99": "ttft_p99_ms", "tokens_per_s": "tokens_per_s",
          "arrival_rate": "arrivals_per_s", "finish_rate": "finished_per_s"}


@dataclass(frozen=True)
class TimeRange:
    label: str
    seconds: float | None  # None: since the console's first snapshot

    def start(self, now: float, session_start: float) -> float:
        return session_start if self.seconds is None else now - self.seconds


RANGES = (TimeRange("10 min", 600.0), TimeRange("1 h", 3600.0), TimeRange("6 h", 6 * 3600.0),
          TimeRange("24 h", 24 * 3600.0), TimeRange("session", None))
MEMORY = RANGES[0]  # what the in-memory history covers; the others read the store


def points(history: MetricHistory, name: str, stored: StoredMetrics | None,
           offset: float) -> tuple[tuple[float, float], ...]:
    """`name` over time: the stored buckets older than the oldest sample in memory, then the
    samples in memory."""
    memory = history.points(name)
    field = STORED.get(name)
    if stored is None or field is None:
        return memory
    oldest = memory[0][0] if memory else float("inf")
    older = []
    for bucket in stored.buckets:
        value = getattr(bucket, field)
        at = bucket.end - offset
        if value is not None and at < oldest:
            older.append((at, float(value)))
    return (*older, *memory)


def on_engine_clock(times: tuple[float, ...], offset: float) -> tuple[float, ...]:
    return tuple(at - offset for at in times)
