"""Reading the request journal back: what a killed run left unfinished (pitfall 12)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from engine.store.models import TERMINAL_STATES, JournalRow


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


def unfinished_requests(session: Session) -> list[JournalEntry]:
    """Requests neither finished, failed, rejected nor already resumed, oldest first."""
    rows = session.scalars(
        select(JournalRow).where(JournalRow.state.not_in(TERMINAL_STATES)).order_by(JournalRow.id)
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
        )
        for row in rows
    ]


def mark_resumed(session: Session, request_ids: Iterable[str]) -> int:
    """Close entries handed to a new run (state RESUMED) so they are not resumed twice.

    Commits; returns how many entries changed. A request re-added under the same id gets
    a fresh journal row from its RequestAdded event, which supersedes this mark.
    """
    ids = list(request_ids)
    result = session.execute(
        update(JournalRow)
        .where(JournalRow.request_id.in_(ids), JournalRow.state.not_in(TERMINAL_STATES))
        .values(state="RESUMED", resumed_at=time.time(), updated_at=time.time())
    )
    session.commit()
    return result.rowcount


def next_cycle(session: Session, request_id: str) -> int:
    """One past the highest n of any `{request_id}-{n}` in the journal (0 if none): replayed
    traffic whose cycles are numbered from here takes no id a killed run left in flight,
    and overwrites no finished request's entry."""
    prefix = f"{request_id}-"
    names = session.scalars(
        select(JournalRow.request_id).where(JournalRow.request_id.startswith(prefix,
                                                                             autoescape=True))
    )
    cycles = [int(n[len(prefix):]) for n in names if n[len(prefix):].isdigit()]
    return max(cycles, default=-1) + 1
