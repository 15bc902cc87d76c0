"""One batch of engine events as SQL: folded per request, then a few statements."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    Connection,
    Text,
    bindparam,
    case,
    func,
    insert,
    literal_column,
    type_coerce,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from engine.events import (
    ChunkComplete,
    ConfigChanged,
    Drift,
    EngineRestarted,
    Event,
    Failed,
    Finished,
    PauseChanged,
    Preempted,
    Rejected,
    RequestAdded,
    SessionStarted,
    SlowQuery,
    TokensGenerated,
)
from engine.store.models import (
    QUARANTINED,
    TERMINAL_STATES,
    ConfigChangeRow,
    DriftEventRow,
    EngineFaultRow,
    JournalRow,
    PauseRow,
    SessionStartRow,
    SlowQueryRow,
)

_JOURNAL = JournalRow.__table__
# Yield the GIL every few hundred folded events, so an engine thread never waits long for it.
_FOLD_SLICE = 256


@dataclass(slots=True)
class _Progress:
    """Everything one batch says about one request, folded in event order."""

    state: str | None = None
    prefilled: int | None = None
    chunks: int = 0
    preemptions: int = 0
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    finish_reason: str | None = None
    finished_at: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    budget_score: float | None = None

    def set_state(self, state: str) -> None:
        if self.state not in TERMINAL_STATES:
            self.state = state


@dataclass
class Batch:
    server: str = ""
    added: list[dict[str, Any]] = field(default_factory=list)
    progress: dict[str, _Progress] = field(default_factory=dict)
    slow: list[dict[str, Any]] = field(default_factory=list)
    drift: list[dict[str, Any]] = field(default_factory=list)
    config: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    pauses: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)


Statement = tuple[Callable[[Connection, Any], object], list[dict[str, Any]], str, str | None]


def to_statements(batch: Batch) -> list[Statement]:
    """The batch as statements, each with its rows, in the order they must run."""
    def driver(sql: dict[str, str]) -> Callable[[Connection, Any], object]:
        return lambda connection, rows: connection.exec_driver_sql(
            sql[connection.dialect.name], rows)

    def orm(model: Any) -> Callable[[Connection, Any], object]:
        return lambda connection, rows: connection.execute(insert(model), rows)

    now = time.time()
    progress = [_progress_params(batch.server, rid, p, now)
                for rid, p in batch.progress.items()]
    statements: list[Statement] = [
        (driver(_UPSERT_JOURNAL), batch.added, "request_journal", "request_id"),
        (driver(_UPDATE_JOURNAL), progress, "request_journal", "b_request_id"),
        (orm(SlowQueryRow), batch.slow, "slow_queries", "request_id"),
        (orm(DriftEventRow), batch.drift, "drift_events", None),
        (orm(ConfigChangeRow), batch.config, "config_changes", None),
        (orm(EngineFaultRow), batch.faults, "engine_faults", None),
        (orm(PauseRow), batch.pauses, "pauses", None),
        (orm(SessionStartRow), batch.starts, "session_starts", None),
    ]
    return [statement for statement in statements if statement[1]]


def prefilling(batch: Batch) -> tuple[str, ...]:
    return tuple(rid for rid, p in batch.progress.items()
                 if p.chunks and p.state == "PREFILL_CHUNKING")


def fold(events: list[Event], wall_offset: float, server: str = "") -> Batch:
    batch = Batch(server)
    progress = batch.progress
    for index, event in enumerate(events):
        if index % _FOLD_SLICE == _FOLD_SLICE - 1:
            time.sleep(0)  # hand the GIL back: see _FOLD_SLICE
        kind = type(event)
        if kind is TokensGenerated:
            at = event.ts + wall_offset
            for request_id, token in event.pairs():
                p = progress.get(request_id)
                if p is None:
                    p = progress[request_id] = _Progress()
                if p.first_token_at is None:
                    p.first_token_at = at
                p.tokens.append(token)
                if p.state not in TERMINAL_STATES:
                    p.state = "DECODING"
        elif kind is ChunkComplete:
            p = progress.setdefault(event.request_id, _Progress())
            p.chunks += 1
            p.prefilled = event.start + event.tokens
            p.set_state("DECODING" if event.prefill_done else "PREFILL_CHUNKING")
        elif kind is RequestAdded:
            progress.pop(event.request_id, None)
            batch.added.append(_added_row(event, event.ts + wall_offset, server))
        elif kind is Preempted:
            p = progress.setdefault(event.request_id, _Progress())
            p.preemptions += 1
            p.prefilled = 0  # RECOMPUTE: the prompt is prefilled again from the start
            p.set_state("PREEMPTED")
        elif kind is Finished:
            p = progress.setdefault(event.request_id, _Progress())
            p.set_state("FINISHED")
            p.finish_reason = event.reason
            p.finished_at = event.ts + wall_offset
            p.ttft_s, p.e2e_s, p.budget_score = event.ttft_s, event.e2e_s, event.budget_score
        elif kind is Failed or kind is Rejected:
            p = progress.setdefault(event.request_id, _Progress())
            p.set_state("FAILED" if kind is Failed else "REJECTED")
            p.finish_reason = event.reason
            p.finished_at = event.ts + wall_offset
        elif kind is SlowQuery:
            batch.slow.append(_slow_row(event, event.ts + wall_offset, server))
        elif kind is Drift:
            batch.drift.append(
                {"server": server, "created_at": event.ts + wall_offset,
                 "deviation": event.deviation, "detail": event.detail}
            )
        elif kind is ConfigChanged:
            batch.config.extend(
                {"server": server, "created_at": event.ts + wall_offset, "field": name,
                 "old": old, "new": new, "source": event.source}
                for name, (old, new) in event.changes.items()
            )
        elif kind is PauseChanged:
            batch.pauses.append({"server": server, "created_at": event.ts + wall_offset,
                                 "paused": event.paused})
        elif kind is SessionStarted:
            batch.starts.append({"server": server, "created_at": event.ts + wall_offset,
                                 "orphans": event.orphans})
        elif kind is EngineRestarted:
            batch.faults.append(
                {"server": server, "created_at": event.ts + wall_offset,
                 "restarts": event.restarts, "place": event.place, "error": event.error,
                 "traceback": event.traceback, "stopped": event.stopped,
                 "resumed": event.resumed, "failed": event.failed}
            )
    return batch


def _added_row(event: RequestAdded, at: float, server: str) -> dict[str, Any]:
    return {
        "server": server, "request_id": event.request_id, "tenant": event.tenant,
        "priority": event.priority,
        "tag": event.tag, "prompt_token_ids": ",".join(map(str, event.prompt_token_ids)),
        "sampling": json.dumps(event.sampling), "state": "WAITING", "prefilled_tokens": 0,
        "chunks_done": 0, "preemptions": 0,
        "generated_token_ids": ",".join(map(str, event.generated_token_ids)),
        "generated_tokens": len(event.generated_token_ids), "finish_reason": None,
        "added_at": at, "first_token_at": None,
        "finished_at": None, "ttft_s": None, "e2e_s": None, "budget_score": None,
        "updated_at": at, "resumed_at": None, "resume_attempts": 0,
    }


def _slow_row(event: SlowQuery, at: float, server: str) -> dict[str, Any]:
    return {
        "server": server, "created_at": at, "request_id": event.request_id, "tenant": event.tenant,
        "tag": event.tag, "budget_score": event.budget_score,
        "prompt_tokens": event.prompt_tokens, "prefill_s": event.prefill_s,
        "budgeted_s": event.budgeted_s, "chunks": list(event.chunks), "config": event.config,
        "timeline": event.timeline or None, "cause": event.cause,
        "cause_share": event.cause_share, "verdict": event.verdict or None,
        "cached_tokens": event.cached_tokens, "resumed_tokens": event.resumed_tokens,
        "rules": ",".join(event.rules), "represents": event.represents,
        "felt_part": event.felt_part, "felt_cause": event.felt_cause,
        "felt_share": event.felt_share,
    }


def _progress_params(server: str, request_id: str, p: _Progress, now: float,
                     ) -> dict[str, Any]:
    return {
        "b_server": server, "b_request_id": request_id, "b_state": p.state,
        "b_prefilled": p.prefilled,
        "b_chunks": p.chunks, "b_preemptions": p.preemptions,
        "b_tokens": ",".join(map(str, p.tokens)), "b_token_count": len(p.tokens),
        "b_first_token_at": p.first_token_at, "b_finish_reason": p.finish_reason,
        "b_finished_at": p.finished_at, "b_ttft_s": p.ttft_s, "b_e2e_s": p.e2e_s,
        "b_budget_score": p.budget_score, "b_now": now,
    }


def _driver_sql(build: Callable[[Any], Any]) -> dict[str, str]:
    """SQL text per dialect, bound by the driver from each row's dict (no SQLAlchemy per row)."""
    psycopg = postgresql.psycopg.dialect(paramstyle="pyformat")
    return {
        "sqlite": str(build(sqlite.insert).compile(dialect=sqlite.dialect(paramstyle="named"))),
        "postgresql": str(build(postgresql.insert).compile(dialect=psycopg)),
    }


