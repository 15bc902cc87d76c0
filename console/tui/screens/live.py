"""The live screen: requests, chunk queue, cache pressure, bandwidth and latency at a glance."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid

from console.sources.base import Capability
from console.tui.screens.base import ConsoleScreen
from console.tui.widgets.bandwidth import Bandwidth
from console.tui.widgets.cache_pressure import CachePressure
from console.tui.widgets.chunk_queue import ChunkQueue
from console.tui.widgets.latency import Latency
from console.tui.widgets.requests_table import RequestsTable
from engine.snapshot import Snapshot


class LiveScreen(ConsoleScreen):
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
        self.query_one(Latency).update_from(snapshot, history)
