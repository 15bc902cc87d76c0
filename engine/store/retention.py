"""How many rows each table keeps; unfinished journal entries are never deleted."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, Table, delete, select

from engine.errors import EngineError
from engine.store.models import (
    TERMINAL_STATES,
    CalibrationRunRow,
    ConfigChangeRow,
    DriftEventRow,
    EngineFaultRow,
    JournalRow,
    PauseRow,
    SessionStartRow,
    SlowQueryRow,
    TracedRequestRow,
)


@dataclass(frozen=True)
class RetentionLimits:
    journal: int = 100_000
    slow_queries: int = 10_000
    traced_requests: int = 100_000
    traced_slow_queries: int = 10_000
    calibration_runs: int = 200  # their budget tables go with them (ON DELETE CASCADE)
    drift_events: int = 10_000
    config_changes: int = 10_000
    engine_faults: int = 1_000
    pauses: int = 10_000
    session_starts: int = 10_000

    def __post_init__(self) -> None:
        for name, limit in vars(self).items():
            if limit < 1:
                raise EngineError(f"retention limit {name} must be >= 1, got {limit}")


def apply_retention(connection: Connection, limits: RetentionLimits) -> int:
    """Delete the oldest rows beyond each limit; returns how many were deleted."""
    journal = JournalRow.__table__
    deleted = _keep_newest(
        connection, journal, limits.journal, journal.c.state.in_(TERMINAL_STATES)
    )
    slow = SlowQueryRow.__table__
    deleted += _keep_newest(connection, slow, limits.slow_queries, slow.c.source.is_(None))
    deleted += apply_traced_retention(connection, limits)
    for row_type, limit in (
        (CalibrationRunRow, limits.calibration_runs),
        (DriftEventRow, limits.drift_events),
        (ConfigChangeRow, limits.config_changes),
        (EngineFaultRow, limits.engine_faults),
        (PauseRow, limits.pauses),
        (SessionStartRow, limits.session_starts),
    ):
        deleted += _keep_newest(connection, row_type.__table__, limit)
    return deleted


def apply_traced_retention(connection: Connection, limits: RetentionLimits) -> int:
    slow = SlowQueryRow.__table__
    return (_keep_newest(connection, TracedRequestRow.__table__, limits.traced_requests)
            + _keep_newest(connection, slow, limits.traced_slow_queries,
                           slow.c.source.is_not(None)))


def _keep_newest(connection: Connection, table: Table, keep: int, *where: object) -> int:
    cutoff = connection.execute(
        select(table.c.id).where(*where).order_by(table.c.id.desc()).offset(keep).limit(1)
    ).scalar()
    if cutoff is None:
        return 0
    return connection.execute(delete(table).where(table.c.id <= cutoff, *where)).rowcount
