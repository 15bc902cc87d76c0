"""The "Bandwidth" pane: the 5-second average, where it comes from, the throttle, who else
uses the host (as htop and nvitop show it), a history; for a GPU's twin, how far its figures
go (the published cases nearest its traffic)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from console.tui.history import MetricHistory
from console.tui.settings import setting
from console.tui.widgets.gauge import level_style
from console.tui.widgets.plot import Line, Plot, Series, percent
from console.tui.widgets.redraw import update_changed
from engine.snapshot import Snapshot

THROTTLE_LEVELS = ("none", "concurrency 2", "concurrency 1", "prefills paused")


def host_text(snapshot: Snapshot) -> Text:
    """The host around the last step: others' CPUs, steal, the engine's own CPUs, and on a
    GPU the other processes computing on it."""
    text = Text("host ")
    text.append("busy" if snapshot.host_contended else "quiet",
                style="bold yellow" if snapshot.host_contended else "green")
    text.append(f" · others {snapshot.host_others_cpus:.1f} CPUs · steal "
                f"{snapshot.host_steal:.0%} · engine {snapshot.host_own_cpus:.1f} CPUs")
    if snapshot.host_gpu_others:  # NVML's view of the GPU, as nvitop lists its processes
        text.append(f" · GPU others {snapshot.host_others_gpu:.0%} SM: "
                    f"{snapshot.host_gpu_others}")
    return text


class Bandwidth(Vertical):
    DEFAULT_CSS = "Bandwidth Static { height: auto; }"

    def __init__(self) -> None:
        super().__init__(id="bandwidth")
        self.border_title = "Bandwidth"

    def compose(self) -> ComposeResult:
        yield Static(id="bandwidth-line")
        yield Plot(y_limits=(0.0, 1.0), unit=percent, id="bandwidth-plot")

    def update_from(self, snapshot: Snapshot, history: MetricHistory, *,
                    throttles: bool = True) -> None:
        """`throttles`: whether tokenflow's bandwidth throttles govern this engine; without
        them the share is drawn plain, with no throttle line."""
        config = snapshot.config
        throttle = setting(config, "bandwidth_throttle_2")
        pause = setting(config, "bandwidth_pause")
        line = Text(no_wrap=True, overflow="ellipsis")
        if snapshot.bandwidth_note:  # the share cannot be shown: say why instead of "0%"
            if snapshot.bandwidth_bytes_per_s is not None:
                line.append(f"{snapshot.bandwidth_bytes_per_s / 1e9:.2f} GB/s ", style="bold")
            line.append(snapshot.bandwidth_note, style="dim")
        else:
            line.append(f"{snapshot.bandwidth_util_5s:.0%}",
                        style=level_style(snapshot.bandwidth_util_5s, throttle, pause)
                        if throttles else "bold")
            if snapshot.bandwidth_bytes_per_s is not None:
                line.append(f" {snapshot.bandwidth_bytes_per_s / 1e9:.2f} GB/s", style="bold")
            span = "5 s avg" if not snapshot.window_s else "of peak"
            line.append(f" {span} · {snapshot.bandwidth_source}")
        if throttles and snapshot.throttle_note:  # it may not act now: why, not a level
            line.append(f"\n{snapshot.throttle_note}", style="dim")
        elif throttles:
            level = min(max(snapshot.throttle_level, 0), len(THROTTLE_LEVELS) - 1)
            line.append("\nthrottle ")
            line.append(f"{level} {THROTTLE_LEVELS[level]}", style="bold" if level else "green")
        if snapshot.host_measured:
            line.append("\n")
            line.append_text(host_text(snapshot))
        if snapshot.twin_trust:  # a twin: how far its figures go (the host is not the GPU)
            line.append(f"\ntwin: {snapshot.twin_trust}", style="dim")
        update_changed(self.query_one("#bandwidth-line", Static), line)
        lines = (Line(throttle, f"throttle {throttle:.0%}"),
                 Line(pause, f"pause {pause:.0%}", "red")) if throttles else ()
        self.query_one(Plot).show(
            (Series.of("bandwidth 5 s avg", history.points("bandwidth_util_5s")),),
            lines=lines, marks=history.change_times, now=history.newest_ts)
