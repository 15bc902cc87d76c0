"""The tuning flow on a real embedded engine: bad values refused inline, good ones applied
live and stored."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Static

from console.sources.embedded import EmbeddedSource
from console.tui.app import TokenflowApp
from console.tui.screens.tuning import TuningScreen
from engine.config import EngineConfig
from tests.console.conftest import until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def tuning(tmp_path: Path) -> AsyncIterator[tuple[TokenflowApp, Pilot, TuningScreen]]:
    source = EmbeddedSource.start(model="synthetic:tiny", device="cpu", workload="chat",
                                  db=tmp_path / "t.db", config=EngineConfig(dtype="float32"))
    app = TokenflowApp(source, interval=0.05)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        screen = app.screen
        assert isinstance(screen, TuningScreen)
        box = screen.query_one("#input-max_num_batched_tokens", Input)
        await until(pilot, lambda: box.value, "the form filled from a snapshot")
        yield app, pilot, screen


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
    assert "expected int" in note(screen, "max_num_batched_tokens")
    assert engine.config == before

    box.value = "8"  # below the chunk tile: the engine's own validation names the field
    await pilot.press("ctrl+s")
    await until(pilot, lambda: "chunk_tile" in note(screen, "max_num_batched_tokens"))
    assert engine.config == before


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
    changes = screen.query_one("#config-changes", DataTable)
    await until(pilot, lambda: changes.row_count >= 1)
    assert changes.get_row_at(0)[:3] == ["max_num_batched_tokens", "256", "384"]


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
