"""A log that cannot be flooded: each kind of message passes at a bounded rate.

A hostile client makes uvicorn warn once per bad request ("Invalid HTTP request received.",
"Exceeded concurrency limit."): 69 MB of log in 20 s. Each message template may pass BURST
times and then once every 1/PER_SECOND seconds; the next one that passes says how many like
it were dropped. The clock is injected (engine.serve.rate_limit).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.serve.rate_limit import Rate, RateLimiter

BURST = 10.0
PER_SECOND = 0.2  # one a message kind every 5 s once the burst is spent


class RateLimitedLog(logging.Filter):
    def __init__(self, rate: Rate | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.limiter = RateLimiter(rate or Rate(per_second=PER_SECOND, burst=BURST), clock,
                                   max_sources=256)
        self.dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = str(record.msg)  # the template: one kind, whatever its arguments
        if self.limiter.spend(kind, 1.0):
            self.dropped[kind] = self.dropped.get(kind, 0) + 1
            return False
        dropped = self.dropped.pop(kind, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it dropped by the rate limit)"
        return True

    @classmethod
    def install(cls, logger: logging.Logger) -> None:
        """Add one limit to `logger` (once, however often servers start in a process)."""
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())
