"""Time as an input: every window, timeout and rate in the engine reads a `Clock`.

Production code takes `time.monotonic`; tests and the time-warp harness take a
`VirtualClock`, which moves only when told, so an idle night or a paused console passes in
microseconds and a gap longer than any window is an ordinary test case.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds on a monotonic scale; only differences mean anything."""

    def __call__(self) -> float: ...


class VirtualClock:
    """Simulated seconds that move only when told: a step's predicted time, or an idle wait
    for the next arrival. Starts at the monotonic clock so timestamps look like a real run's."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.monotonic() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)

    def sleep(self, seconds: float) -> None:
        """An idle wait: jump to its end instead of waiting for it."""
        self.now += max(0.0, seconds)
