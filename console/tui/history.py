"""Bounded metric histories fed by polled snapshots, the changes seen in them, and
downsampling to a plot's width."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from console.sources.base import stated_rate
from engine.ops.metrics import RATE_WINDOW_S
from engine.snapshot import Snapshot

# Each series is one number read from a snapshot (or the difference of two); None (no sample
# yet) is skipped.
SERIES: dict[str, str] = {
    "kv_usage": "KV usage",
    "bandwidth_util_5s": "bandwidth 5 s avg",
    "tokens_per_s": "tokens/s",
    "output_tokens_per_s": "output tokens/s",
    "ttft_p50": "TTFT p50 ms",
    "ttft_p99": "TTFT p99 ms",
    "tpot_p50": "TPOT p50 ms",
    "tpot_p99": "TPOT p99 ms",
    "itl_p50": "ITL p50 ms",
    "itl_p99": "ITL p99 ms",
    "step_p50": "step p50 ms",
    "step_p99": "step p99 ms",
    "chunk_queue_length": "chunk queue",
    "num_waiting": "waiting",
    "preemptions_total": "preemptions",
    "cstar": "C*",
    "arrival_rate": "arrivals/s",
    "finish_rate": "finished/s",
    "arrived": "requests arrived",  # a running total: rates between any two times
}

# The live-tunable settings whose changes are marked on the time charts.
MARKED = ("max_num_batched_tokens", "chunk_tile", "max_prefill_chunks",
          "long_prefill_threshold", "cache_high_watermark", "cache_low_watermark",
          "bandwidth_throttle_2", "bandwidth_throttle_1", "bandwidth_pause",
          "slow_query_threshold", "slow_query_min_overrun_ms", "auto_budget")


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
        "itl_p50": snapshot.itl_ms.p50,
        "itl_p99": snapshot.itl_ms.p99,
        "step_p50": snapshot.step_ms.p50,
        "step_p99": snapshot.step_ms.p99,
        "chunk_queue_length": float(snapshot.chunk_queue_length),
        "num_waiting": float(snapshot.num_waiting),
        "preemptions_total": float(snapshot.preemptions_total),
        "cstar": None if snapshot.recommended_chunk_size is None
        else float(snapshot.recommended_chunk_size),
    }


@dataclass(frozen=True)
class Counts:
    """The running totals arrival and finish rates are taken from, at a snapshot's time."""

    ts: float
    arrived: int
    finished: int


@dataclass(frozen=True)
class Change:
    """A live setting seen to change between two snapshots: a mark on every time chart."""

    ts: float  # the snapshot time it was first seen at
    field: str
    old: object
    new: object

    @property
    def label(self) -> str:
        return f"{self.field} {self.old}→{self.new}"


