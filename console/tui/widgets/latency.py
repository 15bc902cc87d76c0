"""The latency pane: TTFT and ITL (time between tokens), p50/p99 over time, against their SLOs.

The SLOs are the operator's (`--slo-ttft-ms`, `--slo-itl-ms`; a chat service's defaults),
in absolute milliseconds: never derived from the engine's own speed, so a slow engine reads
slow.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from console.tui.history import MetricHistory
from console.tui.widgets.plot import Line, Plot, Series, ms
from console.tui.widgets.redraw import update_changed
from engine.slo_targets import ServiceSLO
from engine.snapshot import Percentiles, Snapshot


def window(snapshot: Snapshot) -> float:
    """The seconds the latency percentiles cover: an attached server's differenced window,
    else the engine's own."""
    return snapshot.window_s or snapshot.stats_window_s


def slo_style(value: float | None, slo: float | None) -> str:
    """green within the SLO, yellow up to twice it, red beyond; plain without one."""
    if value is None or slo is None:
        return "bold"
    if value <= slo:
        return "bold green"
    return "bold yellow" if value <= 2 * slo else "bold red"


def append_latency(text: Text, name: str, p: Percentiles, slo: float | None) -> None:
    """`name p50/p99` with each figure coloured against `slo`."""
    text.append(f"{name} ")
    for i, value in enumerate((p.p50, p.p99)):
        if i:
            text.append("/")
        text.append("–" if value is None else ms(value), style=slo_style(value, slo))


class Latency(Vertical):
    DEFAULT_CSS = """
    Latency Static { height: auto; }
    Latency Horizontal { height: 1fr; }
    Latency #ttft-plot { margin-right: 1; }
    """

    def __init__(self) -> None:
        super().__init__(id="latency")
        self.border_title = "Latency"

    def compose(self) -> ComposeResult:
        yield Static(id="latency-line")
        with Horizontal():
            yield Plot(unit=ms, id="ttft-plot")
            yield Plot(unit=ms, id="itl-plot")

    def update_from(self, snapshot: Snapshot, history: MetricHistory, slo: ServiceSLO) -> None:
        line = Text(no_wrap=True, overflow="ellipsis")
        append_latency(line, "TTFT", snapshot.ttft_ms, slo.ttft_ms)
        line.append(" · ")
        append_latency(line, "ITL", snapshot.itl_ms, slo.itl_ms)
        line.append(" p50/p99")
        line.append(f" over {window(snapshot):.0f} s", style="dim")
        update_changed(self.query_one("#latency-line", Static), line)
        marks, now = history.change_times, history.newest_ts
        for name, limit in (("ttft", slo.ttft_ms), ("itl", slo.itl_ms)):
            self.query_one(f"#{name}-plot", Plot).show((
                Series.of(f"{name.upper()} p50", history.points(f"{name}_p50")),
                Series.of("p99", history.points(f"{name}_p99")),
            ), lines=(Line(limit, f"SLO {ms(limit)}", "red"),), marks=marks, now=now,
                start=history.oldest_ts)
