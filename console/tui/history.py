"""Bounded metric histories fed by polled snapshots, and downsampling to a plot's width."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.snapshot import Snapshot

# Each series is one number read from a snapshot; None (no sample yet) is skipped.
SERIES: dict[str, str] = {
    "kv_usage": "KV usage",
    "bandwidth_util_5s": "bandwidth 5 s avg",
    "tokens_per_s": "tokens/s",
    "output_tokens_per_s": "output tokens/s",
    "ttft_p50": "TTFT p50 ms",
    "ttft_p99": "TTFT p99 ms",
    "tpot_p50": "TPOT p50 ms",
    "tpot_p99": "TPOT p99 ms",
    "step_p50": "step p50 ms",
    "step_p99": "step p99 ms",
    "chunk_queue_length": "chunk queue",
    "num_waiting": "waiting",
    "preemptions_total": "preemptions",
}


def _read(snapshot: Snapshot) -> dict[str, float | None]:
    return {
        "kv_usage": snapshot.kv_usage,
        "bandwidth_util_5s": snapshot.bandwidth_util_5s,
        "tokens_per_s": snapshot.tokens_per_s,
        "output_tokens_per_s": snapshot.output_tokens_per_s,
        "ttft_p50": snapshot.ttft_ms.p50,
        "ttft_p99": snapshot.ttft_ms.p99,
        "tpot_p50": snapshot.tpot_ms.p50,
        "tpot_p99": snapshot.tpot_ms.p99,
        "step_p50": snapshot.step_ms.p50,
        "step_p99": snapshot.step_ms.p99,
        "chunk_queue_length": float(snapshot.chunk_queue_length),
        "num_waiting": float(snapshot.num_waiting),
        "preemptions_total": float(snapshot.preemptions_total),
    }


@dataclass
class MetricHistory:
    """The last `capacity` samples of every series in SERIES, with their snapshot times."""

    capacity: int = 600  # five minutes at 2 Hz
    samples: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    last_step: int = -1

    def __post_init__(self) -> None:
        self.samples = {name: deque(maxlen=self.capacity) for name in SERIES}

    def record(self, snapshot: Snapshot) -> None:
        # A paused or idle engine hands back the same step; one sample per step keeps plots honest.
        if snapshot.step == self.last_step:
            return
        self.last_step = snapshot.step
        for name, value in _read(snapshot).items():
            if value is not None:
                self.samples[name].append((snapshot.ts, float(value)))

    def clear(self) -> None:
        """Forget every series (the console switched to another server)."""
        for series in self.samples.values():
            series.clear()
        self.last_step = -1

    def values(self, name: str) -> list[float]:
        return [value for _, value in self.samples[name]]

    def window(self, name: str, seconds: float) -> list[float]:
        """Samples of `name` taken within `seconds` of its newest sample."""
        series = self.samples[name]
        if not series:
            return []
        newest = series[-1][0]
        return [value for ts, value in series if newest - ts <= seconds]


def downsample(values: list[float], width: int) -> list[float]:
    """At most `width` points: each the maximum of its bucket, so spikes survive the squeeze."""
    if width <= 0:
        return []
    if len(values) <= width:
        return list(values)
    buckets: list[float] = []
    for i in range(width):
        start = i * len(values) // width
        end = (i + 1) * len(values) // width
        buckets.append(max(values[start:end]))
    return buckets
