"""Drift: the calibration history as a plot, the drift events, and a recalibration with progress."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, ProgressBar, Static

from console.sources.base import Capability
from console.tui.collectors import DriftLoaded, RecalibrationDone, RecalibrationProgress
from console.tui.screens.base import ConsoleScreen
from console.tui.screens.slow_queries import clock
from console.tui.state import ConsoleState
from console.tui.widgets.notice import unavailable
from console.tui.widgets.plot import Plot, Series

if TYPE_CHECKING:  # annotations only: the store pulls SQLAlchemy and Alembic (~1 s)
    from engine.store import CalibrationRecord


def prefill_ms_per_1k(record: CalibrationRecord) -> float | None:
    """The run's headline: measured prefill milliseconds per thousand tokens, over its table."""
    tokens = sum(point.tokens for point in record.table)
    seconds = sum(point.seconds for point in record.table)
    return None if tokens == 0 else seconds / tokens * 1e6


class DriftScreen(ConsoleScreen):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("r", "recalibrate", "Recalibrate")]
    NEEDS: ClassVar[dict[str, Capability]] = {"recalibrate": Capability.CALIBRATE}
    RECALIBRATE_NOTE = "press r to recalibrate the token budget on this engine"

    def __init__(self, state: ConsoleState) -> None:
        super().__init__(state)
        self.recalibrating = False

    def compose(self) -> ComposeResult:
        yield from self.compose_header()
        with Vertical(id="calibrations"):
            yield Static(id="calibration-line")
            yield Plot(id="calibration-plot")
        with Horizontal(id="drift-bottom"):
            yield DataTable(id="drift-events", cursor_type="row", zebra_stripes=True)
            with Vertical(id="recalibration"):
                yield Static(id="recalibration-note")
                yield ProgressBar(total=100, show_eta=False, id="recalibration-progress")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        self.query_one("#calibrations").border_title = "Calibration history"
        self.query_one("#recalibration").border_title = "Recalibration"
        events = self.query_one("#drift-events", DataTable)
        events.border_title = "Drift events"
        events.add_column("time", key="time")
        events.add_column("deviation", key="deviation")
        events.add_column("detail", key="detail")

    def show_capabilities(self) -> None:
        super().show_capabilities()
        history = self.state.refusal(Capability.DRIFT)
        self.query_one(Plot).display = history is None
        self.query_one("#drift-events").display = history is None
        if history is not None:
            self.query_one("#calibration-line", Static).update(unavailable(history))
        if not self.recalibrating:  # its progress notes stay until it ends
            refusal = self.state.refusal(Capability.CALIBRATE)
            self.query_one("#recalibration-note", Static).update(
                self.RECALIBRATE_NOTE if refusal is None else unavailable(refusal))
            self.query_one(ProgressBar).display = refusal is None

    def on_screen_resume(self) -> None:
        super().on_screen_resume()
        self._load()

    def _load(self) -> None:
        self.state.load_drift(self)  # without a history, show_capabilities said why

    def on_drift_loaded(self, message: DriftLoaded) -> None:
        runs = list(reversed(message.calibrations))  # oldest first, as time runs on the plot
        figures = [f for f in (prefill_ms_per_1k(r) for r in runs) if f is not None]
        line = Text(f"{len(runs)} runs", style="bold")
        if runs:
            last = runs[-1]
            line.append(f" · last {clock(last.created_at)} on {last.model} / {last.device}")
        if figures:
            line.append(f" · prefill {figures[-1]:.2f} ms per 1k tokens", style="cyan")
        self.query_one("#calibration-line", Static).update(line)
        self.query_one(Plot).show((Series("prefill ms/1k tok", tuple(figures)),))
        events = self.query_one("#drift-events", DataTable)
        events.clear()
        for event in message.events:
            events.add_row(clock(event.created_at), f"{event.deviation:+.1%}", event.detail,
                           key=str(event.id))

    def action_recalibrate(self) -> None:
        if self.recalibrating:
            self.notify("a recalibration is already running", timeout=2)
            return
        note = self.query_one("#recalibration-note", Static)
        refusal = self.state.recalibrate(self)
        if refusal is not None:
            note.update(unavailable(refusal))
            return
        self.recalibrating = True
        self.query_one(ProgressBar).update(progress=0)
        note.update("starting…")

    def on_recalibration_progress(self, message: RecalibrationProgress) -> None:
        self.query_one(ProgressBar).update(progress=round(message.fraction * 100))
        self.query_one("#recalibration-note", Static).update(message.note)

    def on_recalibration_done(self, message: RecalibrationDone) -> None:
        self.recalibrating = False
        note = self.query_one("#recalibration-note", Static)
        if message.error is not None:
            note.update(Text(message.error, style="bold red"))
            return
        self.query_one(ProgressBar).update(progress=100)
        note.update(Text("recalibrated; table stored", style="green"))
        self._load()
