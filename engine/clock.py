"""Time as an input: every window, timeout and rate in the engine reads a `Clock`."""

from __future__ import annotations

import time
from typing import Protocol

# a paced twin's simulated seconds per wall second: at 0.001 a 10 ms step waits 10 s; past
# 1e4 a week's clock reads past 1e9 s, where a float keeps no microsecond
SIM_SPEEDS = (1e-3, 1e4)


class Clock(Protocol):
    """Seconds on a monotonic scale; only differences mean anything."""

    def __call__(self) -> float: ...


class VirtualClock:
    """Simulated seconds that move only when told; start at the monotonic clock like a real run."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.monotonic() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)
