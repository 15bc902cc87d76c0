"""One rule for the Tuning form's focus: a screen key always acts unless a field is being
edited. Keys sent in one burst (as a terminal delivers fast typing, or typing under load) are
applied in the order they were sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from textual import events
from textual.pilot import Pilot
from textual.widgets import Input

from console.sources.embedded import EmbeddedSource
from console.tui.app import TokenflowApp
from console.tui.collectors import ConfigApplied
from console.tui.screens.drift import DriftScreen
from console.tui.screens.slow_queries import SlowQueriesScreen
from console.tui.screens.tuning import STALE_SNAPSHOTS, TuningScreen
from console.tui.widgets.keyed_table import KeyedTable
from tests.console.conftest import FAST_POLL_S, UI_ENGINE, until, workers_done

pytestmark = [pytest.mark.anyio, pytest.mark.slow]  # the console with an engine, tuned live

CHARACTERS = {"backspace": None, "escape": "\x1b", "enter": "\r", "tab": "\t",
              "ctrl+s": None, "ctrl+r": None, "shift+tab": None, "slash": "/"}


@pytest.fixture
async def form(calibrated_db: Path) -> AsyncIterator[tuple[TokenflowApp, Pilot, TuningScreen]]:
    # two requests, not endless traffic: a busy process makes every key press wait for idle
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="chat",
                                  db=calibrated_db, config=UI_ENGINE,
                                  num_requests=2, repeat=False)
    app = TokenflowApp(source, interval=FAST_POLL_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        screen = app.screen
        assert isinstance(screen, TuningScreen)
        box = screen.query_one("#input-max_num_batched_tokens", Input)
        await until(pilot, lambda: box.value, "the form filled from a snapshot")
        yield app, pilot, screen


async def burst(pilot: Pilot, *keys: str) -> None:
    """Send `keys` all at once, as a terminal hands over a fast typist's keys, then wait for
    them (and what they started) to be handled."""
    driver = pilot.app._driver
    assert driver is not None
    for key in keys:
        character = CHARACTERS.get(key, key if len(key) == 1 else None)
        event = events.Key(key, character)
        event.set_sender(pilot.app)
        driver.send_message(event)
    await workers_done(pilot)


def field(screen: TuningScreen, name: str) -> Input:
    return screen.query_one(f"#input-{name}", Input)


async def test_keystrokes_in_a_burst_land_in_the_order_sent(form) -> None:
    app, pilot, screen = form
    box = field(screen, "max_num_batched_tokens")
    screen.set_focus(box)
    box.value = ""
    await burst(pilot, "4", "2", "4", "backspace", "backspace", "backspace", "7")
    assert box.value == "7" and app.screen is screen
    await burst(pilot, "backspace", "3", "8", "4", "left", "backspace", "1")
    assert box.value == "314"


async def test_tab_and_enter_start_an_edit_whose_typing_replaces_the_value(form) -> None:
    app, pilot, screen = form
    rate, budget = field(screen, "arrival_rate"), field(screen, "max_num_batched_tokens")
    assert app.focused is None and "Enter or Tab: edit" in str(
        screen.query_one("#tuning-form").border_subtitle)
    await burst(pilot, "tab", "tab")  # two Tabs: the second field, not the first
    assert app.focused is budget
    assert "editing Token budget: typing replaces" in str(
        screen.query_one("#tuning-form").border_subtitle)
    await burst(pilot, "shift+tab")
    assert app.focused is rate
    await burst(pilot, "escape", "enter", "tab", "5", "1", "2")  # typed at once after Tab
    assert app.focused is budget and budget.value == "512"
    await burst(pilot, "ctrl+r", "tab")  # after a refresh, Tab still starts an edit
    assert app.focused is rate and budget.value != "512"


async def test_apply_ends_the_edit_so_the_next_digit_is_a_screen_key(form) -> None:
    app, pilot, screen = form
    engine = app.source.loop.engine
    budget = field(screen, "max_num_batched_tokens")
    for apply, value, then in (("enter", "384", "3"), ("ctrl+s", "320", "4")):
        await pilot.press("2")
        assert app.screen is screen and app.focused is None
        # the edit, the apply and the screen key in one burst: the digit is never typed
        await burst(pilot, "tab", "tab", *value, apply, then)
        await until(pilot, lambda v=int(value): engine.config.max_num_batched_tokens == v,
                    f"{value} applied")
        assert isinstance(app.screen, SlowQueriesScreen if then == "3" else DriftScreen)
        assert budget.value == value and screen.focused is None
    assert screen.query_one("#input-slow_query_threshold", Input).value == shown_threshold(app)


def shown_threshold(app: TokenflowApp) -> str:
    return f"{app.source.loop.engine.config.slow_query_threshold:g}"


async def test_escape_refresh_and_leaving_drop_unapplied_text(form) -> None:
    """A stray edit never outlives its visit, so an untouched field never blocks an Apply."""
    app, pilot, screen = form
    engine = app.source.loop.engine
    slow = field(screen, "slow_query_threshold")
    live = slow.value
    before = engine.config.slow_query_threshold
    for leave in (("escape",), ("ctrl+r",), ("f4", "2")):
        screen.set_focus(slow)
        slow.value = "31"  # out of range: it would block an Apply
        await pilot.pause()
        assert slow.has_class("error")
        await burst(pilot, *leave)
        assert app.screen is screen and app.focused is None, leave
        assert slow.value == live and not slow.has_class("error"), leave
    budget = field(screen, "max_num_batched_tokens")
    await burst(pilot, "tab", "tab", "4", "4", "8", "enter")
    await until(pilot, lambda: engine.config.max_num_batched_tokens == 448, "448 applied")
    assert engine.config.slow_query_threshold == before and budget.value == "448"


async def test_a_refused_apply_ends_the_edit_and_marks_the_field(form) -> None:
    app, pilot, screen = form
    engine = app.source.loop.engine
    before = engine.config
    budget = field(screen, "max_num_batched_tokens")
    live = budget.value
    await burst(pilot, "tab", "tab", "9", "enter")  # 9 is below the budget's floor
    assert budget.has_class("error") and budget.value == "9" and app.focused is None
    await burst(pilot, "1", "2")  # the edit ended: screen keys; leaving dropped the 9
    assert app.screen is screen and budget.value == live and not budget.has_class("error")
    assert engine.config == before


async def test_the_changes_table_shows_an_enter_applied_change_at_once(form) -> None:
    _, pilot, screen = form
    table = screen.query_one("#config-changes", KeyedTable)
    changes = table.table
    await burst(pilot, "tab", "tab", "4", "1", "6", "enter")
    await until(pilot, lambda: changes.row_count == 1, "the budget's change listed")
    await burst(pilot, "tab", "1", ".", "5", "enter")  # the arrival rate, stored too
    await until(pilot, lambda: changes.row_count == 2, "the rate's change listed")
    newest = table.rows[changes.get_row_at(0)[0].key]  # the newest change on top
    assert (newest.cells[1], newest.cells[3]) == ("Arrival rate /s", "1.5")


async def test_the_changes_filter_takes_enter_and_escape_not_the_form(form) -> None:
    """`/` on the changes table opens its filter; Enter there closes it and Escape clears
    it, without applying or dropping anything in the form."""
    app, pilot, screen = form
    changes = screen.query_one("#config-changes", KeyedTable)
    await burst(pilot, "tab", "tab", "4", "1", "6", "enter")
    await until(pilot, lambda: changes.table.row_count == 1, "the budget's change listed")
    budget = field(screen, "max_num_batched_tokens")
    await burst(pilot, "tab", "tab", "5", "1", "2")  # an edit left unapplied
    changes.table.focus()
    await pilot.pause()
    assert app.focused is changes.table
    await burst(pilot, "slash", "b", "u", "d", "enter")  # typed at once behind the `/`
    box = changes.query_one(Input)
    assert box.value == "bud" and app.focused is changes.table  # Enter closed the box
    assert budget.value == "512" and budget.has_class("edited")  # nothing was applied
    assert changes.table.row_count == 1  # "Token budget" matches
    # reopened, the box selects its text (typing replaces it); in the open box `/` is text
    await burst(pilot, "slash", "slash", "x")
    assert box.value == "/x" and changes.table.row_count == 0
    await burst(pilot, "escape")
    assert box.value == "" and not box.display and app.focused is changes.table
    assert changes.table.row_count == 1 and budget.value == "512"


async def test_a_snapshot_taken_before_an_apply_does_not_put_the_old_value_back(form) -> None:
    app, pilot, screen = form
    app.collector.stop()  # the snapshots arrive only as the test hands them over
    await workers_done(pilot)  # a poll in flight lands now, not after the apply
    budget = field(screen, "max_num_batched_tokens")
    stale = app.state.latest
    assert stale is not None and stale.config["max_num_batched_tokens"] == 256
    screen.post_message(ConfigApplied({"max_num_batched_tokens": 448}))
    await until(pilot, lambda: budget.value == "448", "the form shows the applied 448")
    for _ in range(STALE_SNAPSHOTS - 1):  # polled before the apply, delivered after it
        screen.show_snapshot(stale)
        assert budget.value == "448" and not budget.has_class("edited")
    screen.show_snapshot(replace(stale, config={**stale.config, "max_num_batched_tokens": 448}))
    screen.show_snapshot(stale)  # shown once, the applied value is live: the form follows
    assert budget.value == "256"


async def test_a_change_made_elsewhere_shows_after_the_stale_snapshots(form) -> None:
    app, pilot, screen = form
    app.collector.stop()
    await workers_done(pilot)  # a poll in flight lands now, not after the apply
    budget = field(screen, "max_num_batched_tokens")
    stale = app.state.latest
    assert stale is not None
    screen.post_message(ConfigApplied({"max_num_batched_tokens": 448}))
    await until(pilot, lambda: budget.value == "448", "the form shows the applied 448")
    for _ in range(STALE_SNAPSHOTS):  # never shows 448: another hand changed it meanwhile
        screen.show_snapshot(stale)
    assert budget.value == "256"
