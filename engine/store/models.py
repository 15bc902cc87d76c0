"""The store's tables as SQLAlchemy 2 typed models (`*_at`: wall-clock epoch seconds)."""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    Dialect,
    Float,
    ForeignKey,
    Index,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

TERMINAL_STATES = ("FINISHED", "FAILED", "REJECTED")
# Too often resumed and lost with the process: kept, never resumed or deleted, until released.
QUARANTINED = "QUARANTINED"


class TokenIds(TypeDecorator[list[int]]):
    """list[int] stored as "1,2,3": appendable with `||` in one UPDATE."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: list[int] | None, dialect: Dialect) -> str | None:
        return None if value is None else ",".join(map(str, value))

    def process_result_value(self, value: str | None, dialect: Dialect) -> list[int] | None:
        if value is None:
            return None
        return [int(token) for token in value.split(",")] if value else []


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        float: Float, dict[str, Any]: JSON, list[Any]: JSON
    }


def server_column() -> Mapped[str]:
    """The server that wrote the row (`--server-name`)."""
    return mapped_column(String(256), default="", server_default="")


class JournalRow(Base):
    """One request, updated as it progresses, so a killed run can be finished."""

    __tablename__ = "request_journal"

    id: Mapped[int] = mapped_column(primary_key=True)
    server: Mapped[str] = server_column()
    request_id: Mapped[str] = mapped_column(String(128))
    tenant: Mapped[str] = mapped_column(String(128))
    priority: Mapped[int]
    tag: Mapped[str | None] = mapped_column(String(128))
    prompt_token_ids: Mapped[list[int]] = mapped_column(TokenIds)
    sampling: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(32))
    prefilled_tokens: Mapped[int]
    chunks_done: Mapped[int]
    preemptions: Mapped[int]
    generated_token_ids: Mapped[list[int]] = mapped_column(TokenIds)
    generated_tokens: Mapped[int]
    finish_reason: Mapped[str | None] = mapped_column(Text)
    added_at: Mapped[float]
    first_token_at: Mapped[float | None]
    finished_at: Mapped[float | None]
    ttft_s: Mapped[float | None]
    e2e_s: Mapped[float | None]
    budget_score: Mapped[float | None]
    updated_at: Mapped[float]
    resumed_at: Mapped[float | None]
    resume_attempts: Mapped[int] = mapped_column(server_default="0")

    __table_args__ = (
        Index("ix_request_journal_state", "state"),
        Index("ix_request_journal_server_state", "server", "state"),
        UniqueConstraint("server", "request_id", name="uq_request_journal_server_request_id"),
    )


class SlowQueryRow(Base):
    __tablename__ = "slow_queries"

    id: Mapped[int] = mapped_column(primary_key=True)
    server: Mapped[str] = server_column()
    created_at: Mapped[float]
    request_id: Mapped[str] = mapped_column(String(128))
    tenant: Mapped[str] = mapped_column(String(128))
    tag: Mapped[str | None] = mapped_column(String(128))
    budget_score: Mapped[float | None]  # None: an SLO breach without a calibrated plan
    prompt_tokens: Mapped[int]
    prefill_s: Mapped[float]
    budgeted_s: Mapped[float]
    chunks: Mapped[list[Any]]
    config: Mapped[dict[str, Any]]
    source: Mapped[str | None] = mapped_column(String(256))
    timeline: Mapped[dict[str, Any] | None]
    cause: Mapped[str | None] = mapped_column(String(32))
    cause_share: Mapped[float | None]
    verdict: Mapped[str | None] = mapped_column(Text)
    cached_tokens: Mapped[int | None]
    # output tokens it had when resumed from the journal; None: not (or a row before 0010)
    resumed_tokens: Mapped[int | None]
    # the rules that stored it, comma-separated: budget_score, ttft_slo, itl_slo
    rules: Mapped[str] = mapped_column(String(64), default="budget_score",
                                       server_default="budget_score")
    represents: Mapped[int] = mapped_column(default=1, server_default="1")
    # what the user felt most and its cause (None: a row before 0011)
    felt_part: Mapped[str | None] = mapped_column(String(32))
    felt_cause: Mapped[str | None] = mapped_column(String(32))
    felt_share: Mapped[float | None]

    # Each list order has an index ending in id, so a page is an index walk, never a sort.
    __table_args__ = (
        Index("ix_slow_queries_budget_score", "budget_score", "id"),
        Index("ix_slow_queries_created_at", "created_at", "id"),
        Index("ix_slow_queries_prompt_tokens", "prompt_tokens", "id"),
        Index("ix_slow_queries_prefill_s", "prefill_s", "id"),
        Index("ix_slow_queries_server_budget_score", "server", "budget_score", "id"),
        Index("ix_slow_queries_server_created_at", "server", "created_at", "id"),
        Index("ix_slow_queries_tenant", "tenant"),
        Index("ix_slow_queries_cause", "cause"),
    )


class TracedRequestRow(Base):
    """A request another engine reported in a trace span, scored against `estimate`."""

    __tablename__ = "traced_requests"

    id: Mapped[int] = mapped_column(primary_key=True)
    server: Mapped[str] = server_column()
    received_at: Mapped[float]
    source: Mapped[str] = mapped_column(String(256))
    request_id: Mapped[str] = mapped_column(String(256))
    started_at: Mapped[float]
    prompt_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    queue_s: Mapped[float | None]
    ttft_s: Mapped[float | None]
    prefill_s: Mapped[float | None]
    decode_s: Mapped[float | None]
    e2e_s: Mapped[float | None]
    predicted_prefill_s: Mapped[float | None]
    budget_score: Mapped[float | None]
    estimate: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (Index("ix_traced_requests_source", "source"),)


class CalibrationRunRow(Base):
    __tablename__ = "calibration_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    server: Mapped[str] = server_column()
    created_at: Mapped[float]
    model: Mapped[str] = mapped_column(Text)
    device: Mapped[str] = mapped_column(String(64))
    info: Mapped[dict[str, Any]]
    params: Mapped[dict[str, Any]]
    reason: Mapped[str] = mapped_column(Text, default="", server_default="")
    table: Mapped[list[BudgetTableRow]] = relationship(
        back_populates="run", cascade="all, delete-orphan", passive_deletes=True
    )

    __table_args__ = (Index("ix_calibration_runs_model_device", "model", "device"),)


class BudgetTableRow(Base):
    """One measured point of a calibration: prefill of `tokens` on top of `context_tokens`."""

    __tablename__ = "budget_tables"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(
        ForeignKey("calibration_runs.id", ondelete="CASCADE"), index=True
    )
    tokens: Mapped[int]
    context_tokens: Mapped[int]
    seconds: Mapped[float]
    run: Mapped[CalibrationRunRow] = relationship(back_populates="table")


class DriftEventRow(Base):
    __tablename__ = "drift_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    server: Mapped[str] = server_column()
    created_at: Mapped[float]
    deviation: Mapped[float]
    detail: Mapped[str] = mapped_column(Text)

    __table_args__ = (Index("ix_drift_events_server", "server", "id"),)


class ConfigChangeRow(Base):

    __tablename__ = "config_changes"

    id: Mapped[int] = mapped_column(primary_key=True)
    server: Mapped[str] = server_column()
    created_at: Mapped[float]
    field: Mapped[str] = mapped_column(String(128))
    old: Mapped[Any] = mapped_column(JSON, nullable=True)
    new: Mapped[Any] = mapped_column(JSON, nullable=True)
    source: Mapped[str] = mapped_column(String(64))


class PauseRow(Base):
    """The operator paused the engine's stepping, or resumed it."""

    __tablename__ = "pauses"

    id: Mapped[int] = mapped_column(primary_key=True)
    server: Mapped[str] = server_column()
    created_at: Mapped[float]
    paused: Mapped[bool]

    __table_args__ = (Index("ix_pauses_created_at", "created_at"),)


class SessionStartRow(Base):
    """A process started the engine on this store: after the first, each is a restart of
    the whole process, which a long history marks beside the engine's own restarts."""

    __tablename__ = "session_starts"

    id: Mapped[int] = mapped_column(primary_key=True)
    server: Mapped[str] = server_column()
    created_at: Mapped[float]
    orphans: Mapped[int]

    __table_args__ = (Index("ix_session_starts_created_at", "created_at"),)


class EngineFaultRow(Base):
    """An exception in the step loop that was no request's own fault, and the restart it caused."""

    __tablename__ = "engine_faults"

    id: Mapped[int] = mapped_column(primary_key=True)
    server: Mapped[str] = server_column()
    created_at: Mapped[float]
    restarts: Mapped[int]
    place: Mapped[str] = mapped_column(Text)
    error: Mapped[str] = mapped_column(Text)
    traceback: Mapped[str] = mapped_column(Text)
    stopped: Mapped[bool]
    resumed: Mapped[int]
    failed: Mapped[int]

    __table_args__ = (Index("ix_engine_faults_server", "server", "id"),)
