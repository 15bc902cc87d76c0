"""The "Bandwidth" pane: the 5-second average, where it comes from, the throttle, a history."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from console.tui.history import MetricHistory
from console.tui.settings import setting
from console.tui.widgets.gauge import level_style
from console.tui.widgets.plot import Plot, Series
from engine.snapshot import Snapshot

THROTTLE_LEVELS = ("none", "concurrency 2", "concurrency 1", "prefills paused")


class Bandwidth(Vertical):
    DEFAULT_CSS = "Bandwidth Static { height: auto; }"

    def __init__(self) -> None:
        super().__init__(id="bandwidth")
        self.border_title = "Bandwidth"

    def compose(self) -> ComposeResult:
        yield Static(id="bandwidth-line")
        yield Plot(y_limits=(0.0, 1.0), id="bandwidth-plot")

    def update_from(self, snapshot: Snapshot, history: MetricHistory, *,
                    throttles: bool = True) -> None:
        """`throttles`: whether tokenflow's bandwidth throttles govern this engine; without
        them the share is drawn plain, with no throttle line."""
        config = snapshot.config
        throttle = setting(config, "bandwidth_throttle_2")
        pause = setting(config, "bandwidth_pause")
        line = Text(no_wrap=True, overflow="ellipsis")
        if snapshot.bandwidth_bytes_per_s is not None:  # an attached server's estimate
            line.append(f"{snapshot.bandwidth_bytes_per_s / 1e9:.2f} GB/s ", style="bold")
        if snapshot.bandwidth_note:  # the share cannot be shown: say why instead of "0%"
            line.append(snapshot.bandwidth_note, style="dim")
        else:
            line.append(f"{snapshot.bandwidth_util_5s:.0%}",
                        style=level_style(snapshot.bandwidth_util_5s, throttle, pause)
                        if throttles else "bold")
            span = "5 s avg" if not snapshot.window_s else "of peak"
            line.append(f" {span} · {snapshot.bandwidth_source}")
        if throttles:
            level = min(max(snapshot.throttle_level, 0), len(THROTTLE_LEVELS) - 1)
            line.append("\nthrottle ")
            line.append(f"{level} {THROTTLE_LEVELS[level]}", style="bold" if level else "green")
        self.query_one("#bandwidth-line", Static).update(line)
        self.query_one(Plot).show(
            (Series("bandwidth", tuple(history.values("bandwidth_util_5s"))),),
            lines=(throttle,) if throttles else ())
