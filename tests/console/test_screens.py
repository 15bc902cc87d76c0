"""Pilot tests of every screen on the recorded session (no engine needed)."""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import pytest
from rich.console import Console
from textual.command import CommandInput, CommandList, CommandPalette
from textual.widgets import DataTable, Input, Static
from textual.widgets.data_table import ColumnKey

from console.sources.fleet import FleetSource
from console.sources.replay import ReplaySource
from console.tui.app import TokenflowApp
from console.tui.diagnosis import RULES
from console.tui.screens.diagnosis import DiagnosisScreen
from console.tui.screens.drift import DriftScreen
from console.tui.screens.help import HelpScreen
from console.tui.screens.live import LiveScreen
from console.tui.screens.request_detail import RequestDetail
from console.tui.screens.slow_queries import SlowQueriesScreen, SlowQueryDetail
from console.tui.screens.tuning import TuningScreen
from console.tui.widgets.fleet_table import FleetTable
from console.tui.widgets.header import EngineHeader
from console.tui.widgets.keyed_table import KeyedTable
from console.tui.widgets.plot import Plot
from console.tui.widgets.requests_table import (
    COLUMNS,
    SCORE_COLUMN,
    STATE_RANK,
    RequestsTable,
    request_row,
)
from tests.console.conftest import (
    FAST_POLL_S,
    SESSION,
    notified,
    replay_app,
    replayed,
    until,
    workers_done,
)

pytestmark = pytest.mark.anyio
SIZES = [(120, 40), (80, 24)]
PANES = ("Requests", "Chunk queue", "Cache pressure", "Bandwidth", "Latency")


@pytest.mark.parametrize("size", SIZES)
async def test_live_screen_shows_every_pane_with_the_last_snapshot(size: tuple[int, int]) -> None:
    app = replay_app()
    async with app.run_test(size=size) as pilot:
        await replayed(pilot)
        screen = app.screen
        assert isinstance(screen, LiveScreen)
        titles = {str(w.border_title) for w in screen.query("*") if w.border_title}
        assert set(PANES) <= titles
        latest = app.latest
        assert latest is not None
        table = screen.query_one(RequestsTable).table
        assert table.row_count == len(latest.requests)
        assert {str(k.value) for k in table.rows} == {r.id for r in latest.requests}
        header = str(screen.query_one(EngineHeader).render())
        assert latest.mode in header and "budget 256" in header


async def test_requests_rows_are_updated_in_place_and_filter_and_sort() -> None:
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await replayed(pilot)
        requests = app.screen.query_one(RequestsTable)
        table = requests.table
        first_keys = list(table.rows)
        table.move_cursor(row=2)
        requests.update_from(app.latest)  # the same snapshot again: nothing moves
        assert list(table.rows) == first_keys and table.cursor_row == 2

        needle = app.latest.requests[0].id
        table.focus()
        await pilot.press("slash")
        # the whole id at once (typing into the box: test_keys); each letter typed would
        # filter and draw the table again
        requests.query_one(Input).value = needle
        await pilot.pause()
        assert table.row_count == 1 < len(app.latest.requests)
        await pilot.press("escape")
        assert table.row_count == len(app.latest.requests)

        # By default: running first, then waiting, then done; the worst budget_score first.
        assert (requests.sort_index, requests.reverse) == (SCORE_COLUMN, True)
        assert "budget_score ▼" in str(table.columns[ColumnKey("score")].label)
        ids = [row.key.value for row in table.ordered_rows]
        order = [requests.rows[i].sort_values[SCORE_COLUMN] for i in ids]
        assert order == sorted(order, reverse=True)
        ranks = [STATE_RANK.get(requests.rows[i].cells[2].plain, 0) for i in ids]
        assert ranks == sorted(ranks, reverse=True) and ranks[0] == 2
        await pilot.press("O")  # reversed: the arrow turns
        assert "budget_score ▲" in str(table.columns[ColumnKey("score")].label)


async def test_a_requests_cached_share_shows_in_its_row_and_its_detail() -> None:
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await replayed(pilot)
        view = dataclasses.replace(app.latest.requests[0], prompt_tokens=400, cached_tokens=300)
        cached = [c.key for c in COLUMNS].index("cached")
        assert request_row(view, 2.0).cells[cached] == "75%"
        assert request_row(dataclasses.replace(view, cached_tokens=0), 2.0).cells[cached] == "–"
        requests = app.screen.query_one(RequestsTable)
        assert cached in requests.shown_columns  # wide enough at 120 columns
        # the first columns to go as the table narrows: the rare resume mark, then the
        # cached share, before the tenant
        resumed = [c.key for c in COLUMNS].index("resumed")
        narrower = [requests.fitting(w)[0] for w in range(requests.size.width, 0, -1)]
        drops = [shown for shown in narrower if len(shown) < len(COLUMNS)]
        assert drops[0] == tuple(i for i in range(len(COLUMNS)) if i != resumed)
        second = next(shown for shown in drops if len(shown) < len(COLUMNS) - 1)
        assert second == tuple(i for i in range(len(COLUMNS)) if i not in (resumed, cached))

        await app.push_screen(RequestDetail(view))
        await pilot.pause()
        printer = Console(width=200, record=True, file=io.StringIO())
        printer.print(app.screen.query(Static).first().content)
        assert ("400 prompt tokens, 300 (75%) found in the prefix cache, never prefilled"
                in printer.export_text())


