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


SIZES = [(120, 40), (80, 24)]


@pytest.mark.parametrize("size", SIZES)
def test_live(snap_compare, size: tuple[int, int]) -> None:
    assert snap_compare(replay_app(), terminal_size=size, run_before=settle)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("key", ["2", "3", "4", "5", "0", "question_mark"])
def test_screen(snap_compare, key: str, size: tuple[int, int]) -> None:
    async def show(pilot: Pilot) -> None:
        await settle(pilot)
        await pilot.press(key)
        await workers_done(pilot)
        pilot.app.clear_notifications()

    assert snap_compare(replay_app(), terminal_size=size, run_before=show)


@pytest.mark.parametrize("size", SIZES)
def test_slow_query_detail(snap_compare, size: tuple[int, int]) -> None:
    assert snap_compare(replay_app(), terminal_size=size, run_before=open_slow_query)


@pytest.mark.parametrize("size", SIZES)
def test_request_detail(snap_compare, size: tuple[int, int]) -> None:
    """Enter on the top Live row: its timeline if it is a stored slow query, else its row."""
    async def open_request(pilot: Pilot) -> None:
        await settle(pilot)
        await pilot.press("enter")
        await workers_done(pilot)

    assert snap_compare(replay_app(), terminal_size=size, run_before=open_request)
