"""EngineSession: the one start/stop of an engine with its store (run, serve, bench, console)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy import select

from engine import EngineConfig, SamplingParams
from engine.errors import ModelLoadError
from engine.harness.driver import OutputTokens
from engine.serve.session import EngineSession
from engine.store import open_database, unfinished_requests
from engine.store.models import JournalRow
from engine.store.recovery import ORPHANED

CONFIG = EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                      max_num_batched_tokens=16, chunk_tile=8)
PROMPT = list(range(3, 43))
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def test_a_killed_sessions_requests_resume_to_the_uninterrupted_tokens(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with EngineSession.start(CONFIG, db=db) as session:
        expected = session.engine.generate([PROMPT], PARAMS)[0]
    # A session that stops mid-prefill, as a crash would leave it: the journal holds it open.
    first = EngineSession.start(CONFIG, db=db)
    rid = first.engine.add_request(PROMPT, PARAMS)
    first.engine.step()
    first.close()
    database = open_database(db)
    with database.session() as s:
        assert [e.request_id for e in unfinished_requests(s)] == [rid]
    database.close()

    with EngineSession.start(CONFIG, db=db, resume=True) as second:
        resumption = second.resume_unfinished()
        assert resumption.resumed == (rid,)
        # marked as resumed, though it had generated nothing yet (stopped mid-prefill)
        assert second.engine.scheduler.requests[rid].resumed_tokens == 0
        # and so the snapshot the console's Requests table and /v1/stats read says
        assert [(r.id, r.resumed_tokens) for r in second.engine.snapshot().requests] == [(rid, 0)]
        tokens, outputs = OutputTokens(resumption.generated), {}
        while second.engine.has_unfinished():
            for o in second.engine.step():
                held = tokens.add(o)
                if o.finished:
                    outputs[o.request_id] = held
    assert outputs[rid] == expected


def leave_orphan(db: Path) -> str:
    """A session that stops with one request mid-prefill, as a crash leaves the journal."""
    with EngineSession.start(CONFIG, db=db, calibrate=False) as session:
        rid = session.engine.add_request(PROMPT, PARAMS)
        session.engine.step()
    return rid


def journal_row(db: Path, rid: str) -> tuple[str, str | None, int]:
    database = open_database(db)
    try:
        with database.session() as s:
            row = s.scalars(select(JournalRow).where(JournalRow.request_id == rid)).one()
            return row.state, row.finish_reason, row.resume_attempts
    finally:
        database.close()


def test_every_start_closes_orphans_as_aborted_unless_asked_to_resume(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    rid = leave_orphan(db)
    with EngineSession.start(CONFIG, db=db, calibrate=False, resume=True) as kept:
        assert kept.orphans == ()  # run --resume's start: left for resume_unfinished
    assert journal_row(db, rid)[:2] == ("PREFILL_CHUNKING", None)  # left as it was
    with EngineSession.start(CONFIG, db=db, calibrate=False) as session:
        assert session.orphans == (rid,)
        assert not session.engine.has_unfinished()  # nothing is run again
    assert journal_row(db, rid) == ("FINISHED", ORPHANED, 0)
    with EngineSession.start(CONFIG, db=db, calibrate=False) as again:
        assert again.orphans == ()  # closed once


def test_a_start_that_fails_leaves_the_orphans_as_they_were(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    rid = leave_orphan(db)
    with pytest.raises(ModelLoadError):
        EngineSession.start(EngineConfig(model=str(tmp_path / "missing"), device="cpu"), db=db)
    assert journal_row(db, rid)[:2] == ("PREFILL_CHUNKING", None)  # left as it was


def test_close_stops_the_loop_and_the_writer_after_committing(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    session = EngineSession.start(CONFIG, db=tmp_path / "s.db")
    loop = session.attach_loop().start()
    finished = threading.Event()
    loop.submit(PROMPT, PARAMS, on_output=lambda o: o.finished and finished.set())
    assert finished.wait(timeout=60)
    with pytest.raises(RuntimeError, match="already has"):
        session.attach_loop()
    session.close()
    # the engine loop's and the journal writer's threads are gone
    assert [t for t in threading.enumerate() if t not in before and t.is_alive()] == []
    database = open_database(tmp_path / "s.db")
    with database.session() as s:
        assert unfinished_requests(s) == []  # committed before the database closed
    database.close()


def test_without_a_store_there_is_no_database_writer_or_resume(tmp_path: Path) -> None:
    with EngineSession.start(CONFIG, db=tmp_path / "unused.db", store=False) as session:
        assert session.database is None and session.writer is None
        assert session.calibration is None and session.resume_unfinished().resumed == ()
    assert not (tmp_path / "unused.db").exists()


def test_read_only_session_has_no_journal_writer(tmp_path: Path) -> None:
    with EngineSession.start(CONFIG, db=tmp_path / "r.db", journal=False) as session:
        assert session.database is not None and session.writer is None


def test_an_engine_that_cannot_start_raises_and_leaves_the_store_usable(tmp_path: Path) -> None:
    missing = EngineConfig(model=str(tmp_path / "no-model"), device="cpu")
    with pytest.raises(ModelLoadError, match="not found"):
        EngineSession.start(missing, db=tmp_path / "s.db")
    # The store was opened first (a bad --db fails before the model loads) and stays usable.
    assert (tmp_path / "s.db").exists()
    with EngineSession.start(CONFIG, db=tmp_path / "s.db") as session:
        assert session.database is not None
