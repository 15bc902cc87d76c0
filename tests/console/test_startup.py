"""Start-up on a store another session left: requests it left unfinished (another model's
too) are closed as aborted and announced, as every start closes them, and quarantined ones
are held back and named. A new store's first calibration runs beside the traffic, or is
reused from the default store. The embedded engine runs in its child process, as
`tokenflow-console` starts it; the tests wait on the app's messages and workers."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import func, select
from textual.message import Message

from console.sources.process import ProcessSource
from console.tui.app import TokenflowApp
from console.tui.collectors import SnapshotPolled
from console.tui.screens.live import LiveScreen
from console.tui.screens.splash import EngineStarting
from console.tui.widgets.bandwidth import Bandwidth
from console.tui.widgets.cache_pressure import CachePressure
from console.tui.widgets.chunk_queue import ChunkQueue
from console.tui.widgets.header import EngineHeader
from console.tui.widgets.requests_table import RequestsTable
from engine.calibration.calibrate import FIRST_REASON
from engine.config import SamplingParams
from engine.serve.session import EngineSession
from engine.store import (
    CalibrationRecord,
    calibration_history,
    close_entry,
    default_db_path,
    open_database,
)
from engine.store.models import QUARANTINED, CalibrationRunRow, JournalRow
from engine.store.recovery import ORPHANED
from tests.console.conftest import (
    ENGINE_PROCESSES,
    UI_ENGINE,
    notified,
    until,
    workers_done,
)
from tests.console.test_hostile_text import rendered

pytestmark = [pytest.mark.anyio, pytest.mark.slow]  # starts the console and its engine, calibrating
ROOT = Path(__file__).resolve().parents[2]


def test_the_console_process_never_imports_torch() -> None:
    """The console's own process loads Textual and the screens while the engine's child
    loads torch: importing it here too would double the launch's work on the same cores."""
    # checked as the child is launched, after the console's imports and its argument
    # parsing: whatever it imported first delays the spawn
    launch = ("import sys, console.sources.process as p, console.tui.app as a; seen = []; "
              "p.ProcessSource.launch = classmethod("
              "lambda cls, **o: seen.append('torch' in sys.modules)); "
              "a.run = lambda args, engine, simulate: 0; "
              "from console.cli.console import main; main([]); sys.exit(seen != [False])")
    assert subprocess.run([sys.executable, "-c", launch], cwd=ROOT).returncode == 0


def leave_unfinished(db: Path, model: str, prompts: list[list[int]]) -> list[str]:
    """A session on `db` that stops with `prompts` admitted and unfinished (a crash's
    journal), leaving what earlier ones left as it was; their ids."""
    with EngineSession.start(dataclasses.replace(UI_ENGINE, model=model, device="cpu"),
                             db=db, calibrate=False, resume=True) as session:
        ids = [session.engine.add_request(prompt, SamplingParams(max_tokens=64))
               for prompt in prompts]
        session.engine.step()
    return ids


# tiny's first calibration lasts about a second: on a fast CPU it can end before the first
# Poisson arrival at the chat workload's rate, so the tests that watch it send all at once.
# On repeat: once the traffic ends no step publishes a snapshot, and the last one published
# says "calibrating" after the calibration's end
ALL_AT_ONCE = {"rate": float("inf"), "num_requests": 32}
# the tests of what a start announces need a snapshot, not endless traffic (on a store
# calibrated already: the first calibration is not what they watch)
TWO_REQUESTS = {"num_requests": 2, "repeat": False}


def console(db: Path, **workload: float | int | bool) -> TokenflowApp:
    engine = ProcessSource.launch(ENGINE_PROCESSES, model="synthetic:tiny", device="cpu",
                                  workload="chat", db=db, **workload)
    return TokenflowApp(engine, interval=0.05, starting=True)


async def test_what_the_last_session_left_is_closed_as_aborted_and_quarantine_held_back(
        calibrated_db: Path) -> None:
    """Requests the last sessions left unfinished (another model's too) are closed as
    aborted and announced; one that killed two resumed runs is kept, held back, and shown,
    and is no orphan."""
    db = calibrated_db
    [poisoned] = leave_unfinished(db, "synthetic:tiny", [[5] * 40])
    database = open_database(db)
    try:
        with database.session() as session:
            close_entry(session, poisoned, QUARANTINED, "quarantined: test")
    finally:
        database.close()
    left = [*leave_unfinished(db, "synthetic:small", [[400, 401, 402, 480]]),  # beyond tiny's
            *leave_unfinished(db, "synthetic:tiny", [[5] * 40, [7] * 60])]
    app = console(db, **TWO_REQUESTS)
    async with app.run_test(size=(120, 40)) as pilot:
        # 3, not 4: the quarantined request is no orphan
        await until(pilot, lambda: any("closed 3 request(s) the last session left unfinished"
                                       in n.message for n in notified(app)), "the notice")
        await until(pilot, lambda: any("1 request(s) quarantined" in n.message
                                       and poisoned in n.message
                                       and "release-quarantine" in n.message
                                       for n in notified(app)), "the announcement")
        await until(pilot, lambda: app.latest is not None, "a snapshot")
        assert app.latest is not None
        assert not {r.id for r in app.latest.requests} & {*left, poisoned}
        app.collector.stop()
        await workers_done(pilot)
    database = open_database(db)
    try:
        with database.session() as session:
            rows = session.scalars(select(JournalRow).where(
                JournalRow.request_id.in_([*left, poisoned])))
            states = {r.request_id: (r.state, r.finish_reason) for r in rows}
    finally:
        database.close()
    assert sorted(states[rid] for rid in left) == [("FINISHED", ORPHANED)] * 3
    assert states[poisoned][0] == QUARANTINED