@dataclass
class MetricHistory:
    """The last `capacity` samples of every series in SERIES, with their snapshot times, and
    the changes of the live settings seen over them."""

    capacity: int = 600  # five minutes at 2 Hz
    samples: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    changes: deque[Change] = field(default_factory=lambda: deque(maxlen=100))
    last_step: int = -1
    _previous: Snapshot | None = None
    _counts: deque[Counts] = field(default_factory=deque)  # the last RATE_WINDOW_S of totals
    _seen_ts: float | None = None  # the newest snapshot's time, sampled or not
    # when the engine was seen to pause, resume or restart: marks beside the changes'
    events: deque[float] = field(default_factory=lambda: deque(maxlen=100))
    _seen: Snapshot | None = None  # the newest snapshot, sampled or not

    def __post_init__(self) -> None:
        self.samples = {name: deque(maxlen=self.capacity) for name in SERIES}

    def record(self, snapshot: Snapshot) -> None:
        # time passes for an idle or paused engine too: windows end at the newest snapshot
        self._seen_ts = snapshot.ts if self._seen_ts is None else max(self._seen_ts, snapshot.ts)
        seen, self._seen = self._seen, snapshot
        if seen is not None and (seen.paused != snapshot.paused
                                 or snapshot.engine_restarts > seen.engine_restarts):
            self.events.append(snapshot.ts)  # a pause holds the step: seen before sampling
        # A paused or idle engine hands back the same step; one sample per step keeps plots honest.
        if snapshot.step == self.last_step:
            return
        self.last_step = snapshot.step
        values = _read(snapshot)
        values.update(self._rates(snapshot))
        values["arrived"] = float(snapshot.arrived)
        previous = self._previous
        if previous is not None and snapshot.ts > previous.ts:
            for name in MARKED:
                old, new = previous.config.get(name), snapshot.config.get(name)
                if old != new and old is not None and new is not None:
                    self.changes.append(Change(snapshot.ts, name, old, new))
            old_rate, new_rate = previous.workload_rate, snapshot.workload_rate
            if old_rate != new_rate and old_rate is not None and new_rate is not None:
                self.changes.append(Change(snapshot.ts, "arrival_rate", stated_rate(old_rate),
                                           stated_rate(new_rate)))
        self._previous = snapshot
        for name, value in values.items():
            if value is not None:
                self.samples[name].append((snapshot.ts, float(value)))
        self._forget_old_changes()

    def _rates(self, snapshot: Snapshot) -> dict[str, float]:
        """Arrivals and finishes per second over the last RATE_WINDOW_S (the window tok/s is
        taken over): between two polls a rate is 0 or a burst, and a chart of those (each
        pixel the maximum of its samples) showed 9-18/s for traffic at 3.2/s. Steps follow
        arrivals, so after a quiet spell longer than the window, everything counted since
        the last sample fell within the window."""
        now = Counts(snapshot.ts, snapshot.arrived, snapshot.requests_finished_total)
        counts = self._counts
        counts.append(now)
        while len(counts) > 1 and counts[1].ts <= now.ts - RATE_WINDOW_S:
            counts.popleft()
        base = counts[0]  # the newest total at least a window old, else the oldest kept
        span = min(now.ts - base.ts, RATE_WINDOW_S)
        if span <= 0:
            return {}
        return {"arrival_rate": max(now.arrived - base.arrived, 0) / span,
                "finish_rate": max(now.finished - base.finished, 0) / span}

    def _forget_old_changes(self) -> None:
        oldest = self.oldest_ts
        while self.changes and oldest is not None and self.changes[0].ts < oldest:
            self.changes.popleft()

    def clear(self) -> None:
        """Forget every series (the console switched to another server)."""
        for series in self.samples.values():
            series.clear()
        self.changes.clear()
        self.events.clear()
        self._seen = None
        self.last_step = -1
        self._previous = None
        self._counts.clear()
        self._seen_ts = None

    def values(self, name: str) -> list[float]:
        return [value for _, value in self.samples[name]]

    def points(self, name: str) -> tuple[tuple[float, float], ...]:
        """(snapshot time, value) of every sample of `name`, oldest first."""
        return tuple(self.samples[name])

    @property
    def change_times(self) -> tuple[float, ...]:
        """When each change in view was first seen: the marks on every time chart."""
        return tuple(change.ts for change in self.changes)

    @property
    def newest_ts(self) -> float | None:
        """The newest snapshot's time: after an idle spell, later than the newest sample."""
        return self._seen_ts

    @property
    def oldest_ts(self) -> float | None:
        firsts = [series[0][0] for series in self.samples.values() if series]
        return min(firsts) if firsts else None

    def window(self, name: str, seconds: float) -> list[float]:
        """Samples of `name` taken within `seconds` of the newest snapshot: none after an
        idle spell longer than that, so nothing stale is judged as recent."""
        newest = self._seen_ts
        if newest is None:
            return []
        return [value for ts, value in self.samples[name] if newest - ts <= seconds]

    def rate_between(self, name: str, start: float, end: float) -> float | None:
        """How fast the running total `name` grew over the samples in [start, end), per
        second; None without two samples apart in time."""
        inside = [(ts, value) for ts, value in self.samples[name] if start <= ts < end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return max(inside[-1][1] - inside[0][1], 0.0) / (inside[-1][0] - inside[0][0])

    def mean_between(self, name: str, start: float, end: float) -> float | None:
        """The mean of `name` over snapshot times in [start, end); None without a sample."""
        inside = [value for ts, value in self.samples[name] if start <= ts < end]
        return sum(inside) / len(inside) if inside else None


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
