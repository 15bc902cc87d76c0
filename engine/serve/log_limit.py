"""A log that cannot be flooded: each kind of message passes at a bounded rate.

A hostile client makes uvicorn warn once per bad request ("Invalid HTTP request received.",
"Exceeded concurrency limit.") and log a line per request it refuses: 69 MB of log in 20 s.
Each kind (a warning's template; an access line's client address and status) may pass BURST
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
MAX_KINDS = 256  # kinds remembered; the least recent is forgotten first


def template(record: logging.LogRecord) -> str:
    """A warning's kind: its template, whatever its arguments."""
    return str(record.msg)


def client_and_status(record: logging.LogRecord) -> str:
    """An access line's kind: who asked and what they got (uvicorn's access arguments are
    client "host:port", method, path, HTTP version, status), so one client's flood of
    refusals is limited and not everyone's requests."""
    args = record.args if isinstance(record.args, tuple) else ()
    client = str(args[0]).rpartition(":")[0] if args else ""
    return f"{client} {args[-1] if args else ''}"


class RateLimitedLog(logging.Filter):
    def __init__(self, rate: Rate | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 kind: Callable[[logging.LogRecord], str] = template) -> None:
        super().__init__()
        self.kind = kind
        self.limiter = RateLimiter(rate or Rate(per_second=PER_SECOND, burst=BURST), clock,
                                   max_sources=MAX_KINDS)
        self.dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = self.kind(record)
        if self.limiter.spend(kind, 1.0):
            if kind not in self.dropped and len(self.dropped) >= MAX_KINDS:
                self.dropped.pop(next(iter(self.dropped)))  # bounded, like the limiter
            self.dropped[kind] = self.dropped.get(kind, 0) + 1
            return False
        dropped = self.dropped.pop(kind, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it dropped by the rate limit)"
        return True

    @classmethod
    def install(cls, logger: logging.Logger,
                kind: Callable[[logging.LogRecord], str] = template) -> None:
        """Add one limit to `logger` (once, however often servers start in a process)."""
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls(kind=kind))
