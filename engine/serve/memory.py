"""Memory given back to the system: when the server goes idle, and every while it stays busy.

Streams a client never reads leave their outputs and chunks in many small allocations; once
they close, glibc keeps the freed pages in its arenas, so the server's RSS stayed at its peak
(250 unread streams: 912 to 1,734 MiB, and there after they closed). `malloc_trim` returns
them. Under a backlog the engine never goes idle, and the pages of finished requests, of
steps of every shape and of each snapshot pile up free in the arenas the same way, so the
loop also trims every `busy_interval_s` of its clock while it works. Each trim runs on a
worker thread; where the C library has no `malloc_trim` (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
import time
from collections.abc import Callable

TRIM_INTERVAL_S = 10.0
BUSY_TRIM_INTERVAL_S = 60.0  # a trim walks every arena: rare enough to cost nothing per step


def _malloc_trim() -> Callable[[], object] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    return None if trim is None else (lambda: trim(0))


class IdleTrim:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = TRIM_INTERVAL_S,
                 trim: Callable[[], object] | None = None,
                 busy_interval_s: float = BUSY_TRIM_INTERVAL_S) -> None:
        self.clock = clock
        self.interval_s = interval_s
        self.busy_interval_s = busy_interval_s
        self.trim = trim if trim is not None else _malloc_trim()
        self.last: float | None = None
        self.trims = 0

    def idle(self) -> bool:
        """The last request ended: trim, unless one ran within the interval. Whether it did."""
        return self._trim_within(self.interval_s)

    def busy(self) -> bool:
        """A step ran with requests still in hand: trim if none ran for `busy_interval_s`
        (the first call only starts the count). Whether it did."""
        if self.last is None:
            self.last = self.clock()
            return False
        return self._trim_within(self.busy_interval_s)

    def _trim_within(self, interval_s: float) -> bool:
        now = self.clock()
        if self.trim is None or (self.last is not None and 0 <= now - self.last < interval_s):
            return False
        self.last = now
        self.trims += 1
        threading.Thread(target=self.trim, name="tokenflow-trim", daemon=True).start()
        return True


def freeze_startup_heap() -> int:
    """Leave everything start-up built (the model, the libraries) out of every later garbage
    collection, as vLLM's engine core does after it starts; returns the objects frozen.
    A full collection walks every tracked object with all threads stopped: it ran for
    hundreds of milliseconds once a hostile body or a large answer set one off, and every
    client waited."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
