"""The store: migrations, PRAGMAs, the writer, the journal, retention, bad files.

Tests taking `database` run on both stores, a SQLite file and a PostgreSQL database (the
`store_url` fixture); those about files, PRAGMAs and SQLite's own limits on SQLite alone."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import event as sa_event
from sqlalchemy import func, inspect, select, text

from console.cli.main import main
from engine.events import (
    ChunkComplete,
    ConfigChanged,
    Drift,
    EventBus,
    FailCause,
    Failed,
    Finished,
    Preempted,
    RequestAdded,
    SlowQuery,
    TokensGenerated,
)
from engine.store import (
    BudgetPoint,
    RetentionLimits,
    StoreError,
    StoreLockedError,
    StoreWriter,
    apply_retention,
    calibration_history,
    claim_for_resume,
    config_changes,
    drift_events,
    head_revision,
    latest_calibration,
    list_slow_queries,
    next_cycle,
    open_database,
    save_calibration,
    unfinished_requests,
)
from engine.store.database import Database, downgrade_database, shown_url, upgrade_database
from engine.store.database import store_url as store_url_of
from engine.store.lock import LockFileError
from engine.store.models import Base, BudgetTableRow, JournalRow, SlowQueryRow
from tests.mounts import remount, tmpfs
from tests.postgres import Cluster
from tests.stores import damaged_store


@pytest.fixture
def database(store_url: str) -> Database:
    db = open_database(store_url)
    yield db
    db.close()


def sqlite_only(database: Database) -> None:
    if database.shared:
        pytest.skip("about SQLite's own files, PRAGMAs or limits")


def added(rid: str, prompt: tuple[int, ...] = (1, 2, 3, 4), tenant: str = "t") -> RequestAdded:
    return RequestAdded(request_id=rid, prompt_token_ids=prompt, sampling={"max_tokens": 8},
                        tenant=tenant, priority=1, tag="doc")


def chunk(rid: str, index: int, start: int, tokens: int, done: bool) -> ChunkComplete:
    return ChunkComplete(request_id=rid, chunk_index=index, tokens=tokens, start=start,
                         duration_s=0.01, estimated_bytes=1e6, predicted_s=0.01,
                         prefill_done=done)


def finished(rid: str) -> Finished:
    return Finished(request_id=rid, reason="length", prompt_tokens=4, generated_tokens=2,
                    ttft_s=0.05, e2e_s=0.2, budget_score=1.1)


def deliver(bus: EventBus, writer: StoreWriter, *events: object) -> None:
    for event in events:
        bus.publish(event)
    bus.drain()
    assert writer.flush(timeout=10)


def journal_row(db: Database, rid: str) -> JournalRow:
    with db.session() as session:
        return session.scalars(select(JournalRow).where(JournalRow.request_id == rid)).one()


# --- schema ------------------------------------------------------------------------------


def test_migrations_from_empty_to_head_and_back(store_url: str) -> None:
    db = open_database(store_url)
    try:
        assert db.revision() == head_revision()
        tables = set(inspect(db.engine).get_table_names())
        assert set(Base.metadata.tables) <= tables
        with db.engine.connect() as connection:  # the hand-written revision matches the models
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []

        downgrade_database(db, "base")
        assert db.revision() is None
        assert set(inspect(db.engine).get_table_names()) <= {"alembic_version"}

        upgrade_database(db)
        assert db.revision() == head_revision()
        assert set(Base.metadata.tables) <= set(inspect(db.engine).get_table_names())
    finally:
        db.close()


def test_pragmas_hold_on_every_connection(database: Database) -> None:
    sqlite_only(database)
    connections = [database.engine.raw_connection() for _ in range(3)]  # three distinct ones
    try:
        for connection in connections:
            cursor = connection.cursor()
            assert cursor.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert cursor.execute("PRAGMA foreign_keys").fetchone()[0] == 1
            assert cursor.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    finally:
        for connection in connections:
            connection.close()


def test_default_path_lives_in_the_user_data_dir(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    db = open_database()
    try:
        assert db.path == tmp_path / "xdg" / "tokenflow" / "tokenflow.db"
        assert db.path.exists()
    finally:
        db.close()


# --- bad files: a clear error naming the file and the fix, the file untouched --------------


def test_corrupt_file_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.db"
    content = b"this is not sqlite\n" * 100
    path.write_bytes(content)
    before = path.stat().st_mtime_ns
    with pytest.raises(StoreError) as caught:
        open_database(path)
    assert str(path) in str(caught.value)
    assert "mv " in str(caught.value) and "--db" in str(caught.value)
    assert path.read_bytes() == content and path.stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.db"]


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    open_database(path).close()
    db = open_database(path, upgrade=False)
    with db.engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999_future'"))
    db.close()
    with pytest.raises(StoreError) as caught:
        open_database(path)
    message = str(caught.value)
    assert str(path) in message and "9999_future" in message and "newer" in message
    with contextlib.closing(sqlite3.connect(path)) as connection:  # the file kept its stamp
        stamp = connection.execute("SELECT version_num FROM alembic_version").fetchone()[0]
    assert stamp == "9999_future"


def _open_without_privileges(path: Path) -> str:
    """Try open_database in a forked child; returns the StoreError message ("" if it opened)."""
    def attempt() -> str:
        try:
            open_database(path).close()
        except StoreError as exc:
            return str(exc)
        return ""
    return without_privileges(attempt)


def without_privileges(work: Callable[[], str]) -> str:
    """`work()` in a forked child without privileges; returns what it returned.

    Root ignores permission bits, so a root child first drops to `nobody`. Forking (no exec)
    keeps the already-imported interpreter, which `nobody` could not load from /root.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            os.write(write_end, work().encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        message = pipe.read()
    os.waitpid(pid, 0)
    return message


@pytest.fixture
def shared_dir() -> Path:
    # pytest's tmp_path is private to its owner; the unprivileged child needs to enter this one.
    directory = Path(tempfile.mkdtemp(prefix="tokenflow-store-"))
    directory.chmod(0o755)
    yield directory
    for path in sorted(directory.rglob("*"), reverse=True):
        path.chmod(0o700)
        path.unlink() if path.is_file() else path.rmdir()
    directory.rmdir()


def test_read_only_directory_is_refused(shared_dir: Path) -> None:
    read_only = shared_dir / "ro"
    read_only.mkdir(mode=0o555)
    read_only.chmod(0o555)
    message = _open_without_privileges(read_only / "store.db")
    assert str(read_only / "store.db") in message and "--db" in message
    assert list(read_only.iterdir()) == []


def test_read_only_file_is_refused_and_left_untouched(shared_dir: Path) -> None:
    path = shared_dir / "store.db"
    open_database(path).close()
    path.chmod(0o444)
    content = path.read_bytes()
    message = _open_without_privileges(path)
    assert str(path) in message and "chmod" in message
    assert path.read_bytes() == content


# --- writer and journal ------------------------------------------------------------------


def test_journal_follows_every_chunk_and_token(database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus)
    try:
        deliver(bus, writer, added("r1"))
        row = journal_row(database, "r1")
        assert (row.state, row.prefilled_tokens, row.prompt_token_ids) == ("WAITING", 0,
                                                                          [1, 2, 3, 4])
        deliver(bus, writer, chunk("r1", 0, start=0, tokens=2, done=False))
        row = journal_row(database, "r1")
        assert (row.state, row.prefilled_tokens, row.chunks_done) == ("PREFILL_CHUNKING", 2, 1)
        deliver(bus, writer, chunk("r1", 1, start=2, tokens=2, done=True),
                TokensGenerated(request_ids=("r1",), token_ids=(9,)))
        row = journal_row(database, "r1")
        assert (row.state, row.prefilled_tokens, row.chunks_done) == ("DECODING", 4, 2)
        assert row.generated_token_ids == [9] and row.first_token_at is not None
        deliver(bus, writer, Preempted(request_id="r1", reason="cache", tokens_discarded=5))
        row = journal_row(database, "r1")
        assert (row.state, row.prefilled_tokens, row.preemptions) == ("PREEMPTED", 0, 1)
        deliver(bus, writer, chunk("r1", 2, start=0, tokens=5, done=True),
                TokensGenerated(request_ids=("r1",), token_ids=(8,)), finished("r1"),
                TokensGenerated(request_ids=("r1",), token_ids=(7,)))
        row = journal_row(database, "r1")
        assert row.state == "FINISHED" and row.finish_reason == "length"
        assert row.generated_token_ids == [9, 8, 7] and row.generated_tokens == 3
        assert (row.ttft_s, row.e2e_s, row.budget_score) == (0.05, 0.2, 1.1)
    finally:
        assert writer.close()


def test_no_event_lost_under_a_burst_from_several_threads(database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus, batch_size=256)
    threads, requests_per_thread, tokens_per_request = 4, 50, 40

    def produce(thread: int) -> None:
        for r in range(requests_per_thread):
            rid = f"{thread}-{r}"
            bus.publish(added(rid))
            for token in range(tokens_per_request):
                bus.publish(TokensGenerated(request_ids=(rid,), token_ids=(token,)))
            bus.publish(SlowQuery(request_id=rid, tenant="t", budget_score=2.0, prompt_tokens=4,
                                  prefill_s=0.2, budgeted_s=0.1, chunks=(), config={}))

    producers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    for producer in producers:
        producer.start()
    delivered = 0
    while any(p.is_alive() for p in producers):
        delivered += bus.drain()  # the engine thread keeps stepping meanwhile
    for producer in producers:
        producer.join()
    delivered += bus.drain()
    assert writer.flush(timeout=30)
    total = threads * requests_per_thread
    assert delivered == total * (tokens_per_request + 2)
    with database.session() as session:
        rows = session.scalars(select(JournalRow)).all()
        assert len(rows) == total
        assert all(r.generated_token_ids == list(range(tokens_per_request)) for r in rows)
        assert session.scalar(select(func.count()).select_from(SlowQueryRow)) == total
    assert writer.close()


def test_an_answer_hears_its_commit_from_the_writer_and_a_failing_listener_stops_nothing(
        database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus)
    heard: list[tuple[bool, str]] = []
    committed = threading.Event()

    def listener(answerable: bool) -> None:
        heard.append((answerable, threading.current_thread().name))
        committed.set()

    def gone(_answerable: bool) -> None:
        raise RuntimeError("the event loop is closed")

    try:
        bus.publish(added("a"))
        bus.drain()
        writer.when_served(gone)  # a waiter whose loop closed: logged, the journal goes on
        writer.when_served(listener)
        assert committed.wait(10)  # a hang guard: the writer's thread tells it
        assert heard == [(True, "tokenflow-store")]
        assert journal_row(database, "a").state == "WAITING"
        deliver(bus, writer, finished("a"))
        assert writer.failure is None and journal_row(database, "a").state == "FINISHED"
    finally:
        assert writer.close()


def test_unfinished_requests_and_mark_resumed(database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus)
    deliver(bus, writer, added("done"), chunk("done", 0, 0, 4, True),
            TokensGenerated(request_ids=("done",), token_ids=(5,)), finished("done"),
            added("mid", prompt=(1, 2, 3, 4, 5, 6), tenant="a"),
            chunk("mid", 0, 0, 4, False),
            added("decoding"), chunk("decoding", 0, 0, 4, True),
            TokensGenerated(request_ids=("decoding", "decoding"), token_ids=(11, 12)),
            added("waiting"))
    assert writer.close()
    with database.session() as session:
        entries = unfinished_requests(session)
        assert [e.request_id for e in entries] == ["mid", "decoding", "waiting"]
        mid, decoding, _ = entries
        assert mid.prompt_token_ids == [1, 2, 3, 4, 5, 6] and mid.prefilled_tokens == 4
        assert (mid.tenant, mid.priority, mid.tag, mid.sampling) == ("a", 1, "doc",
                                                                     {"max_tokens": 8})
        assert decoding.generated_token_ids == [11, 12] and decoding.state == "DECODING"
        # a claim counts an attempt and leaves the entry unfinished (a kill loses nothing)
        assert claim_for_resume(session, ["mid", "done"]) == 1
        entries = {e.request_id: e for e in unfinished_requests(session)}
        assert list(entries) == ["mid", "decoding", "waiting"]
        assert (entries["mid"].resume_attempts, entries["waiting"].resume_attempts) == (1, 0)


def test_next_cycle_numbers_replayed_traffic_past_every_journal_entry(
        database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus)
    deliver(bus, writer, *(added(rid) for rid in (
        "chat-00000-0", "chat-00000-3", "chat-00000-x", "chat-000001-9", "a_b-00000-5")))
    assert writer.close()
    with database.session() as session:
        assert next_cycle(session, "chat-00000") == 4
        assert next_cycle(session, "a_b-00000") == 6
        assert next_cycle(session, "a%b-00000") == 0  # LIKE wildcards in an id match nothing
        assert next_cycle(session, "code-00000") == 0


def test_drift_config_changes_and_calibrations(database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus)
    deliver(bus, writer, Drift(deviation=0.25, detail="decode table moved"),
            ConfigChanged(changes={"chunk_tile": (16, 32), "max_prefill_chunks": (4, 2)},
                          source="console"))
    assert writer.close()
    with database.session() as session:
        assert [(d.deviation, d.detail) for d in drift_events(session)] == [
            (0.25, "decode table moved")]
        changes = {(c.field, c.old, c.new, c.source) for c in config_changes(session)}
        assert changes == {("chunk_tile", 16, 32, "console"),
                           ("max_prefill_chunks", 4, 2, "console")}
        first = save_calibration(session, model="synthetic:tiny", device="cpu",
                                 table=[BudgetPoint(64, 0, 0.01), BudgetPoint(32, 0, 0.005)],
                                 params={"a": 1.0})
        second = save_calibration(session, model="synthetic:tiny", device="cpu",
                                  table=[BudgetPoint(64, 0, 0.02)], params={"a": 2.0},
                                  info={"steps": 3})
        save_calibration(session, model="other", device="cpu", table=[], params={})
        latest = latest_calibration(session, model="synthetic:tiny", device="cpu")
        assert latest is not None and latest.id == second and latest.params == {"a": 2.0}
        assert latest.info["steps"] == 3 and latest.table == [BudgetPoint(64, 0, 0.02)]
        assert latest.info["provenance"]["store"].startswith(("sqlite", "postgresql"))
        history = calibration_history(session, model="synthetic:tiny")
        assert [run.id for run in history] == [second, first]
        assert history[1].table == [BudgetPoint(32, 0, 0.005), BudgetPoint(64, 0, 0.01)]


def test_retention_keeps_the_newest_and_every_unfinished_request(database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus)
    events: list[object] = []
    for i in range(10):
        events += [added(f"f{i}"), finished(f"f{i}"), Drift(deviation=i, detail=""),
                   SlowQuery(request_id=f"f{i}", tenant="t", budget_score=2.0, prompt_tokens=4,
                             prefill_s=0.2, budgeted_s=0.1, chunks=(), config={})]
    events += [added("open0"), added("open1")]
    deliver(bus, writer, *events)
    assert writer.close()
    with database.session() as session:
        for i in range(5):
            save_calibration(session, model="m", device="cpu", params={},
                             table=[BudgetPoint(16, 0, 0.1 * i), BudgetPoint(32, 0, 0.2)])
    limits = RetentionLimits(journal=3, slow_queries=4, calibration_runs=2, drift_events=5,
                             config_changes=1)
    with database.engine.begin() as connection:
        assert apply_retention(connection, limits) == 7 + 6 + 3 + 5
    with database.session() as session:
        ids = session.scalars(select(JournalRow.request_id).order_by(JournalRow.id)).all()
        assert ids == ["f7", "f8", "f9", "open0", "open1"]
        assert [d.deviation for d in drift_events(session)] == [9, 8, 7, 6, 5]
        assert session.scalar(select(func.count()).select_from(SlowQueryRow)) == 4
        assert len(calibration_history(session)) == 2
        # foreign keys are on, so the deleted runs took their budget tables with them
        assert session.scalar(select(func.count()).select_from(BudgetTableRow)) == 4


def test_bad_writer_settings_are_refused(database: Database) -> None:
    with pytest.raises(Exception, match="retention_interval_s"):
        StoreWriter(database, EventBus(), retention_interval_s=0)


# --- one writer per store -------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_holder_and_readers_are_not(
        tmp_path: Path) -> None:
    path = tmp_path / "one.db"
    first, second = open_database(path), open_database(path)
    try:
        StoreWriter(first, EventBus()).close()  # the writer claims the store...
        with pytest.raises(StoreLockedError) as caught:
            second.claim_writer()  # ...until its database is closed
        message = str(caught.value)
        assert f"pid {os.getpid()}" in message and str(path) in message and "--db" in message
        reader = open_database(path, read_only=True)  # readers never take the lock
        with reader.session() as session:
            assert unfinished_requests(session) == []
        reader.close()
        first.close()
        second.claim_writer()  # released with its holder
    finally:
        first.close()
        second.close()


