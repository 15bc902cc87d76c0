"""A workload played into the engine at its arrival times, at a rate that can change live."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from engine.clock import Clock
from engine.config import SamplingParams
from engine.core.engine_core import EngineCore


class Arrival(Protocol):
    """A request due `arrival_s` seconds into a workload: what the bench harness's workloads
    (WorkloadRequest) hand the player, which builds none itself."""

    @property
    def request_id(self) -> str: ...
    @property
    def arrival_s(self) -> float: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def tenant(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def tag(self) -> str | None: ...
    def sampling_params(self) -> SamplingParams: ...


class WorkloadPlayer:
    """`plan`, `speed_for` and `arrival_rate` run on any thread; the rest on the loop's."""

    def __init__(self, clock: Clock, pace: float = 1.0) -> None:
        """`pace`: `clock`'s seconds a wall-clock second (a paced twin's speed), so an idle
        loop waits for the next arrival in wall seconds."""
        self.clock = clock
        self.pace = pace
        self._workload: deque[Arrival] = deque()
        self._workload_start = 0.0
        self._played_s = 0.0
        self._speed = 1.0
        self._asked_speed = 1.0
        self._base_rate: float | None = None
        self._workload_cycle: list[Arrival] | None = None
        self._cycle_count = 0

    def plan(self, workload: Sequence[Arrival]) -> None:
        """The rate `workload` arrives at by its own times."""
        self._asked_speed = 1.0
        last = max((item.arrival_s for item in workload), default=0.0)
        self._base_rate = len(workload) / last if last > 0 else None

    def install(self, workload: Sequence[Arrival], repeat: bool, first_cycle: int) -> None:
        self._workload = deque(workload)
        self._workload_start = self.clock()
        self._played_s = 0.0
        self._speed = 1.0
        self._workload_cycle = list(workload) if repeat else None
        self._cycle_count = first_cycle

    @property
    def arrival_rate(self) -> float | None:
        return None if self._base_rate is None else self._base_rate * self._asked_speed

    def speed_for(self, rate: float) -> float:
        """The playing speed of `rate` requests/s; ValueError where there is none."""
        if self._base_rate is None:
            raise ValueError("no workload with a rate is playing (one sent all at once has none)")
        if not (rate >= 0 and rate < float("inf")):
            raise ValueError(f"the arrival rate must be a finite number >= 0, got {rate}")
        speed = self._asked_speed = rate / self._base_rate
        return speed

    def retime(self, speed: float) -> None:
        now = self.clock()
        self._played_s = self._workload_clock(now)
        self._workload_start = now
        self._speed = speed

    def _workload_clock(self, now: float) -> float:
        return self._played_s + (now - self._workload_start) * self._speed

    def idle_timeout(self, interval_s: float) -> float:
        """How long an idle loop may wait: to the next arrival, at most `interval_s`."""
        if self._workload and self._speed > 0:
            ahead = self._workload[0].arrival_s - self._workload_clock(self.clock())
            return max(0.0, min(ahead / self._speed / self.pace, interval_s))
        return interval_s

    def feed(self, engine: EngineCore) -> None:
        """Add to `engine` the requests whose arrival time has come."""
        elapsed = self._workload_clock(self.clock())
        while self._workload and self._workload[0].arrival_s <= elapsed:
            item = self._workload.popleft()
            engine.add_request(list(item.prompt_token_ids), item.sampling_params(),
                               tenant=item.tenant, priority=item.priority,
                               request_id=f"{item.request_id}-{self._cycle_count}",
                               tag=item.tag)
        if not self._workload and self._workload_cycle:
            self._cycle_count += 1
            self._workload = deque(self._workload_cycle)
            self._workload_start = self.clock()
            self._played_s = 0.0
