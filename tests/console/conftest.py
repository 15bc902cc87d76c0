"""Shared fixtures: the recorded session replayed step by step, and a frozen, quiet UI."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import Input

from console.sources.replay import ReplaySource
from console.tui.app import TokenflowApp

SESSION = Path(__file__).parent / "data" / "session.jsonl"
FAST_POLL_S = 0.02


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


def replay_app() -> TokenflowApp:
    """The console on the recorded session, one snapshot per (fast) poll."""
    return TokenflowApp(ReplaySource(SESSION, speed=0), interval=FAST_POLL_S)


async def replayed(pilot: Pilot) -> None:
    """Wait until every recorded snapshot has been shown, so the picture is the final one."""
    app = pilot.app
    assert isinstance(app, TokenflowApp)
    source = app.source
    assert isinstance(source, ReplaySource)
    for _ in range(2000):
        if source.finished and app.latest is not None and app.history.last_step == app.latest.step:
            break
        await pilot.pause(FAST_POLL_S)
    await pilot.pause()
    assert source.finished, "the replay did not reach its end"
