"""Drift: the calibration history as a plot, the drift events, and a recalibration with progress.

A traced server (vLLM over OTLP), which tokenflow cannot calibrate, shows its traced drift
history instead: the windowed median of measured over predicted prefill time."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import ProgressBar, Static

from console.sources.base import Capability
from console.tui.collectors import (
    DriftLoaded,
    RecalibrationDone,
    RecalibrationProgress,
    TracedDriftLoaded,
)
from console.tui.screens.base import ConsoleScreen
from console.tui.screens.slow_queries import clock
from console.tui.state import ConsoleState
from console.tui.widgets.keyed_table import Column, KeyedTable, TableRow, middle_cut
from console.tui.widgets.notice import unavailable
from console.tui.widgets.plot import Line, Plot, Series
from console.tui.widgets.redraw import update_changed

if TYPE_CHECKING:  # annotations only: the store pulls SQLAlchemy and Alembic (~1 s)
    from console.sources.base import CalibrationRecord, DriftRecord, TracedDriftPoint

# The time is the key column: it never drops and is never cut; the detail wraps.
EVENT_COLUMNS = (
    Column("time", "time", 8),
    Column("deviation", "deviation", 9),
    Column("server", "server", drop=1),
    Column("detail", "detail", fill=True),
)
WINDOW_COLUMNS = (
    Column("window", "window", 8),
    Column("ratio", "measured/predicted"),
    Column("requests", "requests", fill=True),
)
SERVER_WIDTH = 14  # a fleet's URLs, cut in the middle


def event_row(event: DriftRecord) -> TableRow:
    return TableRow(
        key=str(event.id),
        cells=(clock(event.created_at), f"{event.deviation:+.1%}",
               middle_cut(event.server or "–", SERVER_WIDTH), event.detail),
        sort_values=(event.created_at, event.deviation, event.server, event.detail),
        haystack=f"{event.server} {event.detail}".lower())


def window_row(point: TracedDriftPoint) -> TableRow:
    return TableRow(
        key=f"{point.start}:{point.estimate}",
        cells=(clock(point.start), f"{point.median_ratio:.2f}×",
               f"{point.requests} vs {point.estimate} estimate"),
        sort_values=(point.start, point.median_ratio, point.requests),
        haystack=point.estimate.lower())


def prefill_ms_per_1k(record: CalibrationRecord) -> float | None:
    """The run's headline: measured prefill milliseconds per thousand tokens, over its table."""
    tokens = sum(point.tokens for point in record.table)
    seconds = sum(point.seconds for point in record.table)
    return None if tokens == 0 else seconds / tokens * 1e6


class DriftScreen(ConsoleScreen):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("r", "recalibrate", "Recalibrate")]
    NEEDS: ClassVar[dict[str, Capability]] = {"recalibrate": Capability.CALIBRATE}
    RECALIBRATE_NOTE = "press r to recalibrate the step-time model on this engine"

    def __init__(self, state: ConsoleState) -> None:
        super().__init__(state)
        self.recalibrating = False

    def compose(self) -> ComposeResult:
        yield from self.compose_header()
        with Vertical(id="calibrations"):
            yield Static(id="calibration-line")
            yield Plot(id="calibration-plot")
        with Horizontal(id="drift-bottom"):
            yield KeyedTable(EVENT_COLUMNS, id="drift-events", reverse=True,
                             empty="no drift event stored")
            yield KeyedTable(WINDOW_COLUMNS, id="traced-windows", reverse=True,
                             empty="no traced window yet")
            with Vertical(id="recalibration"):
                yield Static(id="recalibration-note")
                yield ProgressBar(total=100, show_eta=False, id="recalibration-progress")
        yield from self.compose_footer()

    def on_mount(self) -> None:
        self.query_one("#calibrations").border_title = "Calibration history"
        self.query_one("#recalibration").border_title = "Recalibration"
        self.query_one("#drift-events").border_title = "Drift events"
        self.query_one("#traced-windows").border_title = "Traced windows"

    def show_capabilities(self) -> None:
        super().show_capabilities()
        history = self.state.refusal(Capability.DRIFT)
        traced = history is not None and self.state.refusal(Capability.TRACED_DRIFT) is None
        self.query_one(Plot).display = history is None or traced
        self.query_one("#drift-events").display = history is None
        self.query_one("#traced-windows").display = traced
        self.query_one("#calibrations").border_title = ("Traced drift history" if traced
                                                        else "Calibration history")
        if history is not None and not traced:
            update_changed(self.query_one("#calibration-line", Static), unavailable(history))
        if not self.recalibrating:  # its progress notes stay until it ends
            refusal = self.state.refusal(Capability.CALIBRATE)
            update_changed(self.query_one("#recalibration-note", Static),
                           self.RECALIBRATE_NOTE if refusal is None else unavailable(refusal))
            self.query_one(ProgressBar).display = refusal is None

    def on_screen_resume(self) -> None:  # Textual runs ConsoleScreen's handler too
        self._load()

    def _load(self) -> None:
        self.state.load_drift(self)  # without a history, show_capabilities said why

    def on_drift_loaded(self, message: DriftLoaded) -> None:
        runs = list(reversed(message.calibrations))  # oldest first, as time runs on the plot
        figures = [f for f in (prefill_ms_per_1k(r) for r in runs) if f is not None]
        line = Text(f"{len(runs)} run{'' if len(runs) == 1 else 's'}", style="bold")
        if runs:
            last = runs[-1]
            line.append(f" · last {clock(last.created_at)} on {last.model} / {last.device}")
        if figures:
            line.append(f" · prefill {figures[-1]:.2f} ms per 1k tokens", style="cyan")
        self.query_one("#calibration-line", Static).update(line)
        self.query_one(Plot).show((Series("prefill ms/1k tok", tuple(figures)),))
        self.query_one("#drift-events", KeyedTable).sync([event_row(e) for e in message.events])

    def on_traced_drift_loaded(self, message: TracedDriftLoaded) -> None:
        points = message.points  # oldest first
        line = Text(f"{sum(p.requests for p in points)} traced requests in {len(points)} "
                    "windows", style="bold")
        if points:
            last = points[-1]
            line.append(f" · last {clock(last.start)}: measured/predicted prefill "
                        f"{last.median_ratio:.2f}× (median of {last.requests} in "
                        f"{last.window_s:.0f} s) vs {last.estimate} estimate", style="cyan")
        else:
            line.append(" · no scored traced requests yet: scores need --roofline-model")
        self.query_one("#calibration-line", Static).update(line)
        estimates = list(dict.fromkeys(p.estimate for p in points))  # first seen first
        self.query_one(Plot).show(
            tuple(Series(f"measured/predicted vs {estimate}",
                         tuple(p.median_ratio for p in points if p.estimate == estimate))
                  for estimate in estimates),
            lines=(Line(1.0, "as predicted"),))
        self.query_one("#traced-windows", KeyedTable).sync([window_row(p) for p in points])

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
