"""A fleet store that outlives its database: a PostgreSQL restart is ridden out from memory
within bounds and said, and a writer whose server-name lock was taken over stops writing and
says so, while the new holder closes only what the old one had not answered."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import select, text
from starlette.testclient import TestClient

from engine import Engine, EngineConfig
from engine.events import EventBus
from engine.serve.app import create_app
from engine.serve.loop import EngineLoop
from engine.store import StoreWriter, close_entry, open_database, unfinished_requests
from engine.store.lock import StoreLockedError
from engine.store.models import JournalRow
from engine.store.recovery import ORPHANED, abort_orphans
from engine.store.server_lock import ServerLock
from engine.store.writer import Commit, WriterHealth
from tests.postgres import Cluster
from tests.test_store import added, deliver, finished, journal_row


def eventually(condition: Callable[[], bool], what: str) -> None:
    """A hang guard, not a timing: the writer's thread gets there in its own time."""
    for _ in range(600):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached")


@pytest.fixture
def stopped_later(postgres: Cluster) -> Iterator[Cluster]:
    """The cluster, started again whatever the test left it as."""
    yield postgres
    with contextlib.suppress(subprocess.CalledProcessError):  # already running
        postgres.start()


def quick_sleep(seconds: float) -> None:
    time.sleep(min(seconds, 0.02))


def test_a_postgresql_restart_is_ridden_out_from_memory_and_said(
        stopped_later: Cluster) -> None:
    url = stopped_later.create_database()
    database = open_database(url, server="box")
    bus = EventBus()
    now = [0.0]
    writer = StoreWriter(database, bus, clock=lambda: now[0], sleep=quick_sleep)
    try:
        deliver(bus, writer, added("before"), finished("before"))
        stopped_later.stop()  # every session ends: the server-name lock with them
        for event in (added("during"), finished("during")):
            bus.publish(event)
        bus.drain()
        eventually(lambda: writer.health().state == "unreachable", "the outage")
        assert writer.served(timeout=0)  # answers go on, from memory
        heard: list[bool] = []
        writer.when_served(heard.append)
        assert heard == [True]  # at once, on the caller's thread
        now[0] += 42.0
        health = writer.health()
        assert health.since_s == 42.0 and health.error and writer.failure is None
        stopped_later.start()
        assert writer.flush(timeout=30)
        assert writer.health().state == "ok" and writer.failure is None
        assert journal_row(database, "during").state == "FINISHED"
        with pytest.raises(StoreLockedError):  # the name was taken back, and is held
            open_database(url, server="box").claim_writer()
    finally:
        writer.close()
        database.close()


def test_an_outage_past_its_bound_stops_the_writer_and_says_why(
        stopped_later: Cluster) -> None:
    url = stopped_later.create_database()
    database = open_database(url, server="box")
    bus = EventBus()
    now = [0.0]
    writer = StoreWriter(database, bus, clock=lambda: now[0], sleep=quick_sleep,
                         max_outage_s=60.0)
    try:
        stopped_later.stop()
        bus.publish(added("lost"))
        bus.drain()
        eventually(lambda: writer.health().state == "unreachable", "the outage")
        now[0] += 61.0  # past the bound, across a gap longer than it
        eventually(lambda: writer.failure is not None, "the stop")
        assert "unreachable for 61 s" in str(writer.failure)
        assert writer.health().state == "stopped" and not writer.served(timeout=0)
        heard: list[bool] = []
        writer.when_served(heard.append)
        eventually(lambda: heard == [False], "the stopped writer's answer")
    finally:
        stopped_later.start()
        writer.close()
        database.close()


def test_a_writer_whose_lock_session_ended_stops_and_a_new_holder_closes_only_the_open(
        postgres: Cluster) -> None:
    url = postgres.create_database()
    first = open_database(url, server="box")
    bus = EventBus()
    writer = StoreWriter(first, bus)
    second = open_database(url, server="box")
    try:
        deliver(bus, writer, added("answered"), finished("answered"), added("open"))
        kill_lock_session(first, second)
        assert abort_orphans(second) == ("open",)  # the name was free: the second took it
        # the first's next batch finds it taken; nothing in it was answered, so none of it
        # is written
        deliver(bus, writer, finished("open"), added("unanswered"), finished("unanswered"))
        assert writer.failure is not None and "was lost" in str(writer.failure)
        assert not writer.served(timeout=0)
        assert journal_row(second, "open").finish_reason == ORPHANED
        with second.session() as session:
            assert not session.scalars(select(JournalRow).where(
                JournalRow.request_id == "unanswered")).all()
        assert journal_row(second, "answered").state == "FINISHED"
        assert journal_row(second, "answered").finish_reason == "length"
    finally:
        writer.close()
        first.close()
        second.close()


