"""The engine's figures over hours, read back from the store's journal: a two-hour run
stamped on a chosen clock, read as a six-hour view in ten-minute buckets."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import select

from engine.config import EngineConfig
from engine.serve.session import EngineSession
from engine.store import open_database, stored_metrics
from engine.store.models import (
    ConfigChangeRow,
    DriftEventRow,
    EngineFaultRow,
    JournalRow,
    PauseRow,
    SessionStartRow,
)

START = 1_700_000_000.0  # the run's first request, on the wall clock the rows carry
HOUR = 3600.0


def journal(at: float, ttft_s: float, n: int) -> JournalRow:
    return JournalRow(request_id=f"r{n}", tenant="t", priority=0, tag=None,
                      prompt_token_ids=[1, 2], sampling={}, state="FINISHED",
                      prefilled_tokens=100, chunks_done=1, preemptions=0,
                      generated_token_ids=[], generated_tokens=20, added_at=at,
                      first_token_at=at + ttft_s, finished_at=at + 2.0, ttft_s=ttft_s,
                      updated_at=at + 2.0)


def test_a_two_hour_run_reads_back_as_a_six_hour_view_with_its_marks(tmp_path: Path) -> None:
    database = open_database(tmp_path / "history.db")
    try:
        with database.session() as session:
            # one request every 10 s for two hours: TTFT 50 ms in the first, 500 ms after
            for n in range(720):
                at = START + n * 10.0
                session.add(journal(at, 0.05 if at < START + HOUR else 0.5, n))
            session.add(ConfigChangeRow(created_at=START + HOUR, field="max_num_batched_tokens",
                                        old=256, new=512, source="console"))
            session.add(DriftEventRow(created_at=START + 1.5 * HOUR, deviation=0.3,
                                      detail="prefill 30% slow"))
            session.add(EngineFaultRow(created_at=START + 0.5 * HOUR, restarts=1, place="step",
                                       error="boom", traceback="", stopped=False, resumed=0,
                                       failed=0))
            session.add_all(PauseRow(created_at=START + at, paused=paused)
                            for at, paused in ((0.75 * HOUR, True), (0.8 * HOUR, False)))
            session.commit()
        end = START + 2 * HOUR
        with database.session() as session:
            view = stored_metrics(session, end - 6 * HOUR, end, 36)
    finally:
        database.close()
    assert len(view.buckets) == 36 and view.buckets[-1].end == pytest.approx(end)
    before, first, second = view.buckets[:24], view.buckets[24:30], view.buckets[30:]
    assert all(b.arrivals_per_s == 0 and b.ttft_p99_ms is None for b in before)
    assert all(b.arrivals_per_s == pytest.approx(0.1) for b in first + second)
    assert all(b.ttft_p50_ms == pytest.approx(50.0) for b in first)
    assert all(b.ttft_p99_ms == pytest.approx(500.0) for b in second)
    assert first[1].tokens_per_s == pytest.approx(0.1 * 120)
    assert view.changes == (START + HOUR,)
    assert view.drift == (START + 1.5 * HOUR,)
    assert view.restarts == (START + 0.5 * HOUR,)
    assert view.pauses == (START + 0.75 * HOUR, START + 0.8 * HOUR)
    with pytest.raises(ValueError, match="end > start"):
        stored_metrics(None, end, end, 1)  # type: ignore[arg-type]


def test_each_start_of_a_process_on_the_store_is_stored_and_read_back(tmp_path: Path) -> None:
    """A second process on the same store (a console restarted) is a mark of its own, with
    the requests the first left unfinished."""
    db = tmp_path / "store.db"
    config = EngineConfig(model="synthetic:tiny", dtype="float32")

    def start_and_stop(leave_unfinished: bool) -> None:
        with EngineSession.start(config, db=db, calibrate=False) as session:
            assert session.writer is not None and session.database is not None
            session.engine.step()  # a step delivers the bus's events to the writer
            assert session.writer.flush(timeout=60.0)
            if leave_unfinished:
                with session.database.session() as s:
                    row = journal(time.time(), 0.05, 0)
                    row.state, row.finished_at = "WAITING", None
                    s.add(row)
                    s.commit()

    before = time.time()
    start_and_stop(leave_unfinished=True)
    start_and_stop(leave_unfinished=False)
    database = open_database(db)
    try:
        with database.session() as session:
            view = stored_metrics(session, before - 1.0, time.time() + 1.0, 1)
            orphans = session.scalars(select(SessionStartRow.orphans)
                                      .order_by(SessionStartRow.id)).all()
    finally:
        database.close()
    assert len(view.starts) == 2 and view.starts[0] < view.starts[1]
    assert all(before - 1.0 <= at <= time.time() for at in view.starts)
    assert orphans == [0, 1]  # the second start closed what the first left
