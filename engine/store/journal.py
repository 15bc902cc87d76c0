"""Reading the request journal back: what a killed run left unfinished, and what is quarantined."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, select, true, update
from sqlalchemy.orm import Session

from engine.store.models import QUARANTINED, TERMINAL_STATES, JournalRow

# Unfinished after this many resumed runs died with it in flight: likely the cause, so held back.
QUARANTINE_AFTER = 2


@dataclass(frozen=True)
class JournalEntry:
    request_id: str
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    sampling: dict[str, Any]
    tenant: str
    priority: int
    tag: str | None
    state: str
    prefilled_tokens: int
    resume_attempts: int


@dataclass(frozen=True)
class QuarantinedRequest:
    request_id: str
    tenant: str
    tag: str | None
    prompt_tokens: int
    generated_tokens: int
    reason: str | None
    updated_at: float


def own(session: Session) -> ColumnElement[bool]:
    if session.info.get("shared"):
        return JournalRow.server == session.info["server"]
    return true()


def unfinished_requests(session: Session) -> list[JournalEntry]:
    """Requests neither finished, failed, rejected nor quarantined, oldest first."""
    rows = session.scalars(
        select(JournalRow)
        .where(JournalRow.state.not_in((*TERMINAL_STATES, QUARANTINED)), own(session))
        .order_by(JournalRow.id)
    )
    return [
        JournalEntry(
            request_id=row.request_id,
            prompt_token_ids=row.prompt_token_ids,
            generated_token_ids=row.generated_token_ids,
            sampling=row.sampling,
            tenant=row.tenant,
            priority=row.priority,
            tag=row.tag,
            state=row.state,
            prefilled_tokens=row.prefilled_tokens,
            resume_attempts=row.resume_attempts,
        )
        for row in rows
    ]


def discard_unfinished(session: Session, reason: str, state: str = "FAILED") -> list[str]:
    """Close every unfinished entry as `state` with `reason`; commits; the ids closed."""
    ids = [entry.request_id for entry in unfinished_requests(session)]
    for request_id in ids:
        close_entry(session, request_id, state, reason)
    return ids


def claim_for_resume(session: Session, request_ids: Iterable[str]) -> int:
    """Count one more resume attempt per entry and commit; the entries stay unfinished."""
    now = time.time()
    result = session.execute(
        update(JournalRow)
        .where(JournalRow.request_id.in_(list(request_ids)),
               JournalRow.state.not_in((*TERMINAL_STATES, QUARANTINED)), own(session))
        .values(resume_attempts=JournalRow.resume_attempts + 1, resumed_at=now, updated_at=now,
                server=session.info.get("server", JournalRow.server))
    )
    session.commit()
    return result.rowcount


def close_entry(session: Session, request_id: str, state: str, reason: str) -> None:
    """Set an unfinished entry's state (FAILED, QUARANTINED, or FINISHED for an abort); commits.
    An entry that ended meanwhile (its writer recorded it after it was read) is left as is."""
    now = time.time()
    session.execute(
        update(JournalRow)
        .where(JournalRow.request_id == request_id, own(session),
               JournalRow.state.not_in((*TERMINAL_STATES, QUARANTINED)))
        .values(state=state, finish_reason=reason, updated_at=now)
    )
    session.commit()


def quarantined_requests(session: Session) -> list[QuarantinedRequest]:
    """Quarantined entries, oldest first, from columns every schema revision has."""
    c = JournalRow.__table__.c
    rows = session.execute(
        select(c.request_id, c.tenant, c.tag, c.prompt_token_ids, c.generated_tokens,
               c.finish_reason, c.updated_at)
        .where(c.state == QUARANTINED).order_by(c.id)
    )
    return [QuarantinedRequest(row.request_id, row.tenant, row.tag, len(row.prompt_token_ids),
                               row.generated_tokens, row.finish_reason, row.updated_at)
            for row in rows]


def release_quarantine(session: Session, request_id: str) -> bool:
    """Let the next resuming run take a quarantined entry again; False if there is none."""
    result = session.execute(
        update(JournalRow)
        .where(JournalRow.request_id == request_id, JournalRow.state == QUARANTINED,
               own(session))
        .values(state="WAITING", resume_attempts=0, finish_reason=None, updated_at=time.time())
    )
    session.commit()
    return result.rowcount == 1


def next_cycle(session: Session, request_id: str) -> int:
    """One past the highest n of any `{request_id}-{n}` in the journal, so replays reuse no id."""
    prefix = f"{request_id}-"
    names = session.scalars(
        select(JournalRow.request_id).where(JournalRow.request_id.startswith(prefix,
                                                                             autoescape=True),
                                            own(session))
    )
    cycles = [int(n[len(prefix):]) for n in names if n[len(prefix):].isdigit()]
    return max(cycles, default=-1) + 1
