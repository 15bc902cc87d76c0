"""A time chart drawn in braille at the widget's own size: a legend, a y axis in the series'
unit, a time axis, labelled reference lines (SLOs, watermarks) and a mark at each applied
change. Shorter than SPARK_ROWS rows it becomes one sparkline per series, with its value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rich.text import Text
from textual.widget import Widget

from console.tui.history import downsample

SPARK_ROWS = 5  # below this a chart has no room for its axes: sparklines instead
SPARKS = " ▁▂▃▄▅▆▇█"
PALETTE = ("cyan", "bright_blue", "green", "bright_magenta")
MARK_STYLE = "magenta"
SPANS_S = (30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)  # a time axis rounds up to one
# braille dot bits by (column in the cell, row in the cell)
DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))

Unit = Callable[[float], str]


def number(value: float) -> str:
    if abs(value) >= 10_000:
        return f"{value / 1000:.0f}k"
    if abs(value) >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.0f}" if abs(value) >= 10 or value == int(value) else f"{value:.1f}"


def ms(value: float) -> str:
    """A latency in milliseconds, in ms below a second and in s above."""
    if value >= 1000:
        return f"{value / 1000:.1f} s"
    return f"{value:.0f} ms" if value >= 10 or value == 0 else f"{value:.1f} ms"


def percent(value: float) -> str:
    return f"{value:.0%}"


def per_s(value: float) -> str:
    return f"{number(value)}/s"


def duration(seconds: float) -> str:
    """A span on the time axis: 45s, 2m, 2m30s."""
    seconds = round(seconds)
    if seconds < 120:
        return f"{seconds}s"
    minutes, rest = divmod(seconds, 60)
    return f"{minutes}m{rest}s" if rest else f"{minutes}m"


@dataclass(frozen=True)
class Series:
    label: str
    values: tuple[float, ...]
    times: tuple[float, ...] = ()  # each value's snapshot time; () plots by position
    color: str = ""  # "" takes the palette's colour for its position

    @classmethod
    def of(cls, label: str, points: Iterable[tuple[float, float]], color: str = "") -> Series:
        """From (time, value) pairs, as MetricHistory.points gives them."""
        pairs = tuple(points)
        return cls(label, tuple(v for _, v in pairs), tuple(t for t, _ in pairs), color)


@dataclass(frozen=True)
class Line:
    """A horizontal reference line, labelled at its right end."""

    value: float
    label: str
    color: str = "yellow"


class Plot(Widget):
    """Renders its series as Rich Text; the last picture is kept until its inputs change."""

    DEFAULT_CSS = "Plot { width: 1fr; height: 1fr; min-height: 1; }"

    def __init__(self, *, y_limits: tuple[float, float] | None = None, unit: Unit = number,
                 id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._series: tuple[Series, ...] = ()
        self._lines: tuple[Line, ...] = ()
        self._marks: tuple[float, ...] = ()
        self._now: float | None = None
        self._y_limits = y_limits
        self._unit = unit
        self._cache: tuple[object, Text] | None = None

    def show(self, series: tuple[Series, ...], lines: tuple[Line, ...] = (),
             marks: tuple[float, ...] = (), now: float | None = None) -> None:
        """Plot `series` against `lines`; `marks` are the times of applied changes, `now` the
        right end of the time axis (the newest sample's time when None)."""
        if (series, lines, marks, now) != (self._series, self._lines, self._marks, self._now):
            self._series, self._lines, self._marks, self._now = series, lines, marks, now
            self.refresh()

    @property
    def series(self) -> tuple[Series, ...]:
        return self._series

    def render(self) -> Text:
        width, height = self.size.width, self.size.height
        key = (width, height, self._series, self._lines, self._marks, self._now)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        text = self._build(width, height)
        self._cache = (key, text)
        return text

    def _colors(self) -> list[str]:
        return [s.color or PALETTE[i % len(PALETTE)] for i, s in enumerate(self._series)]

    def _range(self) -> tuple[float, float]:
        if self._y_limits is not None:
            return self._y_limits
        values = [v for s in self._series for v in s.values]
        values += [line.value for line in self._lines]
        low, high = min(min(values), 0.0), max(values)
        if high <= low:
            return low, low + 1.0
        return low, high * 1.1 if high > 0 else high  # headroom above the highest point

    def _build(self, width: int, height: int) -> Text:
        if not any(s.values for s in self._series):
            return Text("waiting for samples…", style="dim", no_wrap=True, overflow="ellipsis")
        if width < 12:
            return Text("")
        if height < SPARK_ROWS:
            return self._sparklines(width, height)
        return self._chart(width, height)

    def _sparklines(self, width: int, height: int) -> Text:
        low, high = self._range()
        text = Text(no_wrap=True, overflow="ellipsis", end="")
        shown = [(s, c) for s, c in zip(self._series, self._colors(), strict=True) if s.values]
        for row, (series, color) in enumerate(shown[:height]):
            value = self._unit(series.values[-1])
            label = series.label[: max(width - len(value) - 4, 0)]  # the value is never cut
            room = max(width - len(label) - len(value) - 2, 1)
            points = downsample(list(series.values), room)
            span = (high - low) or 1.0
            # every sample shows at least its lowest bar, so a flat zero still reads as data
            sparks = "".join(SPARKS[max(1, min(8, round((v - low) / span * 8)))] for v in points)
            if row:
                text.append("\n")
            text.append(f"{label} ", style=color)
            text.append(sparks.rjust(room), style=color)
            text.append(f" {value}", style=f"bold {color}")
        return text

    def _chart(self, width: int, height: int) -> Text:
        low, high = self._range()
        labels = [self._unit(high), self._unit((low + high) / 2), self._unit(low)]
        label_width = max(len(label) for label in labels)
        plot_width = width - label_width - 1
        timed = any(s.times for s in self._series)
        rows = height - 1 - (1 if timed else 0)  # the legend above, the time axis below
        newest = max((s.times[-1] for s in self._series if s.times), default=0.0)
        now = self._now if self._now is not None else newest
        oldest = min((s.times[0] for s in self._series if s.times), default=now)
        span = next((s for s in SPANS_S if s >= now - oldest), SPANS_S[-1])
        dots_x, dots_y = plot_width * 2, rows * 4

        def x_of(position: float) -> int:  # position in [0, 1] along the time axis
            return max(0, min(dots_x - 1, round(position * (dots_x - 1))))

        def y_of(value: float) -> int:  # dot row from the top
            share = (value - low) / (high - low)
            return dots_y - 1 - max(0, min(dots_y - 1, round(share * (dots_y - 1))))

        cells: dict[tuple[int, int], tuple[int, str]] = {}
        for series, color in zip(self._series, self._colors(), strict=True):
            columns: dict[int, float] = {}  # each dot column's highest value: spikes survive
            if series.times:
                for ts, value in zip(series.times, series.values, strict=True):
                    if ts >= now - span:
                        x = x_of((ts - (now - span)) / span)
                        columns[x] = max(columns.get(x, value), value)
            else:
                points = downsample(list(series.values), dots_x)
                for i, value in enumerate(points):
                    columns[x_of(i / max(len(points) - 1, 1))] = value
            previous: tuple[int, int] | None = None
            for x in sorted(columns):
                y = y_of(columns[x])
                start_x, start_y = previous if previous is not None else (x, y)
                last = start_y
                # joined to the last point, column by column: a line, not dots
                for step_x in range(start_x + (x > start_x), x + 1):
                    here = round(start_y + (y - start_y) * (step_x - start_x)
                                 / max(x - start_x, 1))
                    for dot in range(min(here, last), max(here, last) + 1):
                        cell = (dot // 4, step_x // 2)
                        bits = cells.get(cell, (0, color))[0] | DOTS[step_x % 2][dot % 4]
                        cells[cell] = (bits, color)
                    last = here
                previous = (x, y)

        grid: list[list[tuple[str, str]]] = [
            [(chr(0x2800 + cells[(r, c)][0]), cells[(r, c)][1]) if (r, c) in cells else (" ", "")
             for c in range(plot_width)] for r in range(rows)]
        tags: dict[int, list[Line]] = {}  # lines that share a row share one label
        for line in self._lines:
            row = y_of(line.value) // 4
            tags.setdefault(row, []).append(line)
            for c in range(plot_width):
                if grid[row][c][0] == " ":
                    grid[row][c] = ("╌", line.color)
        for row, shared in tags.items():
            tag = (" " + " · ".join(line.label for line in shared))[: plot_width]
            for i, char in enumerate(tag):
                grid[row][plot_width - len(tag) + i] = (char, f"bold {shared[-1].color}")
        if timed:
            for mark in self._marks:
                if now - span <= mark <= now:
                    column = x_of((mark - (now - span)) / span) // 2
                    for r in range(rows):
                        if grid[r][column][0] == " ":
                            grid[r][column] = ("┊", MARK_STYLE)

        text = Text(no_wrap=True, overflow="crop", end="")
        self._legend(text, width)
        label_rows = {0: labels[0], rows - 1: labels[2]}
        if rows >= 5:
            label_rows[(rows - 1) // 2] = self._unit(low + (high - low) * (
                1 - ((rows - 1) // 2) / (rows - 1)))
        for r in range(rows):
            text.append("\n")
            label = label_rows.get(r, "")
            text.append(label.rjust(label_width), style="dim")
            text.append("┤" if label else "│", style="dim")
            for char, style in grid[r]:
                text.append(char, style=style)
        if timed:
            text.append("\n")
            text.append(" " * label_width + "└", style="dim")
            axis = [" "] * plot_width
            for position, tick in ((0.0, f"-{duration(span)}"), (0.5, f"-{duration(span / 2)}"),
                                   (1.0, "now")):
                start = min(max(0, round(position * (plot_width - 1)) - len(tick) // 2),
                            plot_width - len(tick))
                axis[start:start + len(tick)] = tick
            text.append("".join(axis), style="dim")
        return text

    def _legend(self, text: Text, width: int) -> None:
        entries: list[tuple[str, str]] = [
            (f"━ {s.label}", color) for s, color in zip(self._series, self._colors(), strict=True)]
        entries += [(f"╌ {line.label}", line.color) for line in self._lines]
        if self._marks and any(s.times for s in self._series):
            entries.append(("┊ change", MARK_STYLE))
        used = 0
        for entry, style in entries:
            if used + len(entry) + 2 > width:
                break
            text.append(entry, style=style)
            text.append("  ")
            used += len(entry) + 2
