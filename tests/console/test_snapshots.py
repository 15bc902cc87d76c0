"""SVG snapshots of every screen on the recorded session (update with --snapshot-update)."""

from __future__ import annotations

import pytest
from textual.pilot import Pilot

from tests.console.conftest import replay_app, replayed, workers_done


async def settle(pilot: Pilot) -> None:
    await replayed(pilot)
    pilot.app.clear_notifications()


async def open_slow_query(pilot: Pilot) -> None:
    await settle(pilot)
    await pilot.press("3")
    await workers_done(pilot)
    await pilot.press("enter")
    await workers_done(pilot)


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
def test_live(snap_compare, size: tuple[int, int]) -> None:
    assert snap_compare(replay_app(), terminal_size=size, run_before=settle)


@pytest.mark.parametrize("key", ["2", "3", "4", "5", "question_mark"])
def test_screen(snap_compare, key: str) -> None:
    async def show(pilot: Pilot) -> None:
        await settle(pilot)
        await pilot.press(key)
        await workers_done(pilot)
        pilot.app.clear_notifications()

    assert snap_compare(replay_app(), terminal_size=(120, 40), run_before=show)


def test_slow_query_detail(snap_compare) -> None:
    assert snap_compare(replay_app(), terminal_size=(120, 40), run_before=open_slow_query)
