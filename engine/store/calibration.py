"""Calibration runs and the budget tables they measured, for the calibrator and drift checks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from engine.store.models import BudgetTableRow, CalibrationRunRow


@dataclass(frozen=True)
class BudgetPoint:
    """Measured prefill time of `tokens` new tokens on top of `context_tokens` cached ones."""

    tokens: int
    context_tokens: int
    seconds: float


@dataclass(frozen=True)
class CalibrationRecord:
    id: int
    created_at: float
    model: str
    device: str
    info: dict[str, Any]
    params: dict[str, Any]
    table: list[BudgetPoint]
    reason: str = ""

    @property
    def reused(self) -> bool:
        """Copied from another store (reuse_default_calibration), not measured here."""
        return self.reason.endswith(REUSED)

    def provenance_words(self) -> str:
        """Where and under what load it was measured, as the header and Drift say it."""
        p = self.info.get("provenance") or {}
        if not p:
            return "where it was measured is not recorded"
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(p.get("measured_at", 0.0)))
        load = p.get("load") or {}
        busy = (f"while other processes used {load.get('others_cpus', 0.0):.1f} CPUs"
                if load.get("contended") else "on a quiet host")
        return (f"measured {when} on {p.get('host') or 'an unnamed host'} "
                f"({p.get('device', self.device)}) {busy}, stored in {p.get('store', '?')}")


REUSED = ", reused"  # the end of a copied calibration's reason

def save_calibration(
    session: Session,
    *,
    model: str,
    device: str,
    table: Sequence[BudgetPoint],
    params: dict[str, Any],
    info: dict[str, Any] | None = None,
    reason: str = "",
) -> int:
    """Store one run with its table, fitted parameters and reason; commits, returns its id.
    Its provenance names this store unless it already names the one it was measured in
    (a copy keeps its origin)."""
    info = dict(info or {})
    provenance = dict(info.get("provenance") or {})
    provenance.setdefault("store", session.get_bind().url.render_as_string(hide_password=True))
    info["provenance"] = provenance
    run = CalibrationRunRow(
        server=session.info.get("server", ""), created_at=time.time(), model=model,
        device=device, info=info, params=params, reason=reason,
        table=[
            BudgetTableRow(tokens=p.tokens, context_tokens=p.context_tokens, seconds=p.seconds)
            for p in table
        ],
    )
    session.add(run)
    session.commit()
    return run.id


def latest_calibration(
    session: Session, *, model: str | None = None, device: str | None = None
) -> CalibrationRecord | None:
    history = calibration_history(session, model=model, device=device, limit=1)
    return history[0] if history else None


def calibration_history(
    session: Session,
    *,
    model: str | None = None,
    device: str | None = None,
    limit: int | None = None,
) -> list[CalibrationRecord]:
    """Runs newest first, optionally only those of one model and device."""
    query = (
        select(CalibrationRunRow)
        .options(selectinload(CalibrationRunRow.table))
        .order_by(CalibrationRunRow.id.desc())
        .limit(limit)
    )
    if model is not None:
        query = query.where(CalibrationRunRow.model == model)
    if device is not None:
        query = query.where(CalibrationRunRow.device == device)
    return [
        CalibrationRecord(
            id=run.id, created_at=run.created_at, model=run.model, device=run.device,
            info=run.info, params=run.params, reason=run.reason,
            table=[
                BudgetPoint(p.tokens, p.context_tokens, p.seconds)
                for p in sorted(run.table, key=lambda p: (p.tokens, p.context_tokens))
            ],
        )
        for run in session.scalars(query)
    ]
