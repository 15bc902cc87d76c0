"""Shared fixtures: the recorded session replayed step by step, a frozen, quiet UI, and waits
on workers and messages (never on a fixed time)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from textual.app import App
from textual.notifications import Notification, Notifications
from textual.pilot import Pilot
from textual.widgets import Input
from textual.worker import WorkerCancelled

from console.sources.embedded import EmbeddedSource
from console.sources.process import preloaded
from console.sources.replay import ReplaySource
from console.tui.app import POLL_INTERVAL_S, TokenflowApp
from console.tui.screens.tuning import TuningScreen
from engine.config import EngineConfig
from engine.serve.session import EngineSession

SESSION = Path(__file__).parent / "data" / "session.jsonl"
# live sources are polled often enough for a test's conditions to come soon, and seldom
# enough that the process goes idle between polls: Textual's pilot waits for an idle
# moment (up to 1 s) at every key press and pause
FAST_POLL_S = 0.1
# a recording's snapshots are shown one per poll, unpainted until the last (`replayed`):
# the replay waits on this interval, not on work, so it is as short as the timers allow
REPLAY_POLL_S = 0.005
# the UI tests' engines: float32 (what "auto" is on the CPU) and a KV pool for the few
# requests they play (2,048 blocks of tiny), not the CPU default's, which each start faults in
UI_ENGINE = EngineConfig(dtype="float32", kv_cache_bytes=16 << 20)
# the engine processes the tests start fork from a server (one per worker) that imported the
# engine once: a spawned one imports torch again, seconds of CPU each. The tests of what only
# the console's own start method shows (a killed child's exit code) spawn theirs.
ENGINE_PROCESSES = preloaded()
MAX_ROUNDS = 2000  # a bound on rounds of real waits, so a broken condition fails, not hangs
WORKERS_GUARD_S = 30.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def frozen_ui(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Wall-clock columns in UTC and no blinking cursor, so screens render the same anywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    monkeypatch.setattr(Input, "cursor_blink", False)
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture(autouse=True)
def notifications_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every notification an app raises is kept for `notified`, expired or not."""
    add = Notifications.add

    def keeping(self: Notifications, notification: Notification) -> Notifications:
        self.__dict__.setdefault("raised", []).append(notification)
        return add(self, notification)

    monkeypatch.setattr(Notifications, "add", keeping)


@pytest.fixture(scope="session")
def calibrated_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store, migrated, holding the first calibration of synthetic:tiny on the CPU (float32,
    as "auto" is there): made once per worker."""
    db = tmp_path_factory.mktemp("calibrated") / "template.db"
    config = dataclasses.replace(UI_ENGINE, model="synthetic:tiny", device="cpu")
    with EngineSession.start(config, db=db, journal=False) as session:
        assert session.first_calibration is not None
    return db


@pytest.fixture
def calibrated_db(calibrated_template: Path, tmp_path: Path) -> Path:
    """A new store already calibrated for synthetic:tiny, for tests whose claim is not the
    first calibration: it would run beside their traffic, and a busy process makes every
    key press and pause wait for idle (up to a second each). The calibration's provenance
    names the template's path, where it was measured."""
    db = tmp_path / "calibrated.db"
    shutil.copyfile(calibrated_template, db)
    return db


def notified(app: App[object]) -> list[Notification]:
    """The notifications `app` raised, in order. A toast expires after a few real seconds,
    which a loaded machine may spend between two rounds of a test: read this, not the toasts."""
    return list(app._notifications.__dict__.get("raised", []))


def replay_app() -> TokenflowApp:
    """The console on the recorded session, one snapshot per (fast) poll."""
    return TokenflowApp(ReplaySource(SESSION, speed=0), interval=REPLAY_POLL_S)


async def workers_done(pilot: Pilot) -> None:
    """Wait for every worker in flight (store reads, config changes, the snapshot poll) and
    for the messages they posted to be handled. The bound is a hang guard, not a timing: on
    a loaded machine a snapshot test once waited forever on a worker that never settled, so
    after WORKERS_GUARD_S the round ends and the caller's condition decides."""
    # a worker the test cancelled (collector.stop()) has nothing left to wait for
    with contextlib.suppress(TimeoutError, WorkerCancelled):
        await asyncio.wait_for(pilot.app.workers.wait_for_complete(), WORKERS_GUARD_S)
    await pilot.pause()


async def until(pilot: Pilot, condition: Callable[[], object], what: str = "condition") -> None:
    """Wait, round by round, until `condition()` holds. Each round waits for the workers in
    flight and for their messages to be handled (the next poll is armed as one ends)."""
    for _ in range(MAX_ROUNDS):
        if condition():
            return
        await workers_done(pilot)
    raise AssertionError(f"{what} not reached after {MAX_ROUNDS} rounds of workers")


async def replayed(pilot: Pilot) -> None:
    """Wait until every recorded snapshot has been shown, so the picture is the final one.

    The screen is painted once, at the end: every snapshot still reaches the widgets, but a
    paint per snapshot (~90 ms on 2 cores) was most of a replaying test's time."""
    app = pilot.app
    assert isinstance(app, TokenflowApp)
    source = app.source
    assert isinstance(source, ReplaySource)
    state = app.state
    with app.batch_update():
        await until(pilot, lambda: source.finished and state.latest is not None
                    and state.history.last_step == state.latest.step, "the end of the replay")
    # then the console's own pace: polls every few ms keep the process busy, and every pilot
    # pause and key press waits for an idle moment (up to 1 s each)
    app.collector.interval = POLL_INTERVAL_S
    await pilot.pause()


def chat_console(db: Path, num_requests: int) -> TokenflowApp:
    """The console on `db`'s store: synthetic:tiny serving `num_requests` of chat, once."""
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="chat", db=db,
                                  config=UI_ENGINE,
                                  num_requests=num_requests, repeat=False)
    return TokenflowApp(source, interval=FAST_POLL_S)


async def tuning_shown(pilot: Pilot) -> TuningScreen:
    """Switch to Tuning (2) and wait for its form to fill from the engine's config."""
    await pilot.press("2")
    screen = pilot.app.screen
    assert isinstance(screen, TuningScreen)
    await until(pilot, lambda: screen.query_one(
        "#input-max_num_batched_tokens", Input).value, "the form filled")
    return screen
