"""The fleet overview: one row per attached server, worst first; Enter opens that server."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.message import Message
from textual.widgets import DataTable, Static

from console.sources.fleet import FleetSource
from console.tui.screens.base import ConsoleScreen
from console.tui.widgets.fleet_table import FleetTable
from engine.snapshot import Snapshot


class FleetScreen(ConsoleScreen):
    class ServerChosen(Message):
        """Enter on a row: the app switches the fleet to that server and shows it live."""

        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

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
        self._refresh_rows()

    def _refresh_rows(self) -> None:
        source = self.state.source
        note = self.query_one("#fleet-note", Static)
        if not isinstance(source, FleetSource):
            note.update("one server attached: pass several --attach URLs for a fleet")
            return
        note.display = False
        self.query_one(FleetTable).update_from(source.rows())

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if isinstance(self.state.source, FleetSource) and event.row_key.value is not None:
            self.post_message(self.ServerChosen(int(event.row_key.value) - 1))
