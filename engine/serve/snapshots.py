"""The engine's snapshot for other threads: taken on the loop's, at most every interval."""

from __future__ import annotations

import dataclasses

from engine.clock import Clock
from engine.core.engine_core import EngineCore
from engine.serve.supervisor import Supervisor
from engine.snapshot import Snapshot


class SnapshotPublisher:
    def __init__(self, engine: EngineCore, supervisor: Supervisor, clock: Clock,
                 interval_s: float) -> None:
        self.engine = engine
        self.supervisor = supervisor
        self.clock = clock
        self.interval_s = interval_s
        self.latest: Snapshot = engine.snapshot()
        self._at = 0.0

    def publish(self, force: bool = False) -> None:
        """A new snapshot when forced or an interval on, naming the restarts and last fault."""
        now = self.clock()
        if force or now - self._at >= self.interval_s:
            snapshot = self.engine.snapshot()
            last = self.supervisor.last
            if last is not None:
                snapshot = dataclasses.replace(
                    snapshot, engine_restarts=self.supervisor.restarts,
                    engine_fault=f"{last.error} at {last.place}")
            self.latest = snapshot
            self._at = now