# --- a journal that never lies --------------------------------------------------------------


def test_one_bad_row_is_skipped_with_its_reason_and_its_batch_is_written(
        database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus)
    events: list[object] = [added(f"r{i}") for i in range(50)]
    events.insert(25, RequestAdded(request_id="huge", prompt_token_ids=(1, 2), sampling={},
                                   tenant="t", priority=10**23))  # past SQLite's integer
    events.append(TokensGenerated(request_ids=("r3", "huge"), token_ids=(7, 7)))
    deliver(bus, writer, *events)
    assert writer.failure is None
    with database.session() as session:
        ids = set(session.scalars(select(JournalRow.request_id)))
    assert ids == {f"r{i}" for i in range(50)}
    assert journal_row(database, "r3").generated_token_ids == [7]
    (skipped,) = writer.skipped
    assert (skipped.table, skipped.request_id) == ("request_journal", "huge")
    assert "too large" in skipped.reason or "out of range" in skipped.reason  # SQLite, PG
    assert writer.close()


def test_a_missing_table_stops_the_writer_with_a_clear_error(database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus)
    with database.engine.begin() as connection:
        connection.execute(text("DROP TABLE request_journal"))
    deliver(bus, writer, added("r1"), added("r2"))  # flush returns: nothing retries forever
    with pytest.raises(StoreError, match="tokenflow db upgrade") as caught:
        writer.check()
    message = str(caught.value)
    assert "no such table" in message or "does not exist" in message  # SQLite, PostgreSQL
    assert database.location in message
    deliver(bus, writer, added("r3"))
    assert writer.dropped == 3 and writer.close()


