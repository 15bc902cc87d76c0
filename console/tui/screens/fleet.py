"""The fleet overview: one row per attached server, worst first; Enter opens that server."""

from __future__ import annotations

import time
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import DataTable, Static

from console.sources.fleet import FleetSource, MemberState
from console.tui.screens.base import ConsoleScreen
from console.tui.screens.simulate import SimulateTraffic
from console.tui.state import ConsoleState
from console.tui.widgets.fleet_table import FleetTable
from engine.snapshot import Snapshot


class FleetScreen(ConsoleScreen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("s", "simulate", "Simulate traffic")]

    class ServerChosen(Message):
        """Enter on a row: the app switches the fleet to that server and shows it live."""

        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(self, state: ConsoleState) -> None:
        super().__init__(state)
        self.single = MemberState(state.source)  # one server: its row, from the console's polls

    def compose(self) -> ComposeResult:
        yield from self.compose_header()
        yield Static(id="fleet-note")
        yield FleetTable()
        yield from self.compose_footer()

    def on_mount(self) -> None:
        self._refresh_rows()

    def show_snapshot(self, snapshot: Snapshot) -> None:
        super().show_snapshot(snapshot)
        self._refresh_rows()

    def show_failure(self, error: str) -> None:
        super().show_failure(error)  # the selected server is down; the others still report
        self.single.error = error
        self._refresh_rows()

    def _refresh_rows(self) -> None:
        source = self.state.source
        note = self.query_one("#fleet-note", Static)
        if isinstance(source, FleetSource):
            note.display = False
            self.query_one(FleetTable).update_from(source.rows())
            return
        note.update("one server: pass several --attach URLs for a fleet")
        latest = self.state.latest
        if latest is not None and latest is not self.single.snapshot and not self.state.failure:
            self.single.heard(latest, time.time())
        self.single.polls = 1 if self.single.snapshot or self.single.error else 0
        self.query_one(FleetTable).update_from([self.single.row(0)])

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if isinstance(self.state.source, FleetSource) and event.row_key.value is not None:
            self.post_message(self.ServerChosen(int(event.row_key.value) - 1))

    def action_simulate(self) -> None:
        """"Simulate this traffic on …": the fleet's traced requests on a GPU's twin."""
        traced = self.state.traced
        if traced is None:
            self.notify("no store of traced requests: attach with --otlp-listen (and --db) "
                        "so the fleet's traces are stored, then simulate them",
                        severity="warning", markup=False)
            return
        self.app.push_screen(SimulateTraffic(traced))
