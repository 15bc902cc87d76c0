"""Metrics as an event observer: counters, histograms, and percentiles over a time window."""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.events import (
    Event,
    EventBus,
    Failed,
    Finished,
    Preempted,
    PrefixCacheLookup,
    Rejected,
    RequestAdded,
    SlowQuery,
    StepComplete,
    TokensGenerated,
)
from engine.snapshot import Percentiles
from engine.stats import MS_PER_S

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))[:-2]
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISHED_REASONS = {"stop": "stop", "length": "length", "aborted": "abort"}
BUDGET_SCORE_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)

DEFAULT_WINDOW_S = 60.0
WINDOW_SAMPLES = 16384
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class WindowStats:
    """Latency percentiles (ms) over the last `window_s` seconds."""

    window_s: float
    ttft: Percentiles
    tpot: Percentiles
    itl: Percentiles
    queue_wait: Percentiles
    step: Percentiles


def _step_ts(step: tuple[float, float, int, int, int, int]) -> float:
    return step[0]


class _Window:
    """(timestamp, value) samples no older than `span_s` before the latest one seen."""

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        # two deques, not one of pairs: numpy reads the values without a Python loop
        self.times: deque[float] = deque(maxlen=WINDOW_SAMPLES)
        self.samples: deque[float] = deque(maxlen=WINDOW_SAMPLES)

    def add(self, ts: float, value: float) -> None:
        self.times.append(ts)
        self.samples.append(value)

    def add_all(self, ts: float, values: list[float]) -> None:
        """`add(ts, value)` for each of `values`: a step's gaps share its timestamp."""
        self.times.extend(itertools.repeat(ts, len(values)))
        self.samples.extend(values)

    def values(self, now: float) -> list[float]:
        self._expire(now)
        return list(self.samples)

    def percentiles_ms(self, now: float) -> Percentiles:
        """percentiles_ms of the values, found by partition: the engine's thread takes them
        for every snapshot (ten a second), and sorting five full windows cost it 23 ms."""
        self._expire(now)
        count = len(self.samples)
        if not count:
            return Percentiles(p50=None, p90=None, p99=None)
        ranks = [min(count - 1, int(q * count)) for q in (0.50, 0.90, 0.99)]
        ordered = np.partition(np.fromiter(self.samples, dtype=np.float64, count=count), ranks)
        p50, p90, p99 = (float(ordered[rank]) * MS_PER_S for rank in ranks)
        return Percentiles(p50=p50, p90=p90, p99=p99)

    def _expire(self, now: float) -> None:
        horizon = now - self.span_s
        while self.times and self.times[0] < horizon:
            self.times.popleft()
            self.samples.popleft()


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def observe_all(self, values: list[float]) -> None:
        """`observe` each of `values`, in order (the float total adds up alike)."""
        counts, buckets, total = self.counts, self.buckets, self.total
        for value in values:
            counts[bisect.bisect_left(buckets, value)] += 1
            total += value
        self.total = total
        self.count += len(values)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs as Prometheus exposes them."""
        running, rows = 0, []
        for bound, count in zip((*self.buckets, math.inf), self.counts, strict=True):
            running += count
            rows.append(("+Inf" if bound == math.inf else repr(float(bound)), running))
        return rows


@dataclass
class RequestStats:
    """vLLM's per-request families from each Finished event: counts, tokens and phase times."""

    success: dict[str, int] = field(default_factory=dict)
    prompt_tokens: Histogram = field(default_factory=lambda: Histogram(REQUEST_TOKEN_BUCKETS))
    generation_tokens: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_TOKEN_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    inference: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    # what was asked: max_tokens per request, n per HTTP prompt (told by the server)
    params_max_tokens: Histogram = field(default_factory=lambda: Histogram(REQUEST_TOKEN_BUCKETS))
    params_n: Histogram = field(default_factory=lambda: Histogram(N_BUCKETS))
    preemptions: Histogram = field(default_factory=lambda: Histogram(PREEMPTION_BUCKETS))
    prefill_computed: Histogram = field(
        default_factory=lambda: Histogram(REQUEST_TOKEN_BUCKETS))
    prompt_computed_total: int = 0  # prompt tokens of finished requests, by source
    prompt_cached_total: int = 0

    def on_finished(self, event: Finished, preempted: int, cached: int) -> None:
        """`preempted`: times the request was preempted; `cached`: its prompt tokens found in
        the prefix cache at its first admission."""
        self.preemptions.observe(preempted)
        computed = max(0, event.prompt_tokens - cached)
        self.prefill_computed.observe(computed)
        self.prompt_computed_total += computed
        self.prompt_cached_total += event.prompt_tokens - computed
        reason = FINISHED_REASONS.get(event.reason, event.reason)
        self.success[reason] = self.success.get(reason, 0) + 1
        self.prompt_tokens.observe(event.prompt_tokens)
        self.generation_tokens.observe(event.generated_tokens)
        queue = event.queue_wait_s or 0.0
        if event.queue_wait_s is not None:
            self.queue.observe(queue)
            self.inference.observe(max(0.0, event.e2e_s - queue))
        if event.ttft_s is not None:
            self.prefill.observe(max(0.0, event.ttft_s - queue))
            self.decode.observe(max(0.0, event.e2e_s - event.ttft_s))
            if event.generated_tokens > 1:
                self.tpot.observe((event.e2e_s - event.ttft_s) / (event.generated_tokens - 1))


