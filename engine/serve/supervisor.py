"""The engine loop's supervisor: when to restart an engine whose step raised, and when to stop."""

from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.clock import Clock
from engine.config import ConfigError
from engine.errors import EngineError

MAX_FAULTS = 3
FAULT_WINDOW_S = 60.0
STRIKES = 2


@dataclass(frozen=True)
class Fault:
    """One exception that escaped a step."""

    ts: float
    error: str
    place: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException, ts: float) -> Fault:
        frames = traceback.extract_tb(exc.__traceback__)
        place = (f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}"
                 if frames else "an unknown place")
        return cls(ts, repr(exc), place, "".join(traceback.format_exception(exc)))


class EngineStopped(EngineError):
    """A crash loop stopped the engine; the message names the last fault's place."""

    def __init__(self, faults: int, window_s: float, last: Fault) -> None:
        super().__init__(f"the engine stopped after {faults} faults within {window_s:g} s; "
                         f"the last was {last.error} at {last.place}; restart the server")
        self.last = last


class Supervisor:
    def __init__(self, clock: Clock, *, max_faults: int = MAX_FAULTS,
                 window_s: float = FAULT_WINDOW_S, strikes: int = STRIKES) -> None:
        if max_faults < 1 or not window_s > 0 or strikes < 1:
            raise ConfigError("supervisor", f"needs max_faults >= 1, window_s > 0 and "
                              f"strikes >= 1; got {max_faults}, {window_s}, {strikes}")
        self.clock = clock
        self.max_faults = max_faults
        self.window_s = window_s
        self.strikes = strikes
        self.restarts = 0
        self.last: Fault | None = None
        self.stopped: EngineStopped | None = None
        self._recent: deque[float] = deque(maxlen=max_faults)
        self._struck: dict[str, int] = {}

    def judge(self, exc: BaseException) -> Fault:
        """Note a fault; `stopped` is set when it completes a crash loop."""
        fault = self.last = Fault.of(exc, self.clock())
        self._recent.append(fault.ts)
        if (len(self._recent) == self.max_faults
                and fault.ts - self._recent[0] <= self.window_s):
            self.stopped = EngineStopped(self.max_faults, self.window_s, fault)
        else:
            self.restarts += 1
        return fault

    def struck_out(self, in_step: Iterable[str], live: Iterable[str]) -> set[str]:
        """Strike each request of the failed step; those at `strikes` fail, the rest are retried."""
        alive = set(live)
        self._struck = {rid: n for rid, n in self._struck.items() if rid in alive}
        out = set()
        for rid in set(in_step) & alive:
            self._struck[rid] = self._struck.get(rid, 0) + 1
            if self._struck[rid] >= self.strikes:
                out.add(rid)
        return out
