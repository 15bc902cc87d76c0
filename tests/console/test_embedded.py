"""The embedded source on a store that a killed console left behind (pitfall 12)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from console.sources.base import SourceError, stated_rate
from console.sources.embedded import EmbeddedSource
from engine.calibration.calibrate import Calibration
from engine.errors import EngineError
from engine.events import ChunkComplete, EventBus, RequestAdded
from engine.store import StoreWriter, open_database
from engine.store.models import JournalRow
from engine.store.recovery import ORPHANED
from tests.console.conftest import UI_ENGINE


def _leave_unfinished(db: Path, request_id: str) -> None:
    """A journal as a console killed mid-prefill leaves it."""
    database = open_database(db)
    bus = EventBus()
    writer = StoreWriter(database, bus)
    bus.publish(RequestAdded(request_id=request_id, prompt_token_ids=(5, 6, 7, 8),
                             sampling={"max_tokens": 3, "ignore_eos": True}, tenant="t",
                             priority=0, tag="chat"))
    bus.publish(ChunkComplete(request_id=request_id, chunk_index=0, tokens=2, start=0,
                              duration_s=0.01, estimated_bytes=1e6, predicted_s=0.01,
                              prefill_done=False))
    bus.drain()
    assert writer.close()
    database.close()


def test_an_orphan_and_new_traffic_never_share_an_id(calibrated_db: Path) -> None:
    db = calibrated_db
    _leave_unfinished(db, "chat-00000-0")  # the id the new traffic's first request had
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="chat", db=db,
                                  config=UI_ENGINE, num_requests=2, rate=float("inf"),
                                  repeat=False)
    new = {"chat-00000-1", "chat-00001-1"}  # numbered on from the orphan's cycle

    def rows() -> dict[str, tuple[str, str | None]]:
        source.writer.flush(timeout=60)
        with source.database.session() as session:
            found = session.execute(select(JournalRow.request_id, JournalRow.state,
                                           JournalRow.finish_reason)).all()
        return {rid: (state, reason) for rid, state, reason in found}

    try:
        deadline = time.monotonic() + 60
        while not all(rows().get(rid, ("",))[0] == "FINISHED" for rid in new):
            assert source.loop.error is None, f"the engine loop died: {source.loop.error!r}"
            assert time.monotonic() < deadline, "the requests did not finish"
            source.loop.call(lambda engine: None).result(timeout=60)  # a step boundary on
        found = rows()
    finally:
        source.close()
    assert source.orphans == ("chat-00000-0",)
    assert found["chat-00000-0"] == ("FINISHED", ORPHANED)  # closed at start, not run
    assert set(found) == {"chat-00000-0", *new}


def test_a_journal_that_stops_pauses_the_console_engine_and_says_why(
        calibrated_db: Path) -> None:
    """The console's engine does not serve on unrecorded when its journal stops."""
    db = calibrated_db
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="chat", db=db,
                                  config=UI_ENGINE, num_requests=4, rate=float("inf"),
                                  repeat=True)
    try:
        with contextlib.closing(sqlite3.connect(db)) as connection:
            connection.execute("DROP TABLE request_journal")  # under the running writer
        stopped = threading.Event()
        source.writer.on_failure(lambda _error: stopped.set())
        assert stopped.wait(60), "the journal kept writing without its table"
        assert source.loop.paused
        with pytest.raises(SourceError, match=r"the journal in .* stopped"):
            source.snapshot()
        with pytest.raises(SourceError, match="cannot resume"):
            source.resume()
    finally:
        source.close()


@pytest.mark.slow  # starts the embedded engine twice
def test_a_restart_restores_the_last_stored_settings_and_arrival_changes_are_stored(
        calibrated_db: Path) -> None:
    """The budget came back at 256 after a restart although the last change set 96; the
    arrival rate, changed too, is stored as a change like the budget's."""
    db = calibrated_db
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="chat", db=db,
                                  config=UI_ENGINE, num_requests=2, repeat=False)
    try:
        source.update_config(max_num_batched_tokens=96)
        source.set_arrival_rate(0.5)
        fields = {c.field: c.new for c in source.config_changes()}
    finally:
        source.close()
    assert fields == {"max_num_batched_tokens": 96, "arrival_rate": 0.5}
    heard: list[str] = []
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="chat", db=db,
                                  config=UI_ENGINE, num_requests=2, repeat=False,
                                  progress=lambda _fraction, what: heard.append(what))
    try:
        assert source.snapshot().config["max_num_batched_tokens"] == 96
    finally:
        source.close()
    assert "restoring the last stored settings: max_num_batched_tokens=96" in heard


def test_the_embedded_engine_replays_what_a_traced_fleet_served(tmp_path: Path) -> None:
    from tests.test_traced_workload import _collected, served

    store = _collected(tmp_path)
    db = tmp_path / "console.db"
    expected = {f"{t.request_id}-0": "FINISHED" for t in served()[:2]}  # cycle 0
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu",
                                  workload=f"traced:{store}", db=db, num_requests=2,
                                  repeat=False)
    try:
        deadline = time.monotonic() + 60
        # each round waits for the engine loop to take a command; arrivals keep their gaps
        while _journal_states(db) != expected:
            assert source.loop.error is None, f"the engine loop died: {source.loop.error!r}"
            assert time.monotonic() < deadline, f"not replayed: {_journal_states(db)}"
            source.loop.call(lambda engine: None).result(timeout=60)
    finally:
        source.close()


