"""A restart of the engine is an event the console shows, and a worker's error is a
notification and a log line, never a traceback over the screen."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from console.sources.replay import ReplaySource
from console.tui.app import TokenflowApp
from console.tui.collectors import SnapshotCollector, SourceFailed
from engine.snapshot import Snapshot
from tests.console.conftest import REPLAY_POLL_S, SESSION, notified, until
from tests.console.test_collectors import Inbox


def test_a_poller_survives_any_exception_and_names_it(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    source = ReplaySource(SESSION, speed=0)
    inbox = Inbox()
    collector = SnapshotCollector(inbox, source, interval=0.0)  # type: ignore[arg-type]

    def broken() -> Snapshot:
        raise ZeroDivisionError("a bug in a source")

    with monkeypatch.context() as patch, caplog.at_level(logging.ERROR):
        patch.setattr(source, "snapshot", broken)
        collector._collect()
    failed = inbox.messages[-1]
    assert isinstance(failed, SourceFailed)
    assert failed.error == "ZeroDivisionError: a bug in a source (traceback in the log)"
    assert "ZeroDivisionError" in caplog.text and "Traceback" in caplog.text
    collector._collect()  # and it polls again
    assert inbox.snapshots()


@pytest.mark.anyio
async def test_each_engine_restart_is_a_notification(monkeypatch: pytest.MonkeyPatch) -> None:
    source = ReplaySource(SESSION, speed=0)
    recorded = source.snapshot
    polls = 0

    def restarting() -> Snapshot:
        nonlocal polls
        polls += 1
        return dataclasses.replace(recorded(), engine_restarts=polls // 3,
                                   engine_fault="RuntimeError('[b]x[/b]') at step.py:7")

    monkeypatch.setattr(source, "snapshot", restarting)
    app = TokenflowApp(source, interval=REPLAY_POLL_S)
    async with app.run_test() as pilot:
        def restarts() -> list[str]:
            return [n.message for n in notified(app) if n.title == "engine restarted"]

        await until(pilot, lambda: len(restarts()) >= 2, "two restarts shown")
        assert restarts()[:2] == [
            f"restart {n} after RuntimeError('[b]x[/b]') at step.py:7" for n in (1, 2)]
