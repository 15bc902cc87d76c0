"""ScrapedSource: what the read-only views of vLLM and SGLang share.

Each poll reads /metrics with prometheus_client's parser, checks the server is the kind the
subclass reads (its metric prefix), and feeds the cumulative series into a MetricWindow so
rates and percentiles cover a stated recent window. Requests, slow queries and budget
scores come from the trace collector when one is attached (see engine.serve.otlp).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import httpx

from console.sources.base import Capabilities, Capability, SourceError
from console.sources.device_peak import PeakLookup, lookup_peaks
from console.sources.prometheus_text import MetricWindow, Reading, Samples, first, parse_samples
from console.sources.remote import Remote, RemoteBacked, bearer
from engine.snapshot import RequestView, Snapshot

if TYPE_CHECKING:
    from engine.serve.otlp import TraceCollector
    from engine.store import SlowQueryRecord, TracedDriftPoint

MAX_METRICS_BYTES = 4 << 20  # a vLLM /metrics is ~100 KB; parsing is what a bigger one costs


class ScrapedSource(RemoteBacked, ABC):
    """A server the console only reads. Subclasses name their prefix, the cumulative series
    the window differences, and how a scrape becomes a snapshot."""

    prefix: ClassVar[str]  # "vllm:", "sglang:"
    counters: ClassVar[tuple[str, ...]]
    histograms: ClassVar[tuple[str, ...]]
    flag: ClassVar[str]  # the console flag that attaches this kind, for error messages

    def __init__(self, url: str, *, gpu: str | None = None,
                 traces: TraceCollector | None = None, token: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.remote = Remote(url, headers=bearer(token), clock=clock, transport=transport,
                             max_bytes=MAX_METRICS_BYTES)
        self.clock = clock
        self.window = MetricWindow()
        self.traces = traces
        self.peak: PeakLookup = lookup_peaks(gpu, url)
        self.model = ""  # as /metrics names it
        # Spans name their server only by service.name: with one traced server every span is
        # its own (None); in a fleet each server is started with OTEL_SERVICE_NAME=<its URL>.
        self.trace_source: str | None = None

    @property
    def capabilities(self) -> Capabilities:
        why_not = {
            Capability.TUNE: f"a {self.label} server is read-only here: change its flags and "
                             "restart it",
            Capability.PAUSE: f"a {self.label} server cannot be paused from tokenflow",
            Capability.CALIBRATE: f"tokenflow cannot calibrate a {self.label} server",
            Capability.DRIFT: f"{self.label} keeps no token-budget calibration",
            Capability.CONFIG_HISTORY: f"{self.label} keeps no configuration history",
            Capability.STORED_METRICS: f"{self.label} keeps no request journal: charts hold "
                                       "what the console has seen",
            Capability.TRAFFIC: f"a {self.label} server's traffic comes from its clients",
            Capability.WATERMARKS: f"{self.label} admits by its own rules, not tokenflow's "
                                   "watermarks",
            Capability.CHUNK_QUEUE: f"{self.label}'s /metrics has no chunk queue (tokens per "
                                    "step stand in)",
        }
        if self.traces is None:
            why_not[Capability.SLOW_QUERIES] = ("budget scores come from request traces: "
                                                "attach with --otlp-listen")
        if self.traces is None or self.traces.database is None:
            why_not[Capability.TRACED_DRIFT] = ("drift history comes from traced requests in "
                                                "a store: attach with --otlp-listen")
        return Capabilities.lacking(why_not)

    def snapshot(self) -> Snapshot:
        return self.read(self.remote.request("GET", "/metrics"))

    async def snapshot_async(self) -> Snapshot:
        return self.read(await self.remote.arequest("GET", "/metrics"))

    def read(self, response: httpx.Response) -> Snapshot:
        """The snapshot of one answer; one the console cannot use (unreadable, not finite,
        absurd) marks the server failing with the reason, and backs off."""
        try:
            samples = self.scrape(response)
            now = self.clock()
            model = model_label(samples, self.label)
            reading = Reading.of(now, samples, self.counters, self.histograms)
            self.window.add(reading)
            self.model = model
            return self.build(now, samples)
        except SourceError as exc:
            raise self.remote.failed(str(exc)) from None
        except (ValueError, ArithmeticError) as exc:  # what numbers from outside can raise
            raise self.remote.failed(f"/metrics: {type(exc).__name__}: {exc}") from None

    def scrape(self, response: httpx.Response) -> Samples:
        if response.status_code != 200:
            raise SourceError(f"{self.remote.url}/metrics answered HTTP "
                              f"{response.status_code}; is this a {self.label} server?")
        samples = parse_samples(response.text)
        if not any(name.startswith(self.prefix) for name in samples):
            raise SourceError(f"{self.remote.url}/metrics has no {self.prefix} metrics; "
                              f"point {self.flag} at a {self.label} server")
        return samples

    @abstractmethod
    def build(self, now: float, samples: Samples) -> Snapshot:
        """The snapshot of one scrape, its window already updated."""

    def rate(self, name: str) -> float:
        return self.window.rate(name) or 0.0

    def bandwidth(self, samples: Samples, read_bytes: str) -> tuple[float | None, float, str, str]:
        """(bytes/s, share of the peak, where both come from, why the share is missing), from
        the server's estimated-read-bytes counter over the window."""
        if first(samples, read_bytes) is None:
            return None, 0.0, "", (f"{self.label} exports no {read_bytes.split(':')[1]}: "
                                   "start it with --enable-mfu-metrics")
        rate = self.window.rate(read_bytes)
        if rate is None:
            return None, 0.0, "", f"gathering a {self.window.min_span_s:.0f} s window"
        where = f"{self.label}'s estimate over {self.window.seconds:.0f} s"
        if self.peak.peaks is None:
            return rate, 0.0, where, self.peak.reason
        return rate, rate / self.peak.peaks.bandwidth, f"{where} · {self.peak.reason}", ""

    def traced_requests(self) -> tuple[RequestView, ...]:
        return () if self.traces is None else self.traces.request_views(self.trace_source)

    def score_estimate(self) -> str:
        """What traced budget scores divide by, for the Requests pane to say."""
        estimate = None if self.traces is None else self.traces.estimate
        return "" if estimate is None else estimate.name

    def score_note(self) -> str:
        """Why traced budget scores are missing, naming the flags that fill them."""
        if self.traces is None:
            return ("budget_score needs per-request traces: pass --otlp-listen HOST:PORT "
                    "(the server's --otlp-traces-endpoint)")
        if self.traces.estimate is None:
            return "budget_score needs an estimate: pass --roofline-model DIR and --gpu NAME"
        return ""

    def traced_slow_total(self) -> int:
        return 0 if self.traces is None else self.traces.slow_total(self.trace_source)

    def traced_drift(self) -> list[TracedDriftPoint]:
        return [] if self.traces is None else self.traces.drift(self.trace_source)

    def slow_queries(self, limit: int = 500) -> list[SlowQueryRecord]:
        return [] if self.traces is None else self.traces.slow_queries(self.trace_source, limit)

    def slow_query(self, query_id: int) -> SlowQueryRecord:
        for record in self.slow_queries(5000):
            if record.id == query_id:
                return record
        raise SourceError(f"no traced slow query {query_id} from {self.remote.url}; "
                          "slow queries come from traces (--otlp-listen)")


def model_label(samples: Samples, fallback: str) -> str:
    for found in samples.values():
        for sample in found:
            if "model_name" in sample.labels:
                return sample.labels["model_name"]
    return fallback