def _journal_states(db: Path) -> dict[str, str]:
    database = open_database(db)
    try:
        with database.session() as session:
            return dict(session.execute(select(JournalRow.request_id, JournalRow.state)).all())
    finally:
        database.close()


@pytest.mark.slow  # plays traffic on an embedded engine
def test_the_rate_flag_is_the_rate_played_shown_and_stored(tmp_path: Path) -> None:
    """`--rate 20` on a 32-request Poisson sample once played (and showed) 16/s; a change
    stored the old rate as 3.202 where the form showed 3.2."""
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="mixed",
                                  db=tmp_path / "rate.db", rate=20.0)
    try:
        assert source.snapshot().workload_rate == pytest.approx(20.0)
        source.set_arrival_rate(3.14159)
        [change] = [c for c in source.config_changes() if c.field == "arrival_rate"]
        assert (change.old, change.new) == (20.0, 3.14)
        assert stated_rate(source.snapshot().workload_rate) == 3.14
    finally:
        source.close()


def test_a_failed_first_calibration_is_said_until_a_recalibration_succeeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def faulted(_sweep: Calibration) -> bool:
        raise EngineError("a calibration step faulted")

    monkeypatch.setattr(Calibration, "advance", faulted)
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="chat",
                                  db=tmp_path / "fresh.db", config=UI_ENGINE, num_requests=2,
                                  rate=float("inf"), repeat=False)
    try:
        # a command's pass publishes after it runs: this one runs after the failed sweep
        source.loop.call(lambda engine: None).result(timeout=60)
        assert source.calibrating is None
        said = source.snapshot().calibration
        assert said.startswith("uncalibrated: the first calibration failed (a calibration "
                               "step faulted)"), said
        monkeypatch.undo()
        source.recalibrate(lambda fraction, note: None)
        # a pass with requests running publishes at most every interval: step boundaries on
        # until one has (the traffic's two requests end, and an idle pass always publishes)
        for _ in range(10_000):
            if source.snapshot().calibration == "calibrated":
                break
            source.loop.call(lambda engine: None).result(timeout=60)
        assert source.snapshot().calibration == "calibrated"
    finally:
        source.close()


def test_a_snapshot_from_just_before_the_first_calibration_ended_says_how_far_it_came(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop publishes a snapshot, then the sweep's last unit ends on the same thread: a
    poll between them read the older snapshot ("calibrating") with no progress beside it,
    where every other poll said how far it was ("pass 3/3, shape 16/16", "fitting")."""
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="chat",
                                  db=tmp_path / "fresh.db", config=UI_ENGINE, num_requests=2,
                                  rate=float("inf"), repeat=False)
    try:
        for _ in range(10_000):  # step boundaries on until the sweep has ended
            if source.calibrating is None:
                break
            source.loop.call(lambda engine: None).result(timeout=60)
        assert source.calibrating is None and source.calibration_failure is None
        stale = dataclasses.replace(source.loop.snapshot(), calibration="calibrating")
        monkeypatch.setattr(source.loop, "snapshot", lambda: stale)
        said = source.snapshot().calibration
        assert re.fullmatch(r"calibrating \((pass \d/\d, shape \d+/\d+|fitting)\)", said), said
    finally:
        source.close()


def test_a_simulated_console_engine_says_how_far_to_trust_its_figures(tmp_path: Path) -> None:
    from engine.sim.executor import Simulation

    heard: list[str] = []
    source = EmbeddedSource.start(model="synthetic:8b", workload="chat", db=tmp_path / "t.db",
                                  num_requests=4, rate=float("inf"), repeat=False,
                                  simulate=Simulation("h100", speed=1000.0),
                                  progress=lambda _fraction, what: heard.append(what))
    try:
        assert source.trust is not None
        # it schedules as vLLM's server does on an H100, as bench --simulate h100 does
        config = source.loop.engine.config
        assert (config.max_num_batched_tokens, config.max_num_seqs) == (8192, 1024)
        assert any(said.startswith("vLLM's GPU server defaults: gpu_memory_utilization=0.9, "
                                   "max_num_batched_tokens=8192") for said in heard)
        deadline = time.monotonic() + 60  # a hang guard: the loop steps the twin's requests
        while source.snapshot().requests_finished_total < 4:
            assert source.loop.error is None, f"the engine loop died: {source.loop.error!r}"
            assert time.monotonic() < deadline, "the requests did not finish"
            source.loop.call(lambda engine: None).result(timeout=60)
        shown = source.snapshot().twin_trust
    finally:
        source.close()
    assert shown == source.trust.line() and shown
    assert shown.startswith(("band ±", "far from every published case"))


def test_a_simulated_console_engine_keeps_the_settings_its_caller_gave(tmp_path: Path) -> None:
    from engine.config import EngineConfig
    from engine.sim.executor import Simulation

    source = EmbeddedSource.start(model="synthetic:8b", workload="chat", db=tmp_path / "t.db",
                                  config=EngineConfig(max_num_batched_tokens=512),
                                  num_requests=1, rate=float("inf"), repeat=False,
                                  simulate=Simulation("a100", speed=1000.0))
    try:
        config = source.loop.engine.config
        # the caller's budget stands; the rest is vLLM's A100 server's
        assert (config.max_num_batched_tokens, config.max_num_seqs) == (512, 256)
    finally:
        source.close()