def test_a_full_database_stops_the_writer(database: Database) -> None:
    sqlite_only(database)
    bus = EventBus()
    writer = StoreWriter(database, bus)
    deliver(bus, writer, added("r0"))
    with database.engine.connect() as connection:
        pages = connection.exec_driver_sql("PRAGMA page_count").scalar()
    # SQLite's own ceiling on the file's size: the "database or disk is full" of a full disk
    sa_event.listen(database.engine, "connect",
                 lambda dbapi, _record: dbapi.execute(f"PRAGMA max_page_count={pages}"))
    database.engine.dispose()
    deliver(bus, writer, *(added(f"r{i}", prompt=tuple(range(2000))) for i in range(1, 40)))
    with pytest.raises(StoreError, match="free space") as caught:
        writer.check()
    assert "full" in str(caught.value)
    assert writer.close()


def test_a_failed_request_is_never_unfinished_again(database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus)
    deliver(bus, writer, added("poison"), chunk("poison", 0, 0, 4, True),
            Failed(request_id="poison", reason="sampling produced NaN", cause=FailCause.FAULT),
            added("ok"))
    assert writer.close()
    with database.session() as session:
        assert [e.request_id for e in unfinished_requests(session)] == ["ok"]
    assert journal_row(database, "poison").state == "FAILED"


