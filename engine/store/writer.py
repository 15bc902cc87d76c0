"""StoreWriter: engine events into the store on a thread of its own, off the hot path."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, StatementError

from engine.clock import Clock
from engine.errors import EngineError
from engine.events import Event, EventBus, wall_offset
from engine.store.batch import Batch, fold, prefilling, to_statements
from engine.store.database import Database, StoreError
from engine.store.lock import StoreLockedError
from engine.store.models import TERMINAL_STATES
from engine.store.retention import RetentionLimits, apply_retention
from engine.store.server_lock import ServerNameLost

log = logging.getLogger(__name__)

_STOP = object()
# Queued by `served` when an answer goes out before its events are stored: everything queued
# before it was promised to a client.
_PROMISED = object()
_RETRY_S = (0.05, 0.2, 1.0)
# How long, and how many events, a server keeps serving from memory while its store cannot be
# reached (refused or reset connections); past either the writer stops, as on any failure.
MAX_OUTAGE_S = 600.0
MAX_HELD_EVENTS = 1_000_000
# SQLite result codes (primary) that say one row is wrong, not the database.
_ROW_ERRORS = ("SQLITE_CONSTRAINT", "SQLITE_TOOBIG", "SQLITE_MISMATCH", "SQLITE_RANGE")
# PostgreSQL SQLSTATE classes that are one row's fault; other errors are retried or permanent.
_PG_ROW_CLASSES = ("22", "23")
_PG_BUSY = ("40001", "40P01", "55P03", "57P01", "57P02", "57P03")


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)
    # told (on the writer's thread) whether the writer still runs, as `done` is set
    then: Callable[[bool], None] | None = None

    def settle(self, running: bool) -> None:
        self.done.set()
        if self.then is not None:
            try:
                self.then(running)
            except Exception:  # a waiter gone (its event loop closed) must not stop the journal
                log.exception("a wait for the journal could not be told it was committed")


@dataclass(frozen=True)
class SkippedRow:
    """A row the database refused on its own (the rest of its batch was written)."""

    table: str
    request_id: str | None
    reason: str


@dataclass(frozen=True)
class WriterHealth:
    """What /health and the console say about the journal: "ok", "unreachable" (retrying,
    serving from memory) or "stopped"."""

    state: str
    since_s: float | None = None  # how long it has been unreachable (or catching up since)
    held_events: int = 0  # events waiting in memory for the store
    error: str | None = None
    unrecorded: int = 0  # answered requests whose outcome could not be stored (said, not hidden)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Commit:
    """What one committed batch journaled, told to `on_commit` once it is on disk."""

    events: int
    prefilling: tuple[str, ...]


def report_commit(commit: Commit) -> None:
    """An `on_commit` that prints each commit as one JSON line (`--report-commits`)."""
    print(json.dumps({"commit": dataclasses.asdict(commit)}), flush=True)


class _Permanent(Exception):
    """Wraps the error that stops the writer: retrying cannot help."""


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
        on_commit: Callable[[Commit], None] | None = None,
        clock: Clock = time.monotonic,
        max_outage_s: float = MAX_OUTAGE_S,
        max_held_events: int = MAX_HELD_EVENTS,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if batch_size < 1 or batch_window_s < 0 or retention_interval_s <= 0:
            raise EngineError(
                "StoreWriter needs batch_size >= 1, batch_window_s >= 0 and "
                f"retention_interval_s > 0; got {batch_size}, {batch_window_s}, "
                f"{retention_interval_s}"
            )
        database.claim_writer()
        self.database = database
        self.on_commit = on_commit
        self.batch_size = batch_size
        self.batch_window_s = batch_window_s
        self.retention = retention or RetentionLimits()
        self.retention_interval_s = retention_interval_s
        self.clock = clock
        self.sleep = sleep
        self.max_outage_s = max_outage_s
        self.max_held_events = max_held_events
        # the clock's time of the first refusal; cleared once what was answered from memory
        # meanwhile is on disk, not at the first commit after it
        self.unreachable_since: float | None = None
        self._reconnected = False  # the store answers again; the backlog is being written
        self.unrecorded = 0
        self._promises = 0  # _PROMISED markers queued (not events: held_events leaves them out)
        self._promise_lock = threading.Lock()
        self.written = 0
        self.dropped = 0
        self.skipped: list[SkippedRow] = []
        self.failure: StoreError | None = None
        self._on_failure: list[Callable[[StoreError], None]] = []
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

    def served(self, timeout: float | None = None) -> bool:
        """`when_served`, waited for on this thread; False on timeout."""
        heard: list[bool] = []
        done = threading.Event()

        def then(answerable: bool) -> None:
            heard.append(answerable)
            done.set()

        self.when_served(then)
        return done.wait(timeout) and heard[0]

    def when_served(self, then: Callable[[bool], None]) -> None:
        """`flush` for answering clients, without a waiting thread: `then(answerable)` runs
        once every event delivered before this call is committed (on the writer's thread),
        False once the writer has stopped (an answer it cannot record is not given). While
        the store is unreachable (within the bounds, said on /health) the events are held in
        memory and `then` runs here at once. Nothing runs it if the writer has closed."""
        if self._promised():
            then(self.failure is None)
            return
        self._queue.put(_Flush(then=then))  # settled with whether the writer still runs
        self._wake.set()

    def _promised(self) -> bool:
        """While the store is unreachable and the writer runs, promise the events queued so
        far (they are written once it is back) instead of waiting for them."""
        if self.unreachable_since is None or self.failure is not None:
            return False
        with self._promise_lock:
            self._promises += 1
        self._queue.put(_PROMISED)
        return True

    def health(self) -> WriterHealth:
        since = self.unreachable_since
        if self.failure is not None:
            return WriterHealth("stopped", error=str(self.failure), unrecorded=self.unrecorded)
        if since is None:
            return WriterHealth("ok")
        held = max(0, self._queue.qsize() - self._promises)
        if self._reconnected:
            error = f"reachable again; writing the {held} events held in memory"
        else:
            error = None if self.last_error is None else _reason(self.last_error)
        return WriterHealth("unreachable", since_s=max(0.0, self.clock() - since),
                            held_events=held, error=error)

    def check(self) -> None:
        """Raise the permanent error that stopped the writer: whoever runs the engine stops too."""
        if self.failure is not None:
            raise self.failure

    def on_failure(self, callback: Callable[[StoreError], None]) -> None:
        """Call `callback` (writer's thread) when a permanent error stops the writer, or at once."""
        self._on_failure.append(callback)
        if self.failure is not None:
            callback(self.failure)

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
        next_retention = self.clock() + self.retention_interval_s
        while True:
            due = min(max(0.0, next_retention - self.clock()), self.retention_interval_s)
            items = self._collect(timeout=due)
            events = [item for item in items if isinstance(item, Event)]
            with self._promise_lock:
                self._promises -= sum(item is _PROMISED for item in items)
            stopped = self.failure is not None
            written = False
            if events and not stopped:
                written = self._write_events(events)
            elif events:
                self.dropped += len(events)
            if self.clock() >= next_retention:
                if self.failure is None:
                    self._guarded(lambda: self._until_done(
                        lambda conn: apply_retention(conn, self.retention)))
                next_retention = self.clock() + self.retention_interval_s
            if self.failure is None and self._reconnected and len(items) < self.batch_size:
                # the backlog answered from memory is on disk (this batch emptied the queue):
                # answers wait for commits again
                self.unreachable_since, self._reconnected = None, False
            elif self.failure is not None and not stopped and isinstance(self.last_error,
                                                                          ServerNameLost):
                self._last_will([] if written else items)
            for item in items:
                if isinstance(item, _Flush):
                    item.settle(self.failure is None)
            if _STOP in items:
                return

    def _collect(self, timeout: float) -> list[object]:
        """The next batch: wait for one item, sleep through the window, take what is there."""
        try:
            items = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        # A longer window folds more tokens per UPDATE; a crash loses at most one window.
        if isinstance(items[0], Event) and self._queue.qsize() < self.batch_size:
            self._wake.wait(self.batch_window_s)
        self._wake.clear()
        get = self._queue.get_nowait
        while len(items) < self.batch_size:
            try:
                items.append(get())
            except queue.Empty:
                break
        return items

    def _write_events(self, events: list[Event]) -> bool:
        batch = fold(events, wall_offset=wall_offset(), server=self.database.server)
        statements = to_statements(batch)

        def whole_batch(connection: Connection) -> None:
            for execute, rows, _table, _key in statements:
                execute(connection, rows)

        def row_by_row() -> None:
            for execute, rows, table, key in statements:
                for row in rows:
                    reason = self._until_done(lambda c, row=row, ex=execute: ex(c, [row]))
                    if reason is not None:
                        self._skip(table, None if key is None else row[key], reason)

        written = self._guarded(lambda: self._until_done(whole_batch) is None or row_by_row())
        if written:
            self.written += len(events)
            if self.on_commit is not None:
                try:
                    self.on_commit(Commit(len(events), prefilling(batch)))
                except Exception:  # a listener gone (a closed pipe) must not stop the journal
                    log.exception("store %s: on_commit failed; no more commits are reported",
                                  self.database.location)
                    self.on_commit = None
        else:
            self.dropped += len(events)
        return written

    def _last_will(self, items: list[object]) -> None:
        """The server name was taken over while answers had gone out from memory (an outage):
        record what was promised, then stop. Only requests that ended before the last promise
        are written, with this process's own observations: their ids are this process's
        alone, and a new holder's sweep closes no ended entry (one it closed first is set
        right here). Nothing else is written: the rest was never answered."""
        while True:  # `failure` is set: every answer from memory has queued its marker by now
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            items.append(item)
            if isinstance(item, _Flush):
                item.settle(False)
        promised = max((i for i, item in enumerate(items) if item is _PROMISED), default=0)
        events = [item for item in items[:promised] if isinstance(item, Event)]
        if not events:  # nothing was answered before it was stored
            return
        batch = fold(events, wall_offset=wall_offset(), server=self.database.server)
        ended = {rid for rid, p in batch.progress.items() if p.state in TERMINAL_STATES}
        kept = Batch(batch.server, [row for row in batch.added if row["request_id"] in ended],
                     {rid: p for rid, p in batch.progress.items() if rid in ended},
                     batch.slow, batch.drift, batch.config, batch.faults)
        try:
            with self.database.engine.begin() as connection:
                for execute, rows, _table, _key in to_statements(kept):
                    execute(connection, rows)
        except Exception as exc:  # said on /health and here, with the count
            self.unrecorded = len(ended)
            log.error("store %s: the outcomes of %d requests answered from memory could not "
                      "be recorded after the server name was lost: %s",
                      self.database.location, len(ended), _reason(exc))
            return
        self.written += len(events)
        log.warning("store %s: recorded the outcomes of %d requests answered from memory "
                    "before stopping", self.database.location, len(ended))

    def _skip(self, table: str, request_id: str | None, reason: str) -> None:
        self.skipped.append(SkippedRow(table, request_id, reason))
        log.error("store %s skipped a %s row%s: %s", self.database.location, table,
                  f" of request {request_id!r}" if request_id else "", reason)

    def _guarded(self, work: Callable[[], object]) -> bool:
        """Run `work`; a permanent error stops the writer (see `failure`). False then."""
        try:
            work()
            return True
        except _Permanent as exc:
            cause = exc.__cause__
            self.last_error = cause if isinstance(cause, Exception) else exc
            self.failure = _permanent_error(self.database, self.last_error)
            log.error("%s", self.failure)
            for callback in self._on_failure:
                callback(self.failure)
            return False

    def _until_done(self, work: Callable[[Connection], object]) -> str | None:
        """Run `work` in one transaction, retrying while busy: None once committed, else why not."""
        attempt = 0
        while True:
            try:
                with self.database.engine.begin() as connection:
                    self.database.check_writer(connection)  # the server name is still ours
                    work(connection)
                if self.unreachable_since is not None and not self._reconnected:
                    log.warning("store %s is reachable again; the events held in memory are "
                                "being written", self.database.location)
                    self._reconnected = True
                return None
            except Exception as exc:
                kind = _classify(exc)
                self.last_error = exc
                if kind == "row":
                    return _reason(exc)
                if kind == "permanent":
                    raise _Permanent from exc
                if kind == "unreachable" and attempt:
                    # twice in a row: the database, not one connection (a killed backend is
                    # retried at once); only then do answers stop waiting for commits
                    self._unreachable(exc)
                delay = _RETRY_S[min(attempt, len(_RETRY_S) - 1)]
                if attempt < len(_RETRY_S):  # then once a backoff, not once a retry
                    log.warning("store %s is %s (%s); retrying every %.2fs at most",
                                self.database.location, kind, _reason(exc), delay)
                self.sleep(delay)
                attempt += 1

    def _unreachable(self, exc: Exception) -> None:
        """Keep serving from memory within the bounds; past them, stop as on any failure."""
        now = self.clock()
        self._reconnected = False
        if self.unreachable_since is None:
            self.unreachable_since = now
        held = self._queue.qsize()
        if now - self.unreachable_since > self.max_outage_s or held > self.max_held_events:
            raise _Permanent from StoreError(
                f"the journal in {self.database.location} stopped: the store was unreachable "
                f"for {now - self.unreachable_since:.0f} s ({_reason(exc)}) with {held} events "
                f"held in memory, past the bounds of {self.max_outage_s:g} s and "
                f"{self.max_held_events} events. Nothing after this point was recorded.")


def _classify(exc: BaseException) -> str:
    """"busy" or "unreachable" (retry), "row" (this row's values) or "permanent" (stop)."""
    if isinstance(exc, StatementError) and not isinstance(exc, DBAPIError):
        exc = exc.orig or exc
    if isinstance(exc, DBAPIError):
        state = getattr(exc.orig, "sqlstate", "") or ""
        if hasattr(exc.orig, "sqlstate") and not state:
            # PostgreSQL's driver without a SQLSTATE: the connection itself failed (refused,
            # reset, closed by a restart), not a statement
            return "unreachable"
        if state or exc.connection_invalidated:
            if exc.connection_invalidated or state.startswith("08") or state in (
                    "57P01", "57P02", "57P03"):  # shut down, crashed, starting up
                return "unreachable"
            if state in _PG_BUSY:
                return "busy"
            return "row" if state[:2] in _PG_ROW_CLASSES else "permanent"
        name = getattr(exc.orig, "sqlite_errorname", "")
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
            return "busy"
        if name.startswith(_ROW_ERRORS) or "Error binding parameter" in str(exc.orig):
            return "row"
        return "permanent"
    if isinstance(exc, OverflowError | ValueError | TypeError):
        return "row"
    return "permanent"


def _reason(exc: BaseException) -> str:
    return str(exc.orig) if isinstance(exc, DBAPIError) else f"{type(exc).__name__}: {exc}"


def _permanent_error(database: Database, exc: BaseException) -> StoreError:
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, StoreLockedError):  # the server name was taken over
        return StoreError(str(exc))
    message = _reason(exc)
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    name = getattr(orig, "sqlite_errorname", "")
    if name.startswith("SQLITE_FULL") or getattr(orig, "errno", None) == errno.ENOSPC:
        fix = "free space on its disk, then finish the run with --resume"
    elif ("no such table" in message or "no such column" in message
          or "has no column" in message or getattr(orig, "sqlstate", "") in ("42P01", "42703")):
        fix = ("its schema is missing tables or columns: run `tokenflow db upgrade --db "
               f"{database.location}`, or pass --db PATH to use another file")
    elif name.startswith("SQLITE_READONLY"):
        fix = "it became read-only: fix its permissions, or pass --db PATH to use another file"
    else:
        fix = "fix the database or pass --db PATH to use another file"
    return StoreError(f"the journal in {database.location} stopped: {message}; {fix}. "
                      "Nothing after this point was recorded.")
