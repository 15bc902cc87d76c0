"""A stopped engine heals itself: a fault in a step restarts the engine from its journal and
serve keeps answering; a crash loop stops it with the place of its last traceback, and
/health and /metrics say so. On the simulated executor and a VirtualClock: no model math,
and the supervisor's window is read on the engine's clock."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from engine.batch import RequestOutput
from engine.clock import VirtualClock
from engine.config import EngineConfig
from engine.harness.faults import StepFaults
from engine.serve.app import create_app
from engine.serve.outputs import _Listener
from engine.serve.session import EngineSession
from engine.serve.thread import ServerThread
from engine.sim.executor import simulated_engine
from engine.sim.target import resolve_target
from engine.store import StoreWriter, open_database
from engine.store.models import EngineFaultRow, JournalRow

CONFIG = EngineConfig(model="synthetic:tiny")
MAX_TOKENS = 8


@dataclass
class Served:
    session: EngineSession
    clock: VirtualClock
    http: httpx.Client

    def complete(self, n: int) -> httpx.Response:
        return self.http.post("/v1/completions", json={
            "prompt": [1 + n % 50] * (5 + n % 20), "max_tokens": MAX_TOKENS,
            "temperature": 0})

    def metric(self, name: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(f"tokenflow_{name}{{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not exported")

    def journal(self) -> dict[str, str]:
        assert self.session.writer is not None and self.session.database is not None
        self.session.writer.flush(timeout=10)
        with self.session.database.session() as s:
            return {r.request_id: r.state for r in s.scalars(select(JournalRow))}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    clock = VirtualClock(start=0.0)
    engine = simulated_engine(CONFIG, resolve_target("a100", CONFIG), clock)
    # the step-time ratio is kept: the reproduction's path
    engine.scheduler.controller.calibrated = True
    database = open_database(tmp_path / "store.db")
    session = EngineSession(engine, database, StoreWriter(database, engine.bus), None)
    loop = session.attach_loop().start()
    try:
        with ServerThread(create_app(loop, admin_token=None)) as server, \
                httpx.Client(base_url=server.url, timeout=30) as http:
            yield Served(session, clock, http)
    finally:
        session.close()


def test_an_idle_minute_over_http(served: Served) -> None:
    """An idle minute between requests, against the server: 200, 200, 65 s of nothing, 200."""
    assert served.complete(1).status_code == 200
    served.clock.sleep(5)
    assert served.complete(2).status_code == 200
    served.clock.sleep(65)
    assert served.complete(3).status_code == 200
    assert served.http.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("where", ["runner", "scheduler"])
def test_faults_under_load_restart_the_engine_and_lose_nothing(served: Served,
                                                               where: str) -> None:
    """Faults at random steps, half a simulated minute apart (never a crash loop), while 24
    requests are in flight from 6 clients: each is answered in full, once."""
    engine = served.session.engine
    steps = sorted(random.Random(7).sample(range(4, 120), 4))
    spread = [s for i, s in enumerate(steps) if i == 0 or s - steps[i - 1] > 12]
    faults = StepFaults(engine, spread, where, before=lambda: served.clock.sleep(31))
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(served.complete, range(24)))
    assert [r.status_code for r in replies] == [200] * 24, [r.text for r in replies]
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in replies)
    assert len({r.json()["id"] for r in replies}) == 24
    assert faults.raised >= 1
    assert served.metric("engine_restarts_total") == faults.raised
    assert served.metric("engine_up") == 1.0
    journal = served.journal()
    assert len(journal) == 24 and set(journal.values()) == {"FINISHED"}
    assert served.http.get("/health").status_code == 200


def test_a_crash_loop_stops_the_engine_and_says_where(served: Served) -> None:
    engine = served.session.engine
    StepFaults(engine, range(1, 1000))  # every step fails: three within a minute
    poison = served.complete(1)  # two failed steps held it: it fails alone, with the cause
    assert poison.status_code == 500
    assert "failed twice in a step holding this request" in poison.json()["error"]["message"]
    reply = served.complete(2)  # the third fault within a minute
    assert reply.status_code == 500
    assert "the engine stopped after 3 faults within 60 s" in reply.json()["error"]["message"]
    health = served.http.get("/health")
    assert health.status_code == 503
    assert "faults.py:" in health.json()["error"] and "InjectedFault" in health.json()["error"]
    refused = served.complete(3)
    assert refused.status_code == 503 and "faults.py:" in refused.json()["error"]["message"]
    assert served.metric("engine_up") == 0.0
    assert served.metric("engine_restarts_total") == 2.0
    assert served.metric("num_requests_running") == 0.0
    assert served.metric("requests_failed_engine_down_total") == 2.0
    assert list(served.journal().values()) == ["FAILED", "FAILED"]


def test_a_fault_is_stored_with_its_traceback(served: Served) -> None:
    """The log is not the only record: the store keeps the fault, its place and traceback."""
    StepFaults(served.session.engine, {2})
    assert served.complete(1).status_code == 200
    served.journal()  # flushes the writer
    assert served.session.database is not None
    with served.session.database.session() as s:
        faults = list(s.scalars(select(EngineFaultRow)))
    assert len(faults) == 1
    fault = faults[0]
    assert "faults.py:" in fault.place
    assert fault.place.endswith("in faulty")
    assert "Traceback" in fault.traceback and "in faulty" in fault.traceback
    assert "InjectedFault" in fault.error and fault.restarts == 1 and not fault.stopped


def test_a_resumed_requests_caller_hears_each_token_once() -> None:
    """Outputs carry new tokens only: after a restart the loop sends what the engine kept
    and the caller had not heard, and drops what it generates again that the caller had."""
    heard: list[int] = []
    listener = _Listener(lambda out: heard.extend(out.new_token_ids))

    def hear(*tokens: int) -> None:
        listener.hear(RequestOutput("r", tokens, False, None, "DECODING"))

    hear(1)
    hear(2)
    caught_up = listener.resumed("r", [1, 2, 3])  # the failed step's token went unheard
    assert caught_up is not None and caught_up.new_token_ids == (3,)
    listener.hear(caught_up)
    assert listener.resumed("r", [1]) is None  # the journal kept less than was heard
    for token in (2, 3, 4):
        hear(token)
    assert heard == [1, 2, 3, 4]


@pytest.mark.parametrize("where", ["runner", "scheduler"])
def test_a_resumed_requests_tokens_are_counted_once(served: Served, where: str) -> None:
    """A restart re-adds what the engine had accepted: the token counters still count each
    request's prompt once over its life, and each token it generated once. 18 requests from 6
    clients take 3 x MAX_TOKENS steps at least; the two faults are far enough apart that no
    request is held in both (which would fail it)."""
    engine = served.session.engine
    in_flight: list[int] = []  # requests the engine held at each fault: re-added after it
    faults = StepFaults(engine, {4, 17}, where,
                        before=lambda: (in_flight.append(len(engine.scheduler.requests)),
                                        served.clock.sleep(31)))
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(served.complete, range(18)))
    assert [r.status_code for r in replies] == [200] * 18, [r.text for r in replies]
    assert faults.raised == 2 and all(in_flight), in_flight
    assert served.metric("engine_restarts_total") == 2
    prompts = sum(5 + n % 20 for n in range(18))  # complete(n)'s prompt length
    assert sum(r.json()["usage"]["prompt_tokens"] for r in replies) == prompts
    assert served.metric("prompt_tokens_total") == prompts
    assert served.metric("generation_tokens_total") == 18 * MAX_TOKENS