def test_resume_attempts_carry_over_a_re_add_and_reset_for_a_new_request(
        database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus)
    deliver(bus, writer, added("r1"), added("r2"), finished("r2"))
    with database.session() as session:
        assert claim_for_resume(session, ["r1", "r2"]) == 1  # r2 ended: not claimed
    deliver(bus, writer, added("r1"), added("r2"))  # r1 resumed; r2's id used anew
    assert journal_row(database, "r1").resume_attempts == 1
    assert journal_row(database, "r2").resume_attempts == 0
    assert writer.close()


# --- damaged and read-only stores --------------------------------------------------------


def test_corrupt_pages_behind_a_valid_header_are_one_store_error(tmp_path: Path) -> None:
    db = open_database(damaged_store(tmp_path / "damaged.db"))  # the pages it reads are fine...
    try:
        with pytest.raises(StoreError, match="is not a SQLite database or is corrupt"), \
                db.session() as session:
            unfinished_requests(session)  # ...the journal's are not
    finally:
        db.close()


def test_read_only_open_reads_and_never_writes(tmp_path: Path) -> None:
    path = tmp_path / "ro.db"
    open_database(path).close()
    before = sorted(p.name for p in tmp_path.iterdir())
    db = open_database(path, read_only=True)
    try:
        assert db.revision() == head_revision()
        with pytest.raises(StoreError, match="read-only"):
            db.claim_writer()
    finally:
        db.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_read_only_file_in_a_read_only_directory_is_still_read(shared_dir: Path) -> None:
    folder = shared_dir / "ro"
    folder.mkdir()
    path = folder / "store.db"
    db = open_database(path)
    bus = EventBus()
    writer = StoreWriter(db, bus)
    deliver(bus, writer, added("kept"))
    writer.close()
    db.close()
    path.chmod(0o444)
    folder.chmod(0o555)
    content = path.read_bytes()

    def read() -> str:
        reader = open_database(path, read_only=True)
        try:
            with reader.session() as session:
                return ",".join(e.request_id for e in unfinished_requests(session))
        finally:
            reader.close()

    assert without_privileges(read) == "kept"
    assert path.read_bytes() == content and sorted(p.name for p in folder.iterdir()) == [
        "store.db", "store.db.lock"]


