"""StoreWriter: engine events into SQLite, off the hot path.

The bus subscriber is `SimpleQueue.put` itself: O(1), never blocks, nothing to run on the
engine thread. A daemon thread drains the queue in batches (what arrived within
`batch_window_s` of the first event, at most `batch_size`) and writes each batch in one
transaction. The queue is unbounded, so under load events wait in memory rather than being
dropped; a locked or full database is retried until it accepts the batch.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
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
from sqlalchemy.dialects import sqlite
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import OperationalError

from engine.errors import EngineError
from engine.events import (
    ChunkComplete,
    ConfigChanged,
    Drift,
    Event,
    EventBus,
    Failed,
    Finished,
    Preempted,
    Rejected,
    RequestAdded,
    SlowQuery,
    TokensGenerated,
)
from engine.store.database import Database
from engine.store.models import (
    TERMINAL_STATES,
    ConfigChangeRow,
    DriftEventRow,
    JournalRow,
    SlowQueryRow,
)
from engine.store.retention import RetentionLimits, apply_retention

log = logging.getLogger(__name__)

_JOURNAL = JournalRow.__table__
_STOP = object()
_RETRY_S = (0.05, 0.2, 1.0)  # back-off while the database refuses a batch
# Folding thousands of events holds the GIL for milliseconds; an engine thread coming back
# from a forward pass would wait that long for it (Python only forces a hand-over after its
# 5 ms switch interval). Yielding every few hundred events bounds that wait to ~0.1 ms.
_FOLD_SLICE = 256


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


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
        if self.state not in TERMINAL_STATES:  # a late event never reopens a finished request
            self.state = state


@dataclass
class _Batch:
    added: list[dict[str, Any]] = field(default_factory=list)
    progress: dict[str, _Progress] = field(default_factory=dict)
    slow: list[dict[str, Any]] = field(default_factory=list)
    drift: list[dict[str, Any]] = field(default_factory=list)
    config: list[dict[str, Any]] = field(default_factory=list)


class StoreWriter:
    def __init__(
        self,
        database: Database,
        bus: EventBus,
        *,
        batch_size: int = 5000,
        batch_window_s: float = 0.2,
        retention: RetentionLimits | None = None,
        retention_interval_s: float = 60.0,
    ) -> None:
        if batch_size < 1 or batch_window_s < 0 or retention_interval_s <= 0:
            raise EngineError(
                "StoreWriter needs batch_size >= 1, batch_window_s >= 0 and "
                f"retention_interval_s > 0; got {batch_size}, {batch_window_s}, "
                f"{retention_interval_s}"
            )
        self.database = database
        self.batch_size = batch_size
        self.batch_window_s = batch_window_s
        self.retention = retention or RetentionLimits()
        self.retention_interval_s = retention_interval_s
        self.written = 0  # events handled (stored or deliberately ignored)
        self.dropped = 0  # events of batches that failed for a reason other than the database
        self.last_error: Exception | None = None
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._unsubscribe: Callable[[], None] | None = bus.subscribe(self._queue.put)
        self._thread = threading.Thread(target=self._run, name="tokenflow-store", daemon=True)
        self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event delivered before this call is committed; False on timeout."""
        marker = _Flush()
        self._queue.put(marker)
        self._wake.set()
        return marker.done.wait(timeout)

    def close(self, timeout: float | None = 10.0) -> bool:
        """Stop listening, write what is queued, stop the thread; False if it did not finish."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
            self._queue.put(_STOP)
            self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # --- writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        next_retention = time.monotonic() + self.retention_interval_s
        while True:
            items = self._collect(timeout=max(0.0, next_retention - time.monotonic()))
            events = [item for item in items if isinstance(item, Event)]
            if events and self._write_until_done(lambda c, events=events: self._write(c, events)):
                self.written += len(events)
            elif events:
                self.dropped += len(events)
            if time.monotonic() >= next_retention:
                self._write_until_done(lambda conn: apply_retention(conn, self.retention))
                next_retention = time.monotonic() + self.retention_interval_s
            for item in items:
                if isinstance(item, _Flush):
                    item.done.set()
            if _STOP in items:
                return

    def _collect(self, timeout: float) -> list[object]:
        """The next batch: wait for one item, let the window fill, take what is there.

        Sleeping through the window (rather than waking per event) keeps the writer off the
        GIL while the engine runs: about one wake-up per window, whatever the event rate.
        """
        try:
            items = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        # A longer window folds more of each request's tokens into one UPDATE (a 0.2 s window
        # costs about half the CPU per event of a 0.05 s one at 256 requests in flight);
        # a crash loses at most one window of journal progress.
        if isinstance(items[0], Event) and self._queue.qsize() < self.batch_size:
            self._wake.wait(self.batch_window_s)  # flush() and close() cut the window short
        self._wake.clear()
        get = self._queue.get_nowait
        while len(items) < self.batch_size:
            try:
                items.append(get())
            except queue.Empty:
                break
        return items

    def _write_until_done(self, work: Callable[[Connection], object]) -> bool:
        """Retry while the database is busy or full; False only if the work itself is wrong."""
        attempt = 0
        while True:
            try:
                with self.database.engine.begin() as connection:
                    work(connection)
                return True
            except OperationalError as exc:  # locked past busy_timeout, disk full: wait, retry
                self.last_error = exc
                delay = _RETRY_S[min(attempt, len(_RETRY_S) - 1)]
                log.warning("store %s refused a batch (%s); retrying in %.2fs",
                            self.database.path, exc.orig, delay)
                time.sleep(delay)
                attempt += 1
            except Exception as exc:  # a bug, not the database: keep the thread (and flush) alive
                self.last_error = exc
                log.exception("store %s could not write a batch", self.database.path)
                return False

    def _write(self, connection: Connection, events: list[Event]) -> None:
        batch = _fold(events, wall_offset=time.time() - time.monotonic())
        if batch.added:
            connection.exec_driver_sql(_UPSERT_JOURNAL, batch.added)
        if batch.progress:
            now = time.time()
            connection.exec_driver_sql(
                _UPDATE_JOURNAL,
                [_progress_params(rid, p, now) for rid, p in batch.progress.items()],
            )
        if batch.slow:
            connection.execute(insert(SlowQueryRow), batch.slow)
        if batch.drift:
            connection.execute(insert(DriftEventRow), batch.drift)
        if batch.config:
            connection.execute(insert(ConfigChangeRow), batch.config)


def _fold(events: list[Event], wall_offset: float) -> _Batch:
    batch = _Batch()
    progress = batch.progress
    for index, event in enumerate(events):
        if index % _FOLD_SLICE == _FOLD_SLICE - 1:
            time.sleep(0)  # hand the GIL back: see _FOLD_SLICE
        kind = type(event)
        if kind is TokensGenerated:  # most events are these: kept to a few attribute writes
            p = progress.get(event.request_id)
            if p is None:
                p = progress[event.request_id] = _Progress()
            if p.first_token_at is None:
                p.first_token_at = event.ts + wall_offset
            p.tokens += event.token_ids
            if p.state not in TERMINAL_STATES:
                p.state = "DECODING"
        elif kind is ChunkComplete:
            p = progress.setdefault(event.request_id, _Progress())
            p.chunks += 1
            p.prefilled = event.start + event.tokens
            p.set_state("DECODING" if event.prefill_done else "PREFILL_CHUNKING")
        elif kind is RequestAdded:
            progress.pop(event.request_id, None)  # the new row replaces whatever came before
            batch.added.append(_added_row(event, event.ts + wall_offset))
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
            batch.slow.append(_slow_row(event, event.ts + wall_offset))
        elif kind is Drift:
            batch.drift.append(
                {"created_at": event.ts + wall_offset, "deviation": event.deviation,
                 "detail": event.detail}
            )
        elif kind is ConfigChanged:
            batch.config.extend(
                {"created_at": event.ts + wall_offset, "field": name, "old": old, "new": new,
                 "source": event.source}
                for name, (old, new) in event.changes.items()
            )
    return batch


def _added_row(event: RequestAdded, at: float) -> dict[str, Any]:
    return {
        "request_id": event.request_id, "tenant": event.tenant, "priority": event.priority,
        "tag": event.tag, "prompt_token_ids": ",".join(map(str, event.prompt_token_ids)),
        "sampling": json.dumps(event.sampling), "state": "WAITING", "prefilled_tokens": 0,
        "chunks_done": 0, "preemptions": 0,
        "generated_token_ids": ",".join(map(str, event.generated_token_ids)),
        "generated_tokens": len(event.generated_token_ids), "finish_reason": None,
        "added_at": at, "first_token_at": None,
        "finished_at": None, "ttft_s": None, "e2e_s": None, "budget_score": None,
        "updated_at": at, "resumed_at": None,
    }


def _slow_row(event: SlowQuery, at: float) -> dict[str, Any]:
    return {
        "created_at": at, "request_id": event.request_id, "tenant": event.tenant,
        "tag": event.tag, "budget_score": event.budget_score,
        "prompt_tokens": event.prompt_tokens, "prefill_s": event.prefill_s,
        "budgeted_s": event.budgeted_s, "chunks": list(event.chunks), "config": event.config,
        "timeline": event.timeline or None, "cause": event.cause,
        "cause_share": event.cause_share, "verdict": event.verdict or None,
    }


def _progress_params(request_id: str, p: _Progress, now: float) -> dict[str, Any]:
    return {
        "b_request_id": request_id, "b_state": p.state, "b_prefilled": p.prefilled,
        "b_chunks": p.chunks, "b_preemptions": p.preemptions,
        "b_tokens": ",".join(map(str, p.tokens)), "b_token_count": len(p.tokens),
        "b_first_token_at": p.first_token_at, "b_finish_reason": p.finish_reason,
        "b_finished_at": p.finished_at, "b_ttft_s": p.ttft_s, "b_e2e_s": p.e2e_s,
        "b_budget_score": p.budget_score, "b_now": now,
    }


def _driver_sql(statement: Any) -> str:
    """SQL text with :name parameters that sqlite3 binds from each row's dict by itself.

    The journal sees most of the traffic, so its rows skip SQLAlchemy's per-row parameter
    processing; their values are therefore plain str/int/float (token ids and JSON as text).
    """
    return str(statement.compile(dialect=sqlite.dialect(paramstyle="named")))


def _build_upsert() -> str:
    columns = [c.name for c in _JOURNAL.c if c.name != "id"]
    statement = sqlite_insert(_JOURNAL).values({name: bindparam(name) for name in columns})
    replaced = {name: statement.excluded[name] for name in columns}
    return _driver_sql(
        statement.on_conflict_do_update(index_elements=["request_id"], set_=replaced)
    )


def _build_update() -> str:
    c = _JOURNAL.c
    tokens = bindparam("b_tokens", type_=Text)
    stored = type_coerce(c.generated_token_ids, Text)  # the raw "1,2,3" text, not list[int]
    # Constants are inlined so every row of an executemany binds only its own values.
    terminal = [literal_column(f"'{state}'") for state in TERMINAL_STATES]
    empty, comma = literal_column("''"), literal_column("','")
    return _driver_sql(
        update(_JOURNAL)
        .where(c.request_id == bindparam("b_request_id"))
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


_UPSERT_JOURNAL = _build_upsert()
_UPDATE_JOURNAL = _build_update()
