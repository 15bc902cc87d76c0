"""Token buckets per client, refilled on an injected clock; the least recent is forgotten first."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import ConfigError


@dataclass(frozen=True)
class Rate:
    per_second: float
    burst: float

    def __post_init__(self) -> None:
        for name, value in (("per_second", self.per_second), ("burst", self.burst)):
            if not value > 0 or value == float("inf"):
                raise ConfigError(name, f"must be a finite number > 0, got {value}")


class RateLimiter:
    def __init__(self, rate: Rate, clock: Callable[[], float] = time.monotonic,
                 max_sources: int = 4096) -> None:
        self.rate = rate
        self.clock = clock
        self.max_sources = max_sources
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def available(self, source: str) -> float:
        with self._lock:
            return self._refilled(source, self.clock())

    def wait(self, source: str, cost: float) -> float:
        """The wait until `cost` is there (0.0: now; inf: never), spending nothing."""
        tokens = self.available(source)
        if cost <= tokens:
            return 0.0
        return float("inf") if cost > self.rate.burst else (cost - tokens) / self.rate.per_second

    def spend(self, source: str, cost: float) -> float:
        """Spend `cost` and return 0.0, or spend nothing and return the wait until it is there."""
        with self._lock:
            now = self.clock()
            tokens = self._refilled(source, now)
            if cost <= tokens:
                self._remember(source, tokens - cost, now)
                return 0.0
            self._remember(source, tokens, now)
            if cost > self.rate.burst:
                return float("inf")
            return (cost - tokens) / self.rate.per_second

    def _refilled(self, source: str, now: float) -> float:
        tokens, at = self._buckets.get(source, (self.rate.burst, now))
        # max(): a clock that steps back refills nothing rather than draining the bucket
        return min(self.rate.burst, tokens + max(now - at, 0.0) * self.rate.per_second)

    def _remember(self, source: str, tokens: float, now: float) -> None:
        self._buckets[source] = (tokens, now)
        self._buckets.move_to_end(source)
        while len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)
