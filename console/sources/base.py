"""The one narrow interface the console reads an engine through.

An embedded engine, a recorded session and (later) an HTTP-attached server all hand the console
the same things: snapshots, live configuration changes, and the history kept in the store.
Store rows arrive as the store's own records (engine.store), newest first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import EngineError
from engine.snapshot import Snapshot

if TYPE_CHECKING:  # the store pulls in SQLAlchemy: kept off the launch path
    from engine.store import CalibrationRecord, ConfigChangeRecord, DriftRecord, SlowQueryRecord

Progress = Callable[[float, str], None]  # fraction done in [0, 1], what is happening now


class SourceError(EngineError):
    """The source cannot do what was asked (a recording cannot be tuned, a server is gone)."""


class Source(Protocol):
    """What every front end of the console reads from; calls may block (collectors run them)."""

    name: str  # shown in the header: "embedded synthetic:small on cpu", "replay FILE", ...

    def snapshot(self) -> Snapshot: ...

    def update_config(self, **changes: Any) -> dict[str, Any]:
        """Apply live changes all at once or not at all (raises ConfigError naming the field)."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def slow_queries(self, limit: int = 500) -> list[SlowQueryRecord]: ...

    def slow_query(self, query_id: int) -> SlowQueryRecord: ...

    def calibration_history(self) -> list[CalibrationRecord]: ...

    def drift_events(self) -> list[DriftRecord]: ...

    def config_changes(self) -> list[ConfigChangeRecord]: ...

    def recalibrate(self, progress: Progress) -> CalibrationRecord: ...

    def close(self) -> None: ...
