"""A log that cannot be flooded: each kind of message passes at a bounded rate."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.serve.rate_limit import Rate, RateLimiter

BURST = 10.0
PER_SECOND = 0.2
MAX_KINDS = 256


def template(record: logging.LogRecord) -> str:
    """A warning's kind: its template, whatever its arguments."""
    return str(record.msg)


def client_and_status(record: logging.LogRecord) -> str:
    """An access line's kind: client and status, so one client's flood is limited alone."""
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
                self.dropped.pop(next(iter(self.dropped)))
            self.dropped[kind] = self.dropped.get(kind, 0) + 1
            return False
        dropped = self.dropped.pop(kind, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it dropped by the rate limit)"
        return True

    @classmethod
    def install(cls, logger: logging.Logger,
                kind: Callable[[logging.LogRecord], str] = template) -> None:
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls(kind=kind))
