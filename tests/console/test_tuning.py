"""The tuning flow on a real embedded engine: bad values refused inline, good ones applied
live and stored."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Static

from console.sources.embedded import EmbeddedSource
from console.tui.app import TokenflowApp
from console.tui.screens.tuning import TuningScreen
from console.tui.widgets.keyed_table import KeyedTable
from tests.console.conftest import FAST_POLL_S, UI_ENGINE, until, workers_done

pytestmark = [pytest.mark.anyio, pytest.mark.slow]  # the console with an engine, tuned live


@pytest.fixture
async def tuning(calibrated_db: Path) -> AsyncIterator[tuple[TokenflowApp, Pilot, TuningScreen]]:
    # two requests, not endless traffic: a busy process makes every key press wait for idle
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="chat",
                                  db=calibrated_db, config=UI_ENGINE,
                                  num_requests=2, repeat=False)
    app = TokenflowApp(source, interval=FAST_POLL_S)
    heard: list[str] = []
    notify = app.notify

    def hear(message: str, *args: Any, **kwargs: Any) -> None:
        heard.append(str(message))
        notify(message, *args, **kwargs)

    app.notify = hear  # type: ignore[method-assign]
    app.heard = heard  # type: ignore[attr-defined]
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        screen = app.screen
        assert isinstance(screen, TuningScreen)
        box = screen.query_one("#input-max_num_batched_tokens", Input)
        await until(pilot, lambda: box.value, "the form filled from a snapshot")
        yield app, pilot, screen


def said(app: TokenflowApp, words: str) -> bool:
    """Whether a notification holding `words` was shown (kept by `heard`: toasts expire)."""
    return any(words in message for message in app.heard)  # type: ignore[attr-defined]


def note(screen: TuningScreen, field: str) -> str:
    return str(screen.query_one(f"#note-{field}", Static).render())


async def test_a_bad_value_is_refused_inline_and_changes_nothing(tuning) -> None:
    app, pilot, screen = tuning
    engine = app.source.loop.engine
    before = engine.config
    box = screen.query_one("#input-max_num_batched_tokens", Input)
    box.value = "lots"
    await pilot.press("ctrl+s")
    await until(pilot, lambda: box.has_class("error"))
    assert "expected a whole number" in note(screen, "max_num_batched_tokens")
    assert engine.config == before

    # within its own range, but below the chunk tile: the engine's validation names the field
    screen.query_one("#input-chunk_tile", Input).value = "512"
    box.value = "256" if engine.config.max_num_batched_tokens != 256 else "320"
    await pilot.press("ctrl+s")
    await until(pilot, lambda: "chunk_tile" in note(screen, "max_num_batched_tokens"))
    assert engine.config == before


async def test_a_range_error_shows_inline_as_it_is_typed(tuning) -> None:
    """The slow-query threshold that once took 512 meant for the token budget."""
    app, pilot, screen = tuning
    engine = app.source.loop.engine
    before = engine.config
    box = screen.query_one("#input-slow_query_threshold", Input)
    box.value = "512"
    await pilot.pause()  # the Changed message is handled: no apply yet
    assert box.has_class("error") and box.has_class("edited")
    assert note(screen, "slow_query_threshold").startswith("must be at most 10: above 10")
    box.value = "0.5"
    await pilot.pause()
    assert "must be at least 1: a budget_score of 1 is on plan" in note(screen,
                                                                        "slow_query_threshold")
    budget = screen.query_one("#input-max_num_batched_tokens", Input)
    budget.value = "6"  # a digit too few: the message names the lower bound, not the upper
    await pilot.pause()
    assert note(screen, "max_num_batched_tokens").startswith("must be at least 16")
    budget.value = str(engine.config.max_num_batched_tokens)
    await pilot.pause()
    box.value = "512"
    await pilot.pause()
    await pilot.press("ctrl+s")
    await workers_done(pilot)
    assert engine.config == before
    box.value = "2.5"
    await pilot.pause()
    assert not box.has_class("error") and box.has_class("edited")
    await pilot.press("ctrl+s")
    await until(pilot, lambda: engine.config.slow_query_threshold == 2.5)
    await until(pilot, lambda: not box.has_class("edited"), "the form caught up")


async def test_c_says_old_new_and_why_then_unchanged(tuning) -> None:
    """Three presses of `c` at the same load: one change, said as old → new with how C*
    became the budget, then "unchanged" twice (the budget C* is clamped to no longer feeds
    back into it)."""
    app, pilot, screen = tuning
    engine = app.source.loop.engine
    await pilot.press("ctrl+s")
    await until(pilot, lambda: said(app, "unchanged: no field differs"))
    app.source.update_config(max_num_batched_tokens=4096)
    await until(pilot, lambda: app.latest is not None
                and app.latest.config["max_num_batched_tokens"] == 4096
                and app.latest.recommended_token_budget is not None, "a recommendation")
    budget = app.latest.recommended_token_budget
    screen.query_one(DataTable).focus()
    for _ in range(3):
        await pilot.press("c")
        await until(pilot, lambda: engine.config.max_num_batched_tokens == budget
                    and app.latest.config["max_num_batched_tokens"] == budget, "applied")
        await workers_done(pilot)
    changed = [m for m in app.heard if m.startswith("budget 4096 → ")]
    assert len(changed) == 1 and changed[0].startswith(f"budget 4096 → {budget} (C* ")
    assert changed[0].endswith(" decodes, rounded to tiles)")
    unchanged = [m for m in app.heard if m.startswith("unchanged: the token budget")]
    assert len(unchanged) == 2, app.heard
    assert unchanged[0].startswith(f"unchanged: the token budget is already {budget} (C* ")


async def test_the_arrival_rate_is_a_live_knob(tuning) -> None:
    app, pilot, screen = tuning
    loop = app.source.loop
    box = screen.query_one("#input-arrival_rate", Input)
    await until(pilot, lambda: box.value, "the rate read from a snapshot")
    assert float(box.value) == pytest.approx(loop.arrival_rate, rel=0.01)  # three figures
    box.value = "0.5"
    await pilot.press("ctrl+s")
    await until(pilot, lambda: loop.arrival_rate == pytest.approx(0.5))
    await until(pilot, lambda: app.latest.workload_rate == pytest.approx(0.5))
    await until(pilot, lambda: not box.has_class("edited"), "the form caught up")


async def test_a_good_value_is_applied_live_and_stored(tuning) -> None:
    app, pilot, screen = tuning
    engine = app.source.loop.engine
    box = screen.query_one("#input-max_num_batched_tokens", Input)
    box.value = "384"
    await pilot.press("ctrl+s")
    await until(pilot, lambda: engine.config.max_num_batched_tokens == 384)
    await until(pilot, lambda: app.latest.config["max_num_batched_tokens"] == 384)
    assert not box.has_class("error")
    app.source.writer.flush(10.0)
    screen.on_screen_resume()
    changes = screen.query_one("#config-changes", KeyedTable)
    await until(pilot, lambda: changes.table.row_count >= 1)
    [row] = changes.rows.values()
    assert row.cells[1:4] == ("Token budget", "256", "384")


async def test_the_recommended_key_applies_c_star_in_whole_tiles(tuning) -> None:
    app, pilot, screen = tuning
    engine = app.source.loop.engine
    await until(pilot, lambda: app.latest is not None
                and app.latest.recommended_chunk_size is not None)
    tile = engine.config.chunk_tile
    odd = 97 * tile  # a budget C* will not land on, so the change is visible
    app.source.update_config(max_num_batched_tokens=odd)
    await until(pilot, lambda: engine.config.max_num_batched_tokens == odd)
    screen.query_one(DataTable).focus()
    await pilot.press("c")
    await until(pilot, lambda: engine.config.max_num_batched_tokens != odd)
    assert engine.config.max_num_batched_tokens % tile == 0
