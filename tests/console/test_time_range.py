"""The charts' time range: beyond the minutes the console holds, the store fills the past,
read through the source, with its changes, drift events and restarts marked. The store is
seeded with a run stamped two hours before now (the rows' clock is the test's)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from console.sources.base import SourceError
from console.sources.replay import ReplaySource
from console.tui.screens.tuning import CHANGE_COLUMNS
from console.tui.widgets.keyed_table import KeyedTable
from console.tui.widgets.plot import Plot
from engine.store import open_database
from engine.store.models import ConfigChangeRow, DriftEventRow
from tests.console.conftest import SESSION, chat_console, tuning_shown, until
from tests.test_metric_history import journal

pytestmark = pytest.mark.anyio
HOUR = 3600.0


def seed(db: Path, ago: float) -> float:
    """A two-hour run that ended `ago` seconds before now; returns its start (wall)."""
    start = time.time() - ago - 2 * HOUR
    database = open_database(db)
    try:
        with database.session() as session:
            session.add_all(journal(start + n * 10.0, 2.5, n) for n in range(720))
            session.add(ConfigChangeRow(created_at=start + HOUR, field="chunk_tile", old=16,
                                        new=32, source="console"))
            session.add(DriftEventRow(created_at=start + 1.5 * HOUR, deviation=0.3,
                                      detail="prefill 30% slow"))
            session.commit()
    finally:
        database.close()
    return start


@pytest.mark.slow  # the console with an engine, over hours of store
async def test_the_range_key_reads_hours_back_from_the_store(calibrated_db: Path) -> None:
    db = calibrated_db
    start = seed(db, ago=HOUR)
    app = chat_console(db, 2)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await tuning_shown(pilot)
        ttft = screen.query_one("#tune-ttft", Plot)
        charts = screen.query_one("#tuning-charts")
        assert "· 10 min (t)" in str(charts.border_title)
        await pilot.press("t")  # 1 h: the seeded run ended an hour ago, just out of view
        assert "· 1 h (t)" in str(charts.border_title)
        await pilot.press("t")  # 6 h: the whole run, from the store
        assert "· 6 h (t)" in str(charts.border_title)
        offset = app.latest.wall_offset or (time.time() - time.monotonic())
        await until(pilot, lambda: ttft.series and ttft.series[1].times
                    and ttft.series[1].times[0] < start - offset + 10 * 60, "the stored run")
        older = [v for t, v in zip(ttft.series[1].times, ttft.series[1].values, strict=True)
                 if t < start - offset + 2 * HOUR]
        assert older and all(v == pytest.approx(2500.0) for v in older)  # TTFT p99 2.5 s
        assert any(abs(mark - (start + HOUR - offset)) < 1 for mark in ttft._marks)
        assert any(abs(event - (start + 1.5 * HOUR - offset)) < 1 for event in ttft._events)
        # a change older than the console's memory keeps its before and after, from the store
        changes = screen.query_one("#config-changes", KeyedTable)
        table = changes.table
        await until(pilot, lambda: table.row_count, "the stored changes")
        by = [c.key for c in CHANGE_COLUMNS].index("by")
        [key] = [k for k, row in changes.rows.items() if row.cells[by] == "console"]
        await until(pilot, lambda: str(table.get_cell(key, "ttft-before")) == "2.5 s",
                    "the change's figures from the store")
        assert str(table.get_cell(key, "ttft-after")) == "2.5 s"
        assert str(table.get_cell(key, "load")) == "equal, 0.1/s"
        for _ in range(3):  # 24 h, the session, and back to the minutes in memory
            await pilot.press("t")
        assert "· 10 min (t)" in str(charts.border_title)
        await until(pilot, lambda: not ttft._events, "the stored marks gone")


def test_a_recording_is_its_own_store_as_far_as_it_has_played() -> None:
    source = ReplaySource(SESSION, speed=0)
    while not source.finished:
        source.snapshot()
    first, last = source._snapshots[0], source._snapshots[-1]
    assert first.wall_offset is not None and last.wall_offset is not None
    start, end = first.ts + first.wall_offset, last.ts + last.wall_offset + 1.0
    view = source.stored_metrics(start, end, 4)
    width = (end - start) / 4
    arrived = sum(b.arrivals_per_s for b in view.buckets) * width
    assert arrived == pytest.approx(last.arrived - first.arrived)
    assert any(b.ttft_p99_ms is not None for b in view.buckets)
    assert view.changes == tuple(sorted(c.created_at for c in source.config_changes()
                                        if start <= c.created_at < end))
    with pytest.raises(SourceError, match="end > start"):
        source.stored_metrics(end, start, 4)
