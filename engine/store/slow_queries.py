"""Slow queries: keyset-paginated lists, fetch one, export as CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session

from engine.errors import EngineError
from engine.snapshot import prompt_words
from engine.store.models import SlowQueryRow

# sort name -> the column it orders by, highest first (ties: newest first); "id": oldest first
SORT_FIELDS = {
    # an SLO breach stored without a calibrated plan has no score: it sorts last, and pages
    # on (every database orders NULL differently and compares it with nothing)
    "score": func.coalesce(SlowQueryRow.budget_score, -1.0),
    "time": SlowQueryRow.created_at,
    "prompt": SlowQueryRow.prompt_tokens,
    "prefill": SlowQueryRow.prefill_s,
    "id": SlowQueryRow.id,
}
EXPORT_FORMATS = ("csv", "json")


@dataclass(frozen=True)
class SlowQueryRecord:
    id: int
    created_at: float
    request_id: str
    tenant: str
    tag: str | None
    budget_score: float | None
    prompt_tokens: int
    prefill_s: float
    budgeted_s: float
    chunks: list[dict[str, Any]]
    config: dict[str, Any]
    source: str | None = None
    server: str = ""
    timeline: dict[str, Any] | None = None
    cause: str | None = None
    cause_share: float | None = None
    verdict: str | None = None
    cached_tokens: int | None = None
    resumed_tokens: int | None = None
    rules: str = "budget_score"  # which rules stored it, comma-separated
    represents: int = 1  # itself and the SLO breaches sampled out before it
    felt_part: str | None = None  # queue_wait, prefill or decode_stall (None: before 0011)
    felt_cause: str | None = None
    felt_share: float | None = None

    @classmethod
    def from_row(cls, row: SlowQueryRow) -> SlowQueryRecord:
        return cls(**{name: getattr(row, name) for name in cls.__dataclass_fields__})

    def prompt_words(self) -> str:
        return prompt_words(self.prompt_tokens, self.cached_tokens, self.resumed_tokens)


def list_slow_queries(
    session: Session,
    *,
    sort: str = "score",
    tenant: str | None = None,
    server: str | None = None,
    min_score: float | None = None,
    limit: int | None = None,
    after: int | None = None,
) -> list[SlowQueryRecord]:
    """One page of matching slow queries in `sort` order, after the row with id `after`."""
    if sort not in SORT_FIELDS:
        raise EngineError(f"unknown sort field {sort!r}; choose one of {', '.join(SORT_FIELDS)}")
    column, row_id = SORT_FIELDS[sort], SlowQueryRow.id
    if sort == "id":
        query = select(SlowQueryRow).order_by(row_id)
        if after is not None:
            query = query.where(row_id > after)
    else:
        query = select(SlowQueryRow).order_by(column.desc(), row_id.desc())
        last = None if after is None else session.scalar(select(column).where(row_id == after))
        if last is not None:
            query = query.where(tuple_(column, row_id) < tuple_(last, after))
    if tenant is not None:
        query = query.where(SlowQueryRow.tenant == tenant)
    if server is not None:
        query = query.where(SlowQueryRow.server == server)
    if min_score is not None:
        query = query.where(SlowQueryRow.budget_score >= min_score)
    if limit is not None:
        query = query.limit(limit)
    return [SlowQueryRecord.from_row(row) for row in session.scalars(query)]


def get_slow_query(session: Session, slow_query_id: int) -> SlowQueryRecord | None:
    row = session.get(SlowQueryRow, slow_query_id)
    return None if row is None else SlowQueryRecord.from_row(row)


# A spreadsheet runs a cell that starts with one of these as a formula (=HYPERLINK(...)).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    """A text cell a spreadsheet shows as text (OWASP's CSV-injection advice); numbers unchanged."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def export_slow_queries(records: list[SlowQueryRecord], fmt: str) -> str:
    """CSV (JSON text in the chunks and config cells) or a JSON array."""
    if fmt == "json":
        return json.dumps([asdict(record) for record in records], indent=2) + "\n"
    if fmt != "csv":
        raise EngineError(f"unknown export format {fmt!r}; choose csv or json")
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(SlowQueryRecord.__dataclass_fields__))
    writer.writeheader()
    for record in records:
        row = asdict(record)
        for name in ("chunks", "config", "timeline"):
            row[name] = json.dumps(row[name])
        writer.writerow({name: csv_cell(value) for name, value in row.items()})
    return out.getvalue()