def test_a_read_only_filesystem_is_read_and_its_message_suggests_no_chmod(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with tmpfs(tmp_path / "mnt", "1m") as mount:
        path = mount / "store.db"
        open_database(path).close()
        remount(mount, "ro")
        with pytest.raises(StoreError) as caught:
            open_database(path)
        message = str(caught.value)
        assert "read-only" in message and "--db" in message and "chmod" not in message
        assert main(["db", "current", "--db", str(path)]) == 0
        assert main(["slow-queries", "list", "--db", str(path)]) == 0
        assert "no slow queries recorded" in capsys.readouterr().out


# --- migrations: each revision whole, or not at all ----------------------------------------

# A child that upgrades `argv[1]` and SIGKILLs itself inside revision 0004, after its columns
# were added and while its index is being built: where a slow upgrade of a big store dies.
_KILLED_UPGRADE = """
import os, signal, sys
from alembic.operations import Operations
from engine.store import open_database
create_index = Operations.create_index
def dying(self, name, *args, **kwargs):
    if name == "ix_slow_queries_cause":
        os.kill(os.getpid(), signal.SIGKILL)
    return create_index(self, name, *args, **kwargs)
Operations.create_index = dying
open_database(sys.argv[1])
"""


def store_at_0003(path: Path, slow_queries: int) -> None:
    """A store at revision 0003 holding `slow_queries` rows, as an older tokenflow left it."""
    database = open_database(path, upgrade=False)
    upgrade_database(database, "0003")
    with database.engine.begin() as connection:
        connection.exec_driver_sql(
            "INSERT INTO slow_queries (created_at, request_id, tenant, budget_score, "
            "prompt_tokens, prefill_s, budgeted_s, chunks, config) VALUES "
            "(1.0, ?, 't', 2.5, 100, 0.2, 0.1, '[]', '{}')",
            [(f"r{i}",) for i in range(slow_queries)])
    database.close()


def test_an_upgrade_killed_mid_revision_is_finished_by_the_next_start(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    store_at_0003(path, 200)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.run([sys.executable, "-c", _KILLED_UPGRADE, str(path)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    # The killed revision left nothing behind: its columns went with its transaction.
    with sqlite3.connect(path) as raw:
        assert raw.execute("SELECT version_num FROM alembic_version").fetchone() == ("0003",)
        columns = {row[1] for row in raw.execute("PRAGMA table_info(slow_queries)")}
    assert "timeline" not in columns
    database = open_database(path)  # the next start upgrades, no manual step
    try:
        assert database.revision() == head_revision()
        with database.session() as session:
            assert session.scalar(select(func.count()).select_from(SlowQueryRow)) == 200
    finally:
        database.close()


# --- the lock file is never another file ---------------------------------------------------


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(
        tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    path = tmp_path / "s.db"
    (tmp_path / "s.db.lock").symlink_to(precious)
    database = open_database(path)
    try:
        with pytest.raises(LockFileError, match=r"symbolic link.*rm "):
            database.claim_writer()
    finally:
        database.close()
    assert precious.read_text() == "keep me"


def test_a_lock_file_hard_linked_to_another_file_is_refused_and_left_whole(
        tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    path = tmp_path / "s.db"
    os.link(precious, tmp_path / "s.db.lock")
    database = open_database(path)
    try:
        with pytest.raises(LockFileError, match="2 hard links"):
            database.claim_writer()
    finally:
        database.close()
    assert precious.read_text() == "keep me"


# --- many servers, one history ---------------------------------------------------------------


def slow(rid: str, score: float) -> SlowQuery:
    return SlowQuery(request_id=rid, tenant="t", budget_score=score, prompt_tokens=4,
                     prefill_s=0.2, budgeted_s=0.1, chunks=(), config={})


def test_servers_share_a_postgresql_store_each_resuming_only_its_own(postgres: Cluster) -> None:
    url = postgres.create_database()
    box_a, box_b = open_database(url, server="box-a"), open_database(url, server="box-b")
    twin_a = open_database(url, server="box-a")
    try:
        bus_a, bus_b = EventBus(), EventBus()
        writer_a, writer_b = StoreWriter(box_a, bus_a), StoreWriter(box_b, bus_b)  # side by side
        with pytest.raises(StoreLockedError) as caught:  # but one writer per name
            twin_a.claim_writer()
        assert "'box-a'" in str(caught.value) and f"pid {os.getpid()}" in str(caught.value)
        assert "--server-name" in str(caught.value)
        # the same request id on both servers is two requests
        deliver(bus_a, writer_a, added("r1"), chunk("r1", 0, 0, 2, False), slow("r1", 3.0))
        deliver(bus_b, writer_b, added("r1"), added("r2"), finished("r2"), slow("r2", 2.0))
        assert writer_a.close() and writer_b.close()
        with box_a.session() as session:
            assert [(e.request_id, e.prefilled_tokens)
                    for e in unfinished_requests(session)] == [("r1", 2)]
            assert next_cycle(session, "r") == 0
        with box_b.session() as session:
            assert [e.request_id for e in unfinished_requests(session)] == ["r1"]
            assert claim_for_resume(session, ["r1", "r2"]) == 1
        assert journal_row_of(box_a, "box-a", "r1").resume_attempts == 0
        with box_a.session() as session:  # every server's rows, and each one's alone
            assert [(r.server, r.request_id) for r in list_slow_queries(session)] == [
                ("box-a", "r1"), ("box-b", "r2")]
            assert [r.request_id for r in list_slow_queries(session, server="box-b")] == ["r2"]
    finally:
        for database in (box_a, box_b, twin_a):
            database.close()
    reopened = open_database(url, server="box-a")  # released with its holder
    reopened.claim_writer()
    reopened.close()


def journal_row_of(db: Database, server: str, rid: str) -> JournalRow:
    with db.session() as session:
        return session.scalars(select(JournalRow).where(JournalRow.server == server,
                                                        JournalRow.request_id == rid)).one()


def test_slow_query_pages_walk_every_order_without_gaps_or_repeats(database: Database) -> None:
    bus = EventBus()
    writer = StoreWriter(database, bus)
    deliver(bus, writer, *(slow(f"r{i}", 1.5 + (i % 4) / 4) for i in range(23)))  # ties
    assert writer.close()
    with database.session() as session:
        for sort in ("score", "time", "prompt", "prefill", "id"):
            whole = [r.id for r in list_slow_queries(session, sort=sort)]
            pages: list[int] = []
            while len(pages) < len(whole):
                page = list_slow_queries(session, sort=sort, limit=5,
                                         after=pages[-1] if pages else None)
                assert page, sort
                pages += [r.id for r in page]
            assert pages == whole and len(set(whole)) == 23, sort
        scores = [r.budget_score for r in list_slow_queries(session)]
        assert scores == sorted(scores, reverse=True)


def test_a_store_half_upgraded_by_an_older_tokenflow_is_completed_on_start(
        tmp_path: Path) -> None:
    """What an upgrade killed by a tokenflow without transactional migrations left: 0004's
    first columns added, the version stamp still 0003 (every start then failed on a
    duplicate column)."""
    path = tmp_path / "half.db"
    store_at_0003(path, 3)
    with sqlite3.connect(path) as raw:
        raw.execute("ALTER TABLE slow_queries ADD COLUMN timeline JSON")
        raw.execute("ALTER TABLE slow_queries ADD COLUMN cause VARCHAR(32)")
    database = open_database(path)
    try:
        assert database.revision() == head_revision()
        columns = {c["name"] for c in inspect(database.engine).get_columns("slow_queries")}
        assert {"timeline", "cause", "cause_share", "verdict", "server"} <= columns
    finally:
        database.close()


# --- one store URL ---------------------------------------------------------------------------


def test_a_url_s_password_is_never_shown_and_other_databases_are_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    closed = "postgresql://tf:s3cret@127.0.0.1:1/tokenflow"  # nothing listens on port 1
    with pytest.raises(StoreError) as caught:
        open_database(closed)
    message = str(caught.value)
    assert "s3cret" not in message and "tf:***@127.0.0.1:1/tokenflow" in message
    assert "check that PostgreSQL runs there" in message
    assert main(["db", "current", "--db", closed]) == 2
    assert main(["slow-queries", "list", "--db", "mysql://tf:s3cret@host/db"]) == 2
    err = capsys.readouterr().err
    assert "s3cret" not in err and "SQLite or PostgreSQL only" in err


@pytest.mark.parametrize("url", [
    "postgresql://tf@127.0.0.1:1/tokenflow?password=s3cret",
    "postgresql://tf@127.0.0.1:1/tokenflow?sslmode=disable&PassWord=s3cret",
    "postgresql://tf:pa@s3cret@127.0.0.1:1/tokenflow",
    "postgresql://tf:s3cret@[::1:1/tokenflow",
])
def test_a_password_is_masked_in_any_url_form(url: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(StoreError) as caught:
        open_database(url)
    assert "s3cret" not in str(caught.value)
    assert main(["db", "current", "--db", url]) == 2
    assert "s3cret" not in capsys.readouterr().err
    if "?" in url:
        assert "s3cret" not in shown_url(store_url_of(url))


def test_a_path_and_a_sqlite_url_name_the_same_store(tmp_path: Path) -> None:
    by_path = open_database(tmp_path / "same.db", server="box-1")
    by_path.close()
    by_url = open_database(f"sqlite:///{tmp_path / 'same.db'}")
    try:
        assert by_url.path == tmp_path / "same.db" and not by_url.shared
        assert by_url.location == str(tmp_path / "same.db")
    finally:
        by_url.close()


def test_one_listing_shows_every_server_and_server_filters_it(
        store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    for server, score in (("box-a", 3.0), ("box-b", 2.0)):  # one after the other: SQLite
        database = open_database(store_url, server=server)  # has one writer at a time
        bus = EventBus()
        writer = StoreWriter(database, bus)
        deliver(bus, writer, slow(f"{server}-r", score))
        assert writer.close()
        database.close()
    assert main(["slow-queries", "list", "--db", store_url]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert "SERVER" in header.split()
    assert [row.split()[-2:] for row in rows] == [["box-a", "box-a-r"], ["box-b", "box-b-r"]]
    assert main(["slow-queries", "list", "--db", store_url, "--server", "box-b"]) == 0
    assert [row.split()[-1] for row in capsys.readouterr().out.splitlines()[1:]] == ["box-b-r"]
