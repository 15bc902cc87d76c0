"""The 6-hour history after a 2-hour run on an injected clock: the time-warp soak drives the
simulated engine through two hours (a pause and a budget change at each hour's end) in about
a second, its store writer journaling everything; then the console opens on that store and
its 6-hour view marks every change, pause, drift event and restart where it happened, the
restarts of the whole process (the run's and the console's own start on that store) too."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from console.tui.widgets.plot import Plot
from engine.clock import VirtualClock
from engine.config import EngineConfig
from engine.events import Drift, EngineRestarted, Event, SessionStarted
from engine.harness.soak import SoakPlan, day_of_trace, time_warp_soak
from engine.sim.executor import simulated_engine
from engine.sim.target import resolve_target
from engine.store import StoredMetrics, StoreWriter, open_database, stored_metrics
from tests.console.conftest import chat_console, tuning_shown, until

pytestmark = [pytest.mark.anyio, pytest.mark.slow]  # a two-hour run, warped
HOUR = 3600.0
ENDED_AGO_S = 600.0  # the run ended ten minutes ago: all of it lies beyond the console's memory


def warped_run(db: Path) -> float:
    """Two simulated hours on a VirtualClock set so that the run ends ENDED_AGO_S before now.
    A fault's restart and a drift event are published from the bus as the clock passes their
    hour, the way the supervisor and the drift monitor publish them (the bus stamps them with
    the clock). Returns the run's start on the engine's (monotonic) clock."""
    plan = SoakPlan(hours=2, busy_from=0, requests_per_hour=12, abort_share=0.0,
                    max_output_tokens=32)
    ends = plan.hours * HOUR + plan.pause_s  # the last hour's pause and change close it
    clock = VirtualClock(start=time.monotonic() - ENDED_AGO_S - ends)
    start = clock()
    config = EngineConfig(model="synthetic:small", kv_cache_bytes=256 << 20)
    engine = simulated_engine(config, resolve_target("a100", config), clock)
    engine.scheduler.controller.calibrated = True
    due: list[tuple[float, Event]] = [
        (start + 0.5 * HOUR, EngineRestarted(restarts=1, place="step", error="injected fault",
                                              resumed=0, failed=0)),
        (start + 1.25 * HOUR, SessionStarted(orphans=0)),  # as EngineSession.start does
        (start + 1.5 * HOUR, Drift(deviation=0.3, detail="prefill 30% slow"))]

    def publish_due(_: Event) -> None:
        while due and clock() >= due[0][0]:
            engine.bus.publish(due.pop(0)[1])

    engine.bus.subscribe(publish_due)
    database = open_database(db)
    writer = StoreWriter(database, engine.bus, clock=clock)
    try:
        report = time_warp_soak(engine, clock, plan,
                                day_of_trace(plan, engine.model_config.vocab_size))
        assert report.exceptions == [] and report.simulated_s >= 2 * HOUR and not due
        writer.flush(timeout=60.0)
    finally:
        writer.close()
        database.close()
    return start


def stored_since(db: Path, since: float) -> StoredMetrics:
    database = open_database(db)
    try:
        with database.session() as session:
            return stored_metrics(session, since, time.time() + 1.0, 1)
    finally:
        database.close()


async def test_a_warped_two_hour_run_is_marked_in_place_on_the_six_hour_view(
        calibrated_db: Path) -> None:
    db = calibrated_db
    start = warped_run(db)
    offset = time.time() - time.monotonic()  # where the store put the engine clock's times
    stored = stored_since(db, start + offset - 1)
    # a change and a pause and resume at each hour's end, as the soak makes them
    assert len(stored.changes) == 2 and len(stored.pauses) == 4
    [drift], [restart] = stored.drift, stored.restarts  # published as the clock passed them
    assert 1.5 * HOUR <= drift - offset - start < 1.75 * HOUR
    assert 0.5 * HOUR <= restart - offset - start < 0.75 * HOUR
    [run_start] = stored.starts
    assert 1.25 * HOUR <= run_start - offset - start < 1.5 * HOUR

    app = chat_console(db, 1)  # the whole process started again on the same store
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await tuning_shown(pilot)
        await until(pilot, lambda: len(stored_since(db, start + offset - 1).starts) == 2,
                    "the console's own start stored")
        stored = stored_since(db, start + offset - 1)
        await pilot.press("t", "t")  # 1 h, then 6 h
        assert "· 6 h (t)" in str(screen.query_one("#tuning-charts").border_title)
        plots = list(screen.query("#tuning-charts Plot").results(Plot))
        await until(pilot, lambda: all(len(p._events) >= 8 for p in plots),
                    "the stored marks on every chart")
        now = app.state.history.newest_ts
        assert now is not None

        def placed(times: tuple[float, ...], wanted: tuple[float, ...]) -> bool:
            """Each wanted time is marked within a second, on the engine's clock."""
            return all(any(abs(t - (at - offset)) < 1.0 for t in times) for at in wanted)

        for plot in plots:
            assert placed(plot._marks, stored.changes)
            assert placed(plot._events, (*stored.drift, *stored.restarts, *stored.pauses,
                                         *stored.starts))
            # every mark lies inside the six hours shown, the run's start too
            assert all(now - 6 * HOUR <= t <= now for t in (*plot._marks, *plot._events))
            assert plot._start is not None and plot._start <= start
        ttft = screen.query_one("#tune-ttft", Plot)
        assert ttft.series[0].times[0] < start + HOUR  # the stored figures, from the run's start
        drawn = str(ttft.render()).splitlines()[1:-2]  # the canvas, between legend and axis
        assert sum("┊" in row for row in drawn) >= 3  # the marks cross the chart
