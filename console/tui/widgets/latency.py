"""The latency pane: TTFT and TPOT p50/p99 over time."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from console.tui.history import MetricHistory
from console.tui.widgets.plot import Plot, Series
from engine.snapshot import Percentiles, Snapshot


def _ms(p: Percentiles) -> str:
    def one(v: float | None) -> str:
        return "–" if v is None else f"{v:.0f}"
    return f"{one(p.p50)}/{one(p.p99)}"


class Latency(Vertical):
    DEFAULT_CSS = """
    Latency Static { height: auto; }
    Latency Horizontal { height: 1fr; }
    """

    def __init__(self) -> None:
        super().__init__(id="latency")
        self.border_title = "Latency"

    def compose(self) -> ComposeResult:
        yield Static(id="latency-line")
        with Horizontal():
            yield Plot(id="ttft-plot")
            yield Plot(id="tpot-plot")

    def update_from(self, snapshot: Snapshot, history: MetricHistory) -> None:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append("TTFT ")
        line.append(_ms(snapshot.ttft_ms), style="bold")
        line.append(" · TPOT ")
        line.append(_ms(snapshot.tpot_ms), style="bold")
        line.append(" ms p50/p99")
        if snapshot.window_s:  # an attached server's histograms, differenced over the window
            line.append(f" over {snapshot.window_s:.0f} s")
        self.query_one("#latency-line", Static).update(line)
        for name in ("ttft", "tpot"):
            self.query_one(f"#{name}-plot", Plot).show((
                Series(f"{name} p50", tuple(history.values(f"{name}_p50"))),
                Series(f"{name} p99", tuple(history.values(f"{name}_p99"))),
            ))
