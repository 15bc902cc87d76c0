"""A fleet store that outlives its database: a PostgreSQL restart is ridden out from memory
within bounds and said, and a writer whose server-name lock was taken over stops writing and
says so, while the new holder closes only what the old one had not answered."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import text
from starlette.testclient import TestClient

from engine import Engine, EngineConfig
from engine.events import EventBus
from engine.serve.app import create_app
from engine.serve.loop import EngineLoop
from engine.store import StoreWriter, open_database
from engine.store.lock import StoreLockedError
from engine.store.recovery import abort_orphans
from engine.store.server_lock import ServerLock
from engine.store.writer import WriterHealth
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
        lock = first._writer_lock
        assert isinstance(lock, ServerLock)
        with second.engine.connect() as connection:  # the lock's connection is killed
            connection.execute(text("SELECT pg_terminate_backend(:pid)"),
                               {"pid": lock.backend_pid})
            connection.commit()

            def gone() -> bool:
                alive = connection.execute(text("SELECT count(*) FROM pg_stat_activity "
                                                "WHERE pid = :pid"),
                                           {"pid": lock.backend_pid}).scalar()
                connection.commit()
                return not alive
            eventually(gone, "the lock session's end")
        assert abort_orphans(second) == ("open",)  # the name was free: the second took it
        deliver(bus, writer, finished("open"))  # the first's next batch finds it taken
        assert writer.failure is not None and "was lost" in str(writer.failure)
        assert not writer.served(timeout=0)
        assert journal_row(second, "answered").state == "FINISHED"
        assert journal_row(second, "answered").finish_reason == "length"
    finally:
        writer.close()
        first.close()
        second.close()


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
                                          "error": None}}
            state[0] = WriterHealth("unreachable", since_s=3.5, held_events=12,
                                    error="connection refused")
            answer = client.get("/health")
            assert answer.status_code == 200 and answer.json()["status"] == "degraded"
            assert answer.json()["store"]["held_events"] == 12
            assert client.get("/v1/stats").json()["store"]["state"] == "unreachable"
    finally:
        loop.stop()