def only_calibration(db: Path) -> CalibrationRecord:
    """The one calibration `db` holds for synthetic:tiny on the CPU."""
    database = open_database(db)
    try:
        with database.session() as session:
            (run,) = calibration_history(session, model="synthetic:tiny", device="cpu")
    finally:
        database.close()
    return run


def live_panes(app: TokenflowApp) -> dict[str, str]:
    """The text the four Live panes and the header show now, or {} before the Live screen."""
    screen = app.screen
    if not isinstance(screen, LiveScreen) or not screen.is_mounted:
        return {}
    return {"header": rendered(screen.query_one(EngineHeader).content),
            "requests": f"{screen.query_one(RequestsTable).table.row_count} rows",
            "chunks": rendered(screen.query_one(ChunkQueue).render()),
            "cache": rendered(screen.query_one(CachePressure).query_one("#kv-gauge").content),
            "bandwidth": rendered(screen.query_one(Bandwidth).query_one("#bandwidth-line")
                                  .content)}


def first_token_and_calibration(db: Path) -> tuple[float, float]:
    """The first token's time in the store's journal, and its first calibration's."""
    database = open_database(db)
    try:
        with database.session() as session:
            first = session.scalar(select(func.min(JournalRow.first_token_at)))
            calibrated = session.scalar(select(func.min(CalibrationRunRow.created_at)))
    finally:
        database.close()
    assert first is not None and calibrated is not None, (first, calibrated)
    return first, calibrated


async def test_the_first_calibration_runs_beside_the_traffic_the_panes_show(
        tmp_path: Path) -> None:
    """On a new store the splash ends once the model is loaded: the four Live panes fill
    with the traffic's numbers (tokens flowing, requests listed, KV blocks in use, a
    bandwidth share) while the header says the first calibration is under way, running
    between the engine's steps, C* and budget_score reading how far it is ("calibrating
    (pass 1/3, shape 7/16)"); then it is stored. It never holds the screen."""
    splash: list[str] = []
    calibrating: list[tuple[str, int]] = []
    shown: dict[str, str] = {}

    def heard(message: Message) -> None:
        if isinstance(message, EngineStarting):
            splash.append(message.what)
        elif isinstance(message, SnapshotPolled):
            snapshot = message.snapshot
            if snapshot.calibration.startswith("calibrating"):
                calibrating.append((snapshot.calibration, len(snapshot.requests)))

    db = tmp_path / "fresh.db"  # no stored calibration, here or in the default store
    app = console(db, **ALL_AT_ONCE)

    def numbers() -> bool:
        latest = app.latest
        if latest is None or latest.tokens_per_s <= 0 or latest.kv_blocks_used == 0:
            return False
        shown.update(live_panes(app), calibration=latest.calibration)
        return bool(shown.get("header"))

    async with app.run_test(size=(120, 40), message_hook=heard) as pilot:
        await until(pilot, numbers, "the Live panes with the traffic's numbers")
        await until(pilot, lambda: app.latest is not None
                    and app.latest.calibration == "calibrated", "the first calibration")
        app.collector.stop()
        await workers_done(pilot)
    assert not any("calibrating" in what for what in splash), splash
    shapes = [(int(m[1]), int(m[2])) for what, _ in calibrating
              if (m := re.search(r"shape (\d+)/(\d+)\)", what))]
    assert shapes, calibrating
    assert any(requests for _, requests in calibrating), "no traffic during the calibration"
    assert only_calibration(db).reason == FIRST_REASON
    if shown["calibration"] == "calibrated":
        # a quiet machine may end the first calibration before the first poll that has numbers:
        # then the store tells whether the traffic's first tokens came while it ran
        first_token, calibrated = first_token_and_calibration(db)
        assert first_token < calibrated, (first_token, calibrated)
    else:
        assert shown["calibration"].startswith("calibrating ("), shown
        assert "calibrating" in shown["header"], shown
    assert re.search(r"[1-9][\d,]* tok/s", shown["header"]), shown
    assert shown["requests"] != "0 rows", shown
    assert re.search(r"\d+ chunks queued · \d+ prefilling", shown["chunks"]), shown
    assert re.search(r"[1-9]\d*/\d+ blocks", shown["cache"]), shown
    assert re.search(r"\d+%|GB/s", shown["bandwidth"]), shown


async def test_a_new_store_reuses_the_default_stores_calibration(
        calibrated_template: Path, tmp_path: Path) -> None:
    """A calibration stored for the same model and device in the default store is copied
    into a new --db and used at once: no second first calibration."""
    default_db_path().parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(calibrated_template, default_db_path())  # the default store, calibrated
    stored = only_calibration(default_db_path())
    splash: list[str] = []

    def heard(message: Message) -> None:
        if isinstance(message, EngineStarting):
            splash.append(message.what)

    db = tmp_path / "new.db"
    app = console(db)
    async with app.run_test(size=(120, 40), message_hook=heard) as pilot:
        await until(pilot, lambda: app.latest is not None, "a snapshot")
        assert app.latest.calibration == "calibrated"
        # marked until a calibration measured here replaces it, naming where it was measured
        reused = app.latest.calibration_reused
        assert reused.startswith("reused: measured ") and "on a quiet host" in reused
        assert f"stored in sqlite:///{calibrated_template}" in reused
        assert "CALIBRATION REUSED" in str(app.screen.query_one(EngineHeader).render())
        app.collector.stop()
        await workers_done(pilot)
    assert any(f"reusing calibration {stored.id} of {default_db_path()}" in what
               for what in splash), splash
    run = only_calibration(db)
    assert run.reason.endswith("reused") and run.params == stored.params
