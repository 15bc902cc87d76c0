"""The snapshot collector posts a snapshot only when it differs from the last one posted."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from textual.message import Message

from console.sources.replay import ReplaySource
from console.tui.collectors import (
    QUIET_REDRAW_S,
    QUIET_SLOWDOWN,
    SnapshotCollector,
    SnapshotPolled,
    SourceFailed,
)
from engine.snapshot import Snapshot
from tests.console.conftest import SESSION


class Inbox:
    """What the collector hands the app: its messages (the app's other calls are not used
    while the collector is not running)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    def post_message(self, message: Message) -> bool:
        self.messages.append(message)
        return True

    def snapshots(self) -> list[Snapshot]:
        return [m.snapshot for m in self.messages if isinstance(m, SnapshotPolled)]


def test_a_finished_recording_is_posted_once_and_again_after_a_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    source = ReplaySource(SESSION, speed=0)
    inbox = Inbox()
    collector = SnapshotCollector(inbox, source, interval=0.0)  # type: ignore[arg-type]
    while not source.finished:
        collector._collect()
    posted = inbox.snapshots()
    assert len(posted) > 1 and all(a != b for a, b in itertools.pairwise(posted))
    shown = len(posted)
    for _ in range(3):
        collector._collect()
    assert len(inbox.snapshots()) == shown  # the held last one is not posted again

    def unreadable() -> Snapshot:
        raise OSError("the recording's disk went away")

    with monkeypatch.context() as patch:
        patch.setattr(source, "snapshot", unreadable)
        collector._collect()
    assert isinstance(inbox.messages[-1], SourceFailed)
    collector._collect()  # the same snapshot as before the failure clears it
    assert inbox.snapshots()[-1] is inbox.snapshots()[-2]
    source.pause()
    collector._collect()
    assert inbox.snapshots()[-1].paused  # a change of the paused flag alone is new


def test_an_idle_engine_is_redrawn_seldom_and_polled_slower_until_something_moves() -> None:
    """Snapshots of an idle engine differ in their time alone (and in the last digits of
    their wall-clock offset): one is posted every QUIET_REDRAW_S of the source's clock, and
    the poll slows to QUIET_SLOWDOWN intervals."""
    clock = itertools.count()
    idle = Snapshot(step=7, ts=0.0, wall_offset=1.7e9)
    moving: list[Snapshot] = []

    class Idle:
        name = "idle"

        def snapshot(self) -> Snapshot:
            tick = next(clock)
            return moving.pop() if moving else dataclasses.replace(
                idle, ts=tick * 0.4, wall_offset=1.7e9 + (tick % 3) * 2.4e-7)

    inbox = Inbox()
    collector = SnapshotCollector(inbox, Idle(), interval=0.4)  # type: ignore[arg-type]
    collector.delay = collector.interval
    for _ in range(100):  # 40 s of the source's time
        collector._collect()
    times = [s.ts for s in inbox.snapshots()]
    assert times[0] == 0.0 and len(times) == 1 + int(39.6 // QUIET_REDRAW_S)
    assert all(b - a == pytest.approx(QUIET_REDRAW_S, abs=0.4) for a, b in
               itertools.pairwise(times))
    assert collector.delay == pytest.approx(0.4 * QUIET_SLOWDOWN)
    moving.append(dataclasses.replace(idle, step=8, ts=40.0))
    collector._collect()  # a step: posted at once, and polled at the full rate again
    assert inbox.snapshots()[-1].step == 8 and collector.delay == 0.4
    stepped = dataclasses.replace(inbox.snapshots()[-1], ts=40.4, wall_offset=1.7e9 + 3600)
    moving.append(stepped)
    collector._collect()  # the wall clock stepped: the store's times map elsewhere now
    assert inbox.snapshots()[-1] is stepped
