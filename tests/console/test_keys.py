"""Keys: entering a screen focuses no field, so 1–5 switch screens at any speed; Enter starts
an edit. With a field focused digits type into it, while `?`, `q`, F1–F5 and (after Escape)
the screen digits still work; a filter box takes every letter."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Input, Static

from console.sources.embedded import EmbeddedSource
from console.tui.app import TokenflowApp
from console.tui.keymap import CHARACTERS, COMMANDS, after_escape, typed_into
from console.tui.screens.drift import DriftScreen
from console.tui.screens.help import HelpScreen
from console.tui.screens.live import LiveScreen
from console.tui.screens.slow_queries import SlowQueriesScreen
from console.tui.screens.tuning import TuningScreen
from console.tui.widgets.keyed_table import middle_cut
from console.tui.widgets.requests_table import RequestsTable
from tests.console.conftest import (
    FAST_POLL_S,
    UI_ENGINE,
    replay_app,
    replayed,
    until,
    workers_done,
)

pytestmark = pytest.mark.anyio


@pytest.mark.slow  # every screen's keys, one by one
async def test_screen_keys_help_and_quit_work_with_a_field_focused(calibrated_db: Path) -> None:
    # two requests, not endless traffic: a busy process makes every key press wait for idle
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="chat",
                                  db=calibrated_db, config=UI_ENGINE,
                                  num_requests=2, repeat=False)
    app = TokenflowApp(source, interval=FAST_POLL_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        tuning = app.screen
        assert isinstance(tuning, TuningScreen)
        box = tuning.query_one("#input-max_num_batched_tokens", Input)
        await until(pilot, lambda: box.value, "the form filled from a snapshot")
        live_budget = box.value
        assert not isinstance(app.focused, Input)  # entering a screen focuses no field
        await pilot.press("2", "3", "1")  # screen keys, at speed: no field takes them
        assert isinstance(app.screen, LiveScreen)
        await pilot.press("2")
        assert app.screen is tuning and not isinstance(app.focused, Input)
        assert box.value == live_budget
        await pilot.press("enter")  # Enter starts an edit, in the first field
        first = app.focused
        assert isinstance(first, Input) and first.id == "input-arrival_rate"
        await pilot.press("escape")
        assert app.focused is None
        box.focus()
        box.value = ""
        await pilot.press("5", "1", "2")  # digits are the field's
        assert box.value == "512" and app.screen is tuning

        await pilot.press("question_mark")  # help, even from the field
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("question_mark")
        assert app.screen is tuning and box.value == "512"

        await pilot.press("f3")  # F-keys switch whatever is focused
        assert isinstance(app.screen, SlowQueriesScreen)
        await pilot.press("2")  # coming back leaves the field: 2 was a screen key
        assert app.screen is tuning and not isinstance(app.focused, Input)
        assert box.value == live_budget  # leaving the screen dropped the unapplied edit
        box.focus()
        await pilot.press("escape", "4")  # Escape leaves the field; 4 is a screen key again
        assert isinstance(app.screen, DriftScreen)

        await pilot.press("2")
        box.focus()
        await pilot.pause()
        await pilot.press("q")  # q from inside a field
        await workers_done(pilot)
        assert not app.is_running


async def test_a_filter_box_takes_letters_and_escape_leaves_it() -> None:
    async with replay_app().run_test(size=(120, 40)) as pilot:
        await replayed(pilot)
        app = pilot.app
        await pilot.press("slash", "q", "c")
        box = app.focused
        assert isinstance(box, Input) and box.value == "qc" and app.is_running
        await pilot.press("escape", "3")
        assert isinstance(app.screen, SlowQueriesScreen)
        await pilot.press("1")
        assert isinstance(app.screen, LiveScreen)

        number = Input(type="number")  # what a Field takes: the characters its type allows
        assert typed_into(number, "5") and not typed_into(number, "c")
        assert not typed_into(number, "question_mark") and not typed_into(number, "f1")
        assert typed_into(Input(), "q") and not typed_into(None, "q")


def test_ids_are_cut_in_the_middle() -> None:
    assert middle_cut("long-doc-00017", 14) == "long-doc-00017"
    assert middle_cut("long-doc-00017-3", 14) == "long-do…0017-3"
    assert middle_cut("long-doc-00017-3", 14) != middle_cut("long-doc-00018-3", 14)


async def test_a_filter_that_hides_every_row_says_so_not_that_none_exist() -> None:
    async with replay_app().run_test(size=(120, 40)) as pilot:
        await replayed(pilot)
        table = pilot.app.screen.query_one(RequestsTable)
        rows = len(table.rows)
        assert rows > 0
        await pilot.press("slash", "z", "z", "z")
        note = str(table.query_one(".table-empty", Static).render())
        assert note == (f"none of the {rows} rows matches the filter zzz · / edits it, Escape "
                        "clears it")
        await pilot.press("escape")
        assert not table.query_one(".table-empty", Static).display


def test_a_command_key_after_a_quick_escape_is_the_key_textual_reports() -> None:
    # The keymap keeps to Textual's public API; this holds its copy to Textual's own table of
    # what Escape and a character sent at once read as (a digit: macOS's Option character).
    from textual._ansi_sequences import ANSI_SEQUENCES_KEYS
    from textual.keys import _character_to_key

    for key in [key for c in COMMANDS for key in c.keys] + list("0123456789"):
        character = CHARACTERS.get(key, key)
        if len(character) != 1:
            assert after_escape(key) is None
            continue
        meant = ANSI_SEQUENCES_KEYS.get("\x1b" + character)
        reported = _character_to_key(meant) if isinstance(meant, str) else f"alt+{key}"
        assert after_escape(key) == reported, key
