"""The "Bandwidth" pane: the 5-second average, where it comes from, the throttle, a history."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from console.tui.history import MetricHistory
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

    def update_from(self, snapshot: Snapshot, history: MetricHistory) -> None:
        config = snapshot.config
        throttle = float(config.get("bandwidth_throttle_2", 0.90))
        pause = float(config.get("bandwidth_pause", 0.98))
        level = min(max(snapshot.throttle_level, 0), len(THROTTLE_LEVELS) - 1)
        line = Text(no_wrap=True, overflow="ellipsis")
        if snapshot.bandwidth_bytes_per_s is not None:  # an attached server's estimate
            line.append(f"{snapshot.bandwidth_bytes_per_s / 1e9:.2f} GB/s ", style="bold")
        if snapshot.bandwidth_note:  # the share cannot be shown: say why instead of "0%"
            line.append(snapshot.bandwidth_note, style="dim")
        else:
            line.append(f"{snapshot.bandwidth_util_5s:.0%}",
                        style=level_style(snapshot.bandwidth_util_5s, throttle, pause))
            span = "5 s avg" if not snapshot.window_s else "of peak"
            line.append(f" {span} · {snapshot.bandwidth_source}")
        if "bandwidth_throttle_2" in config:  # tokenflow's own guard; others have none
            line.append("\nthrottle ")
            line.append(f"{level} {THROTTLE_LEVELS[level]}", style="bold" if level else "green")
        self.query_one("#bandwidth-line", Static).update(line)
        lines = (throttle,) if "bandwidth_throttle_2" in config else ()
        self.query_one(Plot).show(
            (Series("bandwidth", tuple(history.values("bandwidth_util_5s"))),), lines=lines)
