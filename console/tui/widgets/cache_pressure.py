"""The "Cache pressure" pane: KV usage against the watermarks, its history, the mode, and the
prefix cache's hit rate over recent admissions."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from console.tui.history import MetricHistory
from console.tui.settings import setting
from console.tui.text import escaped
from console.tui.widgets.gauge import gauge, level_style
from console.tui.widgets.header import MODE_STYLES
from console.tui.widgets.plot import Line, Plot, Series, percent
from console.tui.widgets.redraw import update_changed
from engine.snapshot import Snapshot


class CachePressure(Vertical):
    DEFAULT_CSS = "CachePressure Static { height: auto; }"

    def __init__(self) -> None:
        super().__init__(id="cache-pressure")
        self.border_title = "Cache pressure"

    def compose(self) -> ComposeResult:
        yield Static(id="kv-gauge")
        yield Plot(y_limits=(0.0, 1.0), unit=percent, id="kv-plot")

    def update_from(self, snapshot: Snapshot, history: MetricHistory, *,
                    watermarks: bool = True) -> None:
        """`watermarks`: whether tokenflow's KV watermarks govern this engine; without them
        the gauge has no marks and the plot no watermark lines."""
        marks = (setting(snapshot.config, "cache_low_watermark"),
                 setting(snapshot.config, "cache_high_watermark")) if watermarks else ()
        style = level_style(snapshot.kv_usage, *marks) if marks else "bold"
        width = max(self.content_size.width - 6, 4)
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"{snapshot.kv_usage:>4.0%} ", style=style)
        line.append_text(gauge(snapshot.kv_usage, width, marks, style=style))
        line.append(f"\n{snapshot.kv_blocks_used}/{snapshot.kv_blocks_total} blocks")
        if snapshot.kv_block_size > 1:
            line.append(f" × {snapshot.kv_block_size} tokens")
        if snapshot.kv_bytes_total:
            line.append(f" · {snapshot.kv_usage * snapshot.kv_bytes_total / 2**30:.2f}/"
                        f"{snapshot.kv_bytes_total / 2**30:.2f} GiB")
        line.append("\n")
        line.append(escaped(snapshot.mode), style=MODE_STYLES.get(snapshot.mode, "bold"))
        if snapshot.prefix_cache_hit_rate is not None:  # None: caching off or no lookup yet
            line.append(f"  prefix hits {snapshot.prefix_cache_hit_rate:.0%}")
        update_changed(self.query_one("#kv-gauge", Static), line)
        lines = (Line(marks[0], f"low {marks[0]:.0%}", "green"),
                 Line(marks[1], f"high {marks[1]:.0%}", "red")) if marks else ()
        self.query_one(Plot).show((Series.of("KV usage", history.points("kv_usage")),),
                                  lines=lines, marks=history.change_times,
                                  now=history.newest_ts)