class Metrics:
    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions_total = 0
        self.requests_finished_total = 0
        self.requests_rejected_total = 0
        self.requests_failed_total = 0
        self.slow_queries_total = 0
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)
        self.budget_score = Histogram(BUDGET_SCORE_BUCKETS)
        self.requests = RequestStats()
        self.window_s = window_s
        self.recent_ttft = _Window(window_s)
        self.recent_tpot = _Window(window_s)
        self.recent_itl = _Window(window_s)
        self.recent_queue_wait = _Window(window_s)
        self.recent_step = _Window(window_s)
        self.recent_queried = _Window(window_s)
        self.recent_cached = _Window(window_s)
        # per step: (ts, duration, tokens, output tokens, and both summed over every step so
        # far): a window's sums are two lookups, not a walk over its steps
        self._rate: deque[tuple[float, float, int, int, int, int]] = deque(
            maxlen=WINDOW_SAMPLES)
        self._rate_totals = (0, 0)
        self._step_output = 0
        self._last_token_ts: dict[str, float] = {}
        # live requests whose prompt is counted: a restart re-adds them, the same requests
        self._prompt_counted: set[str] = set()
        self._preempted: dict[str, int] = {}  # live requests' preemptions so far
        self._cached: dict[str, int] = {}  # live requests' prefix-cache hit at first admission

    def subscribe_to(self, bus: EventBus) -> Callable[[], None]:
        """Hear `bus`'s events (kinds no handler takes are never delivered); returns what
        stops it hearing them."""
        stops = [bus.subscribe(handler, (kind,)) for kind, handler in self._handlers().items()]

        def unsubscribe() -> None:
            for stop in stops:
                stop()
        return unsubscribe

    def observe(self, event: Event) -> None:
        """One event, handed here by a caller without a bus."""
        handler = self._handlers().get(type(event))
        if handler is not None:
            handler(event)

    def _handlers(self) -> dict[type[Event], Callable[[Any], None]]:
        return {TokensGenerated: self._on_tokens, StepComplete: self._on_step,
                RequestAdded: self._on_added, Preempted: self._on_preempted,
                Finished: self._on_finished, Rejected: self._on_rejected,
                Failed: self._on_failed, SlowQuery: self._on_slow_query,
                PrefixCacheLookup: self._on_prefix_lookup}

    def _on_tokens(self, event: TokensGenerated) -> None:
        ts, count = event.ts, len(event.token_ids)
        last_token_ts = self._last_token_ts
        with self._lock:
            self.generation_tokens_total += count
            self._step_output += count
            gaps = []
            for request_id in event.request_ids:  # one twice in an event: a gap of 0 s
                last = last_token_ts.get(request_id)
                if last is not None:
                    gaps.append(ts - last)
                last_token_ts[request_id] = ts
            self.itl.observe_all(gaps)
            self.recent_itl.add_all(ts, gaps)

    def _on_step(self, event: StepComplete) -> None:
        tokens = event.prefill_tokens + event.decode_seqs
        with self._lock:
            self.iteration_tokens.observe(tokens)
            self.recent_step.add(event.ts, event.duration_s)
            output = self._step_output
            total_tokens, total_output = self._rate_totals
            self._rate_totals = (total_tokens + tokens, total_output + output)
            self._rate.append((event.ts, event.duration_s, tokens, output, *self._rate_totals))
            self._step_output = 0
            horizon = event.ts - RATE_WINDOW_S
            while self._rate and self._rate[0][0] < horizon:
                self._rate.popleft()

    def _on_added(self, event: RequestAdded) -> None:
        with self._lock:
            if event.request_id not in self._prompt_counted:
                self._prompt_counted.add(event.request_id)
                self.prompt_tokens_total += len(event.prompt_token_ids)
                max_tokens = event.sampling.get("max_tokens")
                if isinstance(max_tokens, int):
                    self.requests.params_max_tokens.observe(max_tokens)

    def _on_preempted(self, event: Preempted) -> None:
        with self._lock:
            self.preemptions_total += 1
            self._preempted[event.request_id] = self._preempted.get(event.request_id, 0) + 1

    def _on_finished(self, event: Finished) -> None:
        with self._lock:
            self.requests.on_finished(event, self._preempted.pop(event.request_id, 0),
                                      self._cached.pop(event.request_id, 0))
            self._last_token_ts.pop(event.request_id, None)
            self._prompt_counted.discard(event.request_id)
            self.requests_finished_total += 1
            self.e2e.observe(event.e2e_s)
            if event.queue_wait_s is not None:
                self.recent_queue_wait.add(event.ts, event.queue_wait_s)
            if event.ttft_s is not None:
                self.ttft.observe(event.ttft_s)
                self.recent_ttft.add(event.ts, event.ttft_s)
                if event.generated_tokens > 1:
                    tpot = (event.e2e_s - event.ttft_s) / (event.generated_tokens - 1)
                    self.recent_tpot.add(event.ts, tpot)
            if event.budget_score is not None:
                self.budget_score.observe(event.budget_score)

    def _on_rejected(self, event: Rejected) -> None:
        with self._lock:
            self._forget(event.request_id)
            self.requests_rejected_total += 1

    def _on_failed(self, event: Failed) -> None:
        with self._lock:
            self._last_token_ts.pop(event.request_id, None)
            self._forget(event.request_id)
            self.requests_failed_total += 1

    def _on_slow_query(self, event: SlowQuery) -> None:
        with self._lock:
            self.slow_queries_total += event.represents

    def _on_prefix_lookup(self, event: PrefixCacheLookup) -> None:
        with self._lock:
            self.prefix_cache_queries_total += event.queried_tokens
            self.prefix_cache_hits_total += event.cached_tokens
            self._cached.setdefault(event.request_id, event.cached_tokens)
            self.recent_queried.add(event.ts, event.queried_tokens)
            self.recent_cached.add(event.ts, event.cached_tokens)

    def observe_n(self, n: int) -> None:
        """One prompt of an HTTP request asked for `n` choices (each is its own request)."""
        with self._lock:
            self.requests.params_n.observe(n)

    def _forget(self, request_id: str) -> None:
        self._prompt_counted.discard(request_id)
        self._preempted.pop(request_id, None)
        self._cached.pop(request_id, None)

    def rates(self, now: float) -> tuple[float, float]:
        """(tokens/s, output tokens/s) over RATE_WINDOW_S, or since its first step if later."""
        with self._lock:
            steps = self._rate  # in step order, so by time: the window is a tail of it
            first = bisect.bisect_left(steps, now - RATE_WINDOW_S, key=_step_ts)
            if first == len(steps):
                return 0.0, 0.0
            start, last = steps[first], steps[-1]
        span = min(RATE_WINDOW_S, now - (start[0] - start[1]))
        if span <= 0:
            return 0.0, 0.0
        # the sums since the start less those before the window's first step
        tokens = last[4] - start[4] + start[2]
        output = last[5] - start[5] + start[3]
        return tokens / span, output / span

    def prefix_cache_hit_rate(self, now: float) -> float | None:
        """Cached over queried tokens of admissions in the last `window_s`; None without any."""
        with self._lock:
            queried = sum(self.recent_queried.values(now))
            cached = sum(self.recent_cached.values(now))
        return cached / queried if queried else None

    def latency(self, now: float) -> WindowStats:
        """Percentiles (ms) of requests, tokens and steps ended in the last `window_s` seconds."""
        with self._lock:
            ttft, tpot, itl, queue_wait, step = (
                w.percentiles_ms(now) for w in (self.recent_ttft, self.recent_tpot,
                                                 self.recent_itl, self.recent_queue_wait,
                                                 self.recent_step))
        return WindowStats(self.window_s, ttft, tpot, itl, queue_wait, step)

    def snapshot_fields(self, now: float) -> dict[str, Any]:
        """The Snapshot fields these metrics own, as of `now`."""
        tokens_per_s, output_per_s = self.rates(now)
        window = self.latency(now)
        return dict(
            tokens_per_s=tokens_per_s, output_tokens_per_s=output_per_s,
            stats_window_s=window.window_s, ttft_ms=window.ttft, tpot_ms=window.tpot,
            itl_ms=window.itl, queue_wait_ms=window.queue_wait, step_ms=window.step,
            preemptions_total=self.preemptions_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            requests_finished_total=self.requests_finished_total,
            requests_rejected_total=self.requests_rejected_total,
            requests_failed_total=self.requests_failed_total,
            slow_queries_total=self.slow_queries_total,
            prefix_cache_queries_total=self.prefix_cache_queries_total,
            prefix_cache_hits_total=self.prefix_cache_hits_total,
            prefix_cache_hit_rate=self.prefix_cache_hit_rate(now))
