"""The live screen: requests, chunk queue, cache pressure, bandwidth and latency at a glance."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid
from textual.widgets import DataTable

from console.sources.base import Capability
from console.tui.collectors import SlowQueriesLoaded
from console.tui.screens.base import ConsoleScreen
from console.tui.screens.request_detail import RequestDetail
from console.tui.screens.slow_queries import SlowQueryDetail
from console.tui.state import ConsoleState
from console.tui.widgets.bandwidth import Bandwidth
from console.tui.widgets.cache_pressure import CachePressure
from console.tui.widgets.chunk_queue import ChunkQueue
from console.tui.widgets.latency import Latency
from console.tui.widgets.requests_table import RequestsTable
from engine.snapshot import RequestView, Snapshot


class LiveScreen(ConsoleScreen):
    def __init__(self, state: ConsoleState) -> None:
        super().__init__(state)
        self._opening: RequestView | None = None  # Enter pressed; its record is being read

    def compose(self) -> ComposeResult:
        yield from self.compose_header()
        yield RequestsTable()
        with Grid(id="panes"):
            yield ChunkQueue()
            yield CachePressure()
            yield Bandwidth()
            yield Latency()
        yield from self.compose_footer()

    def show_snapshot(self, snapshot: Snapshot) -> None:
        super().show_snapshot(snapshot)
        history = self.state.history
        watermarks = Capability.WATERMARKS in self.state.capabilities
        self.query_one(RequestsTable).update_from(snapshot)
        self.query_one(ChunkQueue).update_from(snapshot,
                                               self.state.refusal(Capability.CHUNK_QUEUE))
        self.query_one(CachePressure).update_from(snapshot, history, watermarks=watermarks)
        self.query_one(Bandwidth).update_from(snapshot, history, throttles=watermarks)
        self.query_one(Latency).update_from(snapshot, history, self.state.slo)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a request: its timeline if it is a stored slow query, else its row."""
        event.stop()
        latest = self.state.latest
        view = next((r for r in latest.requests if r.id == event.row_key.value), None) if (
            latest is not None) else None
        if view is None:
            return
        self._opening = view
        refusal = self.state.load_slow_queries(self)
        if refusal is not None:
            self._opening = None
            self.app.push_screen(RequestDetail(view, f"no timeline: {refusal}"))

    def on_slow_queries_loaded(self, message: SlowQueriesLoaded) -> None:
        view, self._opening = self._opening, None
        if view is None or not self.is_current:
            return
        record = next((r for r in message.records if r.request_id == view.id), None)
        self.app.push_screen(RequestDetail(view) if record is None else SlowQueryDetail(record))