async def test_a_resumed_request_is_marked_in_its_row_and_its_detail() -> None:
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await replayed(pilot)
        latest = app.latest
        view = dataclasses.replace(latest.requests[0], resumed_tokens=37)
        column = [c.key for c in COLUMNS].index("resumed")
        assert request_row(view, 2.0).cells[column].plain == "↻ 37"
        # resumed mid-prefill, before its first token, is a resume too
        assert request_row(dataclasses.replace(view, resumed_tokens=0), 2.0
                           ).cells[column].plain == "↻ 0"
        assert request_row(latest.requests[1], 2.0).cells[column].plain == "–"

        requests = app.screen.query_one(RequestsTable)
        requests.update_from(dataclasses.replace(latest, requests=(view, *latest.requests[1:])))
        await pilot.pause()
        table = requests.table
        assert column in requests.shown_columns  # wide enough at 120 columns
        assert table.get_cell(view.id, "resumed").plain == "↻ 37"
        assert table.get_cell(latest.requests[1].id, "resumed").plain == "–"
        # where the column has dropped, the filter still finds them
        table.focus()
        await pilot.press("slash")
        requests.query_one(Input).value = "resumed"
        await pilot.pause()
        assert [row.value for row in table.rows] == [view.id]
        await pilot.press("escape")

        await app.push_screen(RequestDetail(view))
        await pilot.pause()
        printer = Console(width=200, record=True, file=io.StringIO())
        printer.print(app.screen.query(Static).first().content)
        assert ("resumed from the journal after a restart with 37 output tokens already "
                "generated" in printer.export_text())


async def test_slow_queries_list_detail_and_export(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await replayed(pilot)
        await pilot.press("3")
        await workers_done(pilot)
        screen = app.screen
        assert isinstance(screen, SlowQueriesScreen)
        table = screen.query_one(KeyedTable).table
        assert table.row_count == len(app.source.slow_queries()) > 0

        table.focus()
        await pilot.press("enter")
        await pilot.pause()
        detail = app.screen
        assert isinstance(detail, SlowQueryDetail)
        assert detail.query_one("#detail-chunks", DataTable).row_count == len(detail.record.chunks)
        if detail.record.timeline:  # the timeline `slow-queries show` prints, line by line
            lines = str(detail.query_one("#detail-timeline", Static).render())
            assert lines.startswith("end to end ") and "queue wait" in lines
        shown = str(detail.query_one("#detail-config-values", Static).render())
        assert all(f"{name}={value}" in shown for name, value in detail.record.config.items())
        await pilot.press("escape")
        assert isinstance(app.screen, SlowQueriesScreen)
        # a record that knows its prefix-cache hit and its resume says each, once, in the
        # words `slow-queries show` uses
        resumed = dataclasses.replace(detail.record, cached_tokens=96, resumed_tokens=37)
        await app.push_screen(SlowQueryDetail(resumed))
        await pilot.pause()
        shown = "\n".join(str(s.render()) for s in app.screen.query(Static))
        assert resumed.prompt_words() in shown
        assert "96 (" in shown and " found in the prefix cache" in shown
        assert shown.count("resumed from the journal") == 1
        assert "with 37 output tokens already generated" in shown
        await pilot.press("escape")
        assert isinstance(app.screen, SlowQueriesScreen)

        await pilot.press("e")
        await pilot.pause()
        exported = list(tmp_path.glob("slow_queries_*.csv"))
        assert len(exported) == 1
        assert len(exported[0].read_text().splitlines()) == table.row_count + 1


async def test_drift_screen_plots_history_and_reports_a_refused_recalibration() -> None:
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await replayed(pilot)
        await pilot.press("4")
        await workers_done(pilot)
        screen = app.screen
        assert isinstance(screen, DriftScreen)
        plot = screen.query_one(Plot)
        # the first calibration at start, and the two runs the recording adds
        assert len(plot._series[0].values) == len(app.source.calibration_history()) == 3
        assert screen.query_one("#drift-events", KeyedTable).table.row_count == 1
        # A recording cannot recalibrate: r is off the footer, and the pane says why.
        assert "r" not in screen.active_bindings
        note = str(screen.query_one("#recalibration-note", Static).render())
        assert "recalibration is not available on this source" in note
        assert "cannot recalibrate" in note
        await pilot.press("r")
        await workers_done(pilot)
        assert not screen.recalibrating
        assert any("cannot recalibrate" in n.message for n in notified(app))


async def test_diagnosis_screen_lists_every_rule() -> None:
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await replayed(pilot)
        await pilot.press("5")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, DiagnosisScreen)
        rules = screen.query(".rule")
        assert len(rules) == len(RULES)
        summary = str(screen.query_one("#diagnosis-summary", Static).render())
        assert f"of {len(RULES)} symptoms present now" in summary


