"""FleetSource: several attached servers, one shown at a time (the console's tabs).

Every call goes to the selected member; `members` lists them all so a fleet view can show
each one's name and whether it is online, and `select` switches the tab.
"""

from __future__ import annotations

from typing import Any

from console.sources.base import Progress, Source, SourceError
from engine.snapshot import Snapshot
from engine.store import CalibrationRecord, ConfigChangeRecord, DriftRecord, SlowQueryRecord


class FleetSource:
    def __init__(self, members: list[Source]) -> None:
        if not members:
            raise SourceError("a fleet needs at least one server; pass --attach URL")
        self.members = members
        self.selected = 0

    @property
    def active(self) -> Source:
        return self.members[self.selected]

    @property
    def name(self) -> str:
        return f"[{self.selected + 1}/{len(self.members)}] {self.active.name}"

    def select(self, index: int) -> None:
        if not 0 <= index < len(self.members):
            raise SourceError(f"no server {index + 1}: the fleet has {len(self.members)}")
        self.selected = index

    def snapshot(self) -> Snapshot:
        return self.active.snapshot()

    def update_config(self, **changes: Any) -> dict[str, Any]:
        return self.active.update_config(**changes)

    def pause(self) -> None:
        self.active.pause()

    def resume(self) -> None:
        self.active.resume()

    def slow_queries(self, limit: int = 500) -> list[SlowQueryRecord]:
        return self.active.slow_queries(limit)

    def slow_query(self, query_id: int) -> SlowQueryRecord:
        return self.active.slow_query(query_id)

    def calibration_history(self) -> list[CalibrationRecord]:
        return self.active.calibration_history()

    def drift_events(self) -> list[DriftRecord]:
        return self.active.drift_events()

    def config_changes(self) -> list[ConfigChangeRecord]:
        return self.active.config_changes()

    def recalibrate(self, progress: Progress) -> CalibrationRecord:
        return self.active.recalibrate(progress)

    def close(self) -> None:
        for member in self.members:
            member.close()
