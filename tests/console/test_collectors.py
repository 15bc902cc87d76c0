"""The snapshot collector posts a snapshot only when it differs from the last one posted."""

from __future__ import annotations

import itertools

import pytest
from textual.message import Message

from console.sources.replay import ReplaySource
from console.tui.collectors import SnapshotCollector, SnapshotPolled, SourceFailed
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