def kill_lock_session(database: object, other: object) -> None:
    """End `database`'s server-name lock session from `other`'s connection, as an operator's
    pg_terminate_backend does, and wait until it is gone."""
    lock = database._writer_lock  # type: ignore[attr-defined]
    assert isinstance(lock, ServerLock)
    with other.engine.connect() as connection:  # type: ignore[attr-defined]
        connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": lock.backend_pid})
        connection.commit()

        def gone() -> bool:
            alive = connection.execute(text("SELECT count(*) FROM pg_stat_activity "
                                            "WHERE pid = :pid"),
                                       {"pid": lock.backend_pid}).scalar()
            connection.commit()
            return not alive
        eventually(gone, "the lock session's end")


def test_answers_given_from_memory_are_recorded_when_the_name_is_lost_while_they_are_held(
        stopped_later: Cluster) -> None:
    """After an outage the backlog answered from memory is written batch by batch. The name
    lost between two of those batches once dropped the rest (answered, never stored), while
    /health already said "ok" after the first."""
    url = stopped_later.create_database()
    database = open_database(url, server="box")
    bus = EventBus()
    hold, holding, release = threading.Event(), threading.Event(), threading.Event()

    def between_batches(_commit: Commit) -> None:
        if hold.is_set():
            hold.clear()
            holding.set()
            release.wait(60)

    writer = StoreWriter(database, bus, sleep=quick_sleep, batch_size=3,
                         on_commit=between_batches)
    second = None
    try:
        deliver(bus, writer, added("before"), finished("before"))
        stopped_later.stop()
        ids = [f"r{i}" for i in range(6)]
        for rid in ids:
            bus.publish(added(rid))
            bus.publish(finished(rid))
        bus.drain()
        eventually(lambda: writer.health().state == "unreachable", "the outage")
        assert writer.served(timeout=0)  # all six answered from memory
        hold.set()
        stopped_later.start()
        assert holding.wait(60)  # r0 and r1's start are stored; the rest is held
        health = writer.health()
        assert health.state == "unreachable" and health.held_events > 0
        assert health.error is not None and "reachable again" in health.error
        second = open_database(url, server="box")
        kill_lock_session(database, second)
        assert abort_orphans(second) == ("r1",)  # stored unfinished: closed as aborted
        release.set()
        eventually(lambda: writer.failure is not None, "the stop")
        assert "was lost" in str(writer.failure)
        # the failure is set first (no answer is promised after it), then the writer's thread
        # records what was promised: join it before reading what it wrote
        assert writer.close(timeout=60)
        for rid in ids:  # every answer is stored as answered, r1 set right after the sweep
            row = journal_row(second, rid)
            assert (row.state, row.finish_reason) == ("FINISHED", "length"), rid
        assert writer.health().state == "stopped" and writer.health().unrecorded == 0
    finally:
        release.set()
        writer.close()
        database.close()
        if second is not None:
            second.close()


def test_a_new_holder_leaves_an_entry_that_ended_after_it_was_read(postgres: Cluster) -> None:
    url = postgres.create_database()
    first = open_database(url, server="box")
    bus = EventBus()
    writer = StoreWriter(first, bus)
    try:
        deliver(bus, writer, added("late"))
        with first.session() as session:
            unfinished = [e.request_id for e in unfinished_requests(session)]
        deliver(bus, writer, finished("late"))  # ends between the sweep's read and its close
        with first.session() as session:
            for rid in unfinished:
                close_entry(session, rid, "FINISHED", "aborted")
        assert journal_row(first, "late").finish_reason == "length"
    finally:
        writer.close()
        first.close()


def test_health_says_the_store_is_unreachable_while_serving_goes_on() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    loop = EngineLoop(engine).start()
    state = [WriterHealth("ok")]
    try:
        app = create_app(loop, admin_token=None, public_stats=True,
                         store_health=lambda: state[0])
        with TestClient(app, base_url="http://127.0.0.1") as client:
            assert client.get("/health").json() == {
                "status": "ok", "store": {"state": "ok", "since_s": None, "held_events": 0,
                                          "error": None, "unrecorded": 0}}
            state[0] = WriterHealth("unreachable", since_s=3.5, held_events=12,
                                    error="connection refused")
            answer = client.get("/health")
            assert answer.status_code == 200 and answer.json()["status"] == "degraded"
            assert answer.json()["store"]["held_events"] == 12
            assert client.get("/v1/stats").json()["store"]["state"] == "unreachable"
    finally:
        loop.stop()
