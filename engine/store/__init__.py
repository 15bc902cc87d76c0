"""The store (SQLite, or PostgreSQL a fleet shares); every row names the server that wrote it."""

from engine.store.calibration import (
    BudgetPoint,
    CalibrationRecord,
    calibration_history,
    latest_calibration,
    save_calibration,
)
from engine.store.database import (
    Database,
    StoreError,
    default_db_path,
    head_revision,
    open_database,
    upgrade_database,
)
from engine.store.history import ConfigChangeRecord, DriftRecord, config_changes, drift_events
from engine.store.journal import (
    QUARANTINE_AFTER,
    JournalEntry,
    QuarantinedRequest,
    claim_for_resume,
    close_entry,
    discard_unfinished,
    next_cycle,
    quarantined_requests,
    release_quarantine,
    unfinished_requests,
)
from engine.store.lock import StoreLockedError
from engine.store.metric_history import MetricBucket, StoredMetrics, stored_metrics
from engine.store.retention import RetentionLimits, apply_retention
from engine.store.slow_queries import (
    SlowQueryRecord,
    export_slow_queries,
    get_slow_query,
    list_slow_queries,
)
from engine.store.traced import TracedDriftPoint, traced_drift
from engine.store.writer import Commit, SkippedRow, StoreWriter

__all__ = [
    "QUARANTINE_AFTER",
    "BudgetPoint",
    "CalibrationRecord",
    "Commit",
    "ConfigChangeRecord",
    "Database",
    "DriftRecord",
    "JournalEntry",
    "MetricBucket",
    "QuarantinedRequest",
    "RetentionLimits",
    "SkippedRow",
    "SlowQueryRecord",
    "StoreError",
    "StoreLockedError",
    "StoreWriter",
    "StoredMetrics",
    "TracedDriftPoint",
    "apply_retention",
    "calibration_history",
    "claim_for_resume",
    "close_entry",
    "config_changes",
    "default_db_path",
    "discard_unfinished",
    "drift_events",
    "export_slow_queries",
    "get_slow_query",
    "head_revision",
    "latest_calibration",
    "list_slow_queries",
    "next_cycle",
    "open_database",
    "quarantined_requests",
    "release_quarantine",
    "save_calibration",
    "stored_metrics",
    "traced_drift",
    "unfinished_requests",
    "upgrade_database",
]
