"""Drift events and configuration changes, newest first, as the console and CLI show them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.store.models import ConfigChangeRow, DriftEventRow


@dataclass(frozen=True)
class DriftRecord:
    id: int
    created_at: float
    deviation: float
    detail: str
    server: str = ""


@dataclass(frozen=True)
class ConfigChangeRecord:
    id: int
    created_at: float
    field: str
    old: Any
    new: Any
    source: str


def drift_events(session: Session, limit: int | None = 100) -> list[DriftRecord]:
    rows = session.scalars(select(DriftEventRow).order_by(DriftEventRow.id.desc()).limit(limit))
    return [DriftRecord(r.id, r.created_at, r.deviation, r.detail, r.server) for r in rows]


def config_changes(session: Session, limit: int | None = 100) -> list[ConfigChangeRecord]:
    rows = session.scalars(
        select(ConfigChangeRow).order_by(ConfigChangeRow.id.desc()).limit(limit)
    )
    return [ConfigChangeRecord(r.id, r.created_at, r.field, r.old, r.new, r.source) for r in rows]