async def test_tuning_on_a_recording_is_refused_inline_without_change() -> None:
    app = replay_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await replayed(pilot)
        await pilot.press("2")
        await workers_done(pilot)
        screen = app.screen
        assert isinstance(screen, TuningScreen)
        refusal = str(screen.query_one("#tuning-refusal", Static).render())
        assert "tuning is not available on this source" in refusal and "read-only" in refusal
        box = screen.query_one("#input-max_num_batched_tokens", Input)
        assert box.value == "256" and box.disabled  # the recorded value, not editable
        assert "ctrl+s" not in screen.active_bindings
        await pilot.press("ctrl+s")
        await workers_done(pilot)
        assert [n.message for n in notified(app) if "read-only" in n.message]
        assert app.latest.config["max_num_batched_tokens"] == 256
        # the recorded history is still shown: the recording can read it, only not tune
        assert screen.query_one("#config-changes", KeyedTable).table.row_count == 1


async def test_help_pause_and_command_palette() -> None:
    app = replay_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await replayed(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        printer = Console(width=200, record=True, file=io.StringIO())
        printer.print(app.screen.query(Static).first().content)
        keys = printer.export_text()
        assert "Apply C*" in keys and "tuning is not available on this source" in keys
        await pilot.press("escape")
        assert isinstance(app.screen, LiveScreen)

        await pilot.press("p")
        await until(pilot, lambda: app.latest.paused, "paused")
        await pilot.press("p")
        await until(pilot, lambda: not app.latest.paused, "resumed")

        await pilot.press("ctrl+p")
        await pilot.pause()
        assert isinstance(app.screen, CommandPalette)
        # the query at once: each letter typed into the palette took 1.6 s on a 2-core VM
        app.screen.query_one(CommandInput).value = "Diagnosis"
        commands = app.screen.query_one(CommandList)
        await until(pilot, lambda: commands.option_count > 0, "a palette match")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, DiagnosisScreen), "the diagnosis")


def assert_fits(app: TokenflowApp, key: str) -> None:
    tables = [t for t in app.screen.query(DataTable) if t.display and t.row_count]
    assert tables, f"screen {key} shows no table with rows"
    for table in tables:
        assert table.virtual_size.width <= table.scrollable_content_region.width, (
            key, [c.label.plain for c in table.columns.values()])


@pytest.mark.parametrize("size", SIZES)
async def test_no_table_scrolls_sideways_and_times_are_never_cut(size: tuple[int, int]) -> None:
    """Every table on every screen fits its width (columns drop by priority, a fill column
    wraps), and the time that keys the changes and drift events is shown whole."""
    app = replay_app()
    async with app.run_test(size=size) as pilot:
        await replayed(pilot)
        keyed = {}
        for key, table in (("1", ""), ("2", "#config-changes"), ("3", ""),
                           ("4", "#drift-events")):
            await pilot.press(key)
            await workers_done(pilot)
            assert_fits(app, key)
            if table:
                keyed[key] = app.screen.query_one(table, KeyedTable)
        for table in keyed.values():
            cells = [str(table.table.get_row_at(i)[0]) for i in range(table.table.row_count)]
            assert cells and all(re.fullmatch(r"\d\d:\d\d:\d\d", c) for c in cells)
            column = table.table.columns[ColumnKey(table.columns[0].key)]
            assert column.get_render_width(table.table) >= len("00:00:00") + 2
    fleet = FleetSource([ReplaySource(SESSION, speed=0), ReplaySource(SESSION, speed=0)])
    app = TokenflowApp(fleet, interval=FAST_POLL_S)
    async with app.run_test(size=size) as pilot:
        await pilot.press("0")
        await until(pilot, lambda: app.screen.query_one(FleetTable).table.row_count == 2,
                    "both servers listed")
        assert_fits(app, "0")


async def test_next_server_moves_through_a_fleet_of_attached_sources() -> None:
    fleet = FleetSource([ReplaySource(SESSION, speed=0), ReplaySource(SESSION, speed=0)])
    app = TokenflowApp(fleet, interval=FAST_POLL_S)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("n")
        await pilot.pause()
        assert fleet.selected == 1 and fleet.name.startswith("[2/2]")
        await pilot.press("n")
        await pilot.pause()
        assert fleet.selected == 0
