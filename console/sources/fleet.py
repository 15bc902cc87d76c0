"""FleetSource: several attached servers, one shown at a time (the console's tabs).

Every call goes to the selected member, and the fleet can do what that member can: its
capabilities follow the selection. `members` lists them all so a fleet view can show each
one's name and whether it is online, and `select` switches the tab.
"""

from __future__ import annotations

from typing import Any

from console.sources.base import (
    Calibrating,
    CalibrationStore,
    Capabilities,
    ConfigHistory,
    Pausable,
    Progress,
    SlowQueryStore,
    Source,
    SourceError,
    Tunable,
    facet,
)
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

    @property
    def capabilities(self) -> Capabilities:
        return self.active.capabilities

    def select(self, index: int) -> None:
        if not 0 <= index < len(self.members):
            raise SourceError(f"no server {index + 1}: the fleet has {len(self.members)}")
        self.selected = index

    def snapshot(self) -> Snapshot:
        return self.active.snapshot()

    # Each facet goes to the selected member, refused with its reason where it lacks it.
    def update_config(self, **changes: Any) -> dict[str, Any]:
        return facet(self.active, Tunable).update_config(**changes)

    def pause(self) -> None:
        facet(self.active, Pausable).pause()

    def resume(self) -> None:
        facet(self.active, Pausable).resume()

    def slow_queries(self, limit: int = 500) -> list[SlowQueryRecord]:
        return facet(self.active, SlowQueryStore).slow_queries(limit)

    def slow_query(self, query_id: int) -> SlowQueryRecord:
        return facet(self.active, SlowQueryStore).slow_query(query_id)

    def calibration_history(self) -> list[CalibrationRecord]:
        return facet(self.active, CalibrationStore).calibration_history()

    def drift_events(self) -> list[DriftRecord]:
        return facet(self.active, CalibrationStore).drift_events()

    def config_changes(self) -> list[ConfigChangeRecord]:
        return facet(self.active, ConfigHistory).config_changes()

    def recalibrate(self, progress: Progress) -> CalibrationRecord:
        return facet(self.active, Calibrating).recalibrate(progress)

    def close(self) -> None:
        for member in self.members:
            member.close()
