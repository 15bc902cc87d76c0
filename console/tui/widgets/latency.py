"""The latency pane: TTFT and ITL (time between tokens), p50/p99 over time, against their SLOs.

The SLOs are set as engine.harness.slo sets them (Sarathi-Serve's multiples of one step),
from the live step time: time between tokens within TPOT_MULTIPLE steps, the first token
within DELAY_MULTIPLE steps. They move with the machine, so a laptop and an H200 read alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from console.tui.history import MetricHistory
from console.tui.widgets.plot import Line, Plot, Series, ms
from engine.harness.slo_targets import DELAY_MULTIPLE, TPOT_MULTIPLE
from engine.snapshot import Percentiles, Snapshot


@dataclass(frozen=True)
class LatencySLO:
    ttft_ms: float
    tbt_ms: float  # time between tokens

    @classmethod
    def of(cls, snapshot: Snapshot) -> LatencySLO | None:
        """From the live step time; None before the first step has been timed."""
        step = snapshot.step_ms.p50
        if not step:
            return None
        return cls(DELAY_MULTIPLE * step, TPOT_MULTIPLE * step)


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

    def update_from(self, snapshot: Snapshot, history: MetricHistory) -> None:
        slo = LatencySLO.of(snapshot)
        line = Text(no_wrap=True, overflow="ellipsis")
        append_latency(line, "TTFT", snapshot.ttft_ms, slo and slo.ttft_ms)
        line.append(" · ")
        append_latency(line, "ITL", snapshot.itl_ms, slo and slo.tbt_ms)
        line.append(" p50/p99")
        line.append(f" over {window(snapshot):.0f} s", style="dim")
        self.query_one("#latency-line", Static).update(line)
        marks, now = history.change_times, history.newest_ts
        for name, limit in (("ttft", slo and slo.ttft_ms), ("itl", slo and slo.tbt_ms)):
            self.query_one(f"#{name}-plot", Plot).show((
                Series.of(f"{name.upper()} p50", history.points(f"{name}_p50")),
                Series.of("p99", history.points(f"{name}_p99")),
            ), lines=() if limit is None else (Line(limit, f"SLO {ms(limit)}", "red"),),
                marks=marks, now=now)