def _build_upsert(insert: Any) -> Any:
    columns = [c.name for c in _JOURNAL.c if c.name != "id"]
    statement = insert(_JOURNAL).inline().values({name: bindparam(name) for name in columns})
    replaced: dict[str, Any] = {name: statement.excluded[name] for name in columns}
    # A resumed request keeps its resume count (to quarantine it); an ended id re-added starts at 0.
    ended = _JOURNAL.c.state.in_([literal_column(f"'{s}'") for s in (*TERMINAL_STATES,
                                                                      QUARANTINED)])
    for name in ("resume_attempts", "resumed_at"):
        replaced[name] = case((ended, statement.excluded[name]), else_=_JOURNAL.c[name])
    return statement.on_conflict_do_update(index_elements=["server", "request_id"],
                                           set_=replaced)


def _build_update(_insert: Any) -> Any:
    c = _JOURNAL.c
    tokens = bindparam("b_tokens", type_=Text)
    stored = type_coerce(c.generated_token_ids, Text)
    terminal = [literal_column(f"'{state}'") for state in TERMINAL_STATES]
    empty, comma = literal_column("''"), literal_column("','")
    return (
        update(_JOURNAL)
        .where(c.server == bindparam("b_server"), c.request_id == bindparam("b_request_id"))
        .values(
            state=case(
                (c.state.in_(terminal), c.state),
                else_=func.coalesce(bindparam("b_state"), c.state),
            ),
            prefilled_tokens=func.coalesce(bindparam("b_prefilled"), c.prefilled_tokens),
            chunks_done=c.chunks_done + bindparam("b_chunks"),
            preemptions=c.preemptions + bindparam("b_preemptions"),
            # Appending in SQL keeps a long generation from being read back on every batch.
            generated_token_ids=case(
                (tokens == empty, stored),
                (stored == empty, tokens),
                else_=stored + comma + tokens,
            ),
            generated_tokens=c.generated_tokens + bindparam("b_token_count"),
            first_token_at=func.coalesce(c.first_token_at, bindparam("b_first_token_at")),
            finish_reason=func.coalesce(bindparam("b_finish_reason"), c.finish_reason),
            finished_at=func.coalesce(bindparam("b_finished_at"), c.finished_at),
            ttft_s=func.coalesce(bindparam("b_ttft_s"), c.ttft_s),
            e2e_s=func.coalesce(bindparam("b_e2e_s"), c.e2e_s),
            budget_score=func.coalesce(bindparam("b_budget_score"), c.budget_score),
            updated_at=bindparam("b_now"),
        )
    )


_UPSERT_JOURNAL = _driver_sql(_build_upsert)
_UPDATE_JOURNAL = _driver_sql(_build_update)
