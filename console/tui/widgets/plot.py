"""A time chart drawn by plotext, in braille, at the widget's own size: a y axis in the
series' unit, a time axis, labelled reference lines (SLOs, watermarks) and a mark at each
applied change, under a one-row legend. Shorter than SPARK_ROWS rows it becomes one sparkline
per series, with its value.

Two parts stay our own, small: the legend, because plotext's is a box drawn over the canvas,
which hides most of a 12-row pane; and the sparklines, because plotext draws no chart without
its frame, and a 1-row braille line has 4 levels where block characters have 8.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import plotext as plt
from plotext._kernel.terminal import terminal as Terminal
from rich.color import Color
from rich.style import Style
from rich.text import Span, Text
from textual.widget import Widget

from console.tui.history import downsample
from engine.stats import quantile

SPARK_ROWS = 6  # below this a chart has no room for its legend, axis and ticks: sparklines
SPARKS = " ▁▂▃▄▅▆▇█"
PALETTE = ("cyan", "bright_blue", "green", "bright_magenta")
MARK_STYLE = "magenta"
EVENT_STYLE = "yellow"  # drift events, pauses and resumes, engine restarts
MARK_KEYS = ((MARK_STYLE, "┊ change"), (EVENT_STYLE, "┊ drift/pause/restart"))
SPANS_S = (30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 6 * 3600.0, 24 * 3600.0, 7 * 86400.0)
# a time axis rounds up to one of SPANS_S
DIM = plt.pixel(foreground=Color.parse("bright_black").number)  # the frame and its ticks

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
    if seconds >= 2 * 3600 and seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    minutes, rest = divmod(seconds, 60)
    return f"{minutes}m{rest}s" if rest else f"{minutes}m"


def _pixel(color: str, bold: bool = False) -> plt.pixel:
    """A Rich colour name as a plotext pixel: the same ANSI number, so the theme maps both."""
    number = Color.parse(color).number
    return plt.pixel(foreground=number, style="bold" if bold else None)


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


ROBUST_QUANTILE = 0.95  # the axis is scaled to the bulk of the samples, not their extreme
OUTLIER_FACTOR = 4.0  # samples beyond this many times the bulk are clipped, and said to be
LINE_REACH = 20.0  # a reference line beyond this many times the data's peak stays off the axis


class Plot(Widget):
    """Renders its series as Rich Text; the last picture is kept until its inputs change."""

    DEFAULT_CSS = "Plot { width: 1fr; height: 1fr; min-height: 1; }"

    def __init__(self, *, y_limits: tuple[float, float] | None = None, unit: Unit = number,
                 id: str | None = None, classes: str | None = None,
                 mark_keys: bool = True) -> None:
        """`mark_keys`: the legend names the marks; False where the charts' frame names them
        once for all (`keyed_marks`)."""
        super().__init__(id=id, classes=classes)
        self._mark_keys = mark_keys
        self._series: tuple[Series, ...] = ()
        self._lines: tuple[Line, ...] = ()
        self._marks: tuple[float, ...] = ()
        self._events: tuple[float, ...] = ()
        self._now: float | None = None
        self._start: float | None = None
        self._y_limits = y_limits
        self._unit = unit
        self._cache: tuple[object, Text] | None = None

    def show(self, series: tuple[Series, ...], lines: tuple[Line, ...] = (),
             marks: tuple[float, ...] = (), now: float | None = None,
             start: float | None = None, events: tuple[float, ...] = ()) -> None:
        """Plot `series` against `lines`; `marks` are the times of applied changes, `events`
        those of drift events and engine restarts, `now` the right end of the time axis (the
        newest sample's time when None), `start` the oldest time the window must reach (the
        pane's history, so its charts share one window; the oldest sample's when None)."""
        shown = (series, lines, marks, now, start, events)
        if shown != (self._series, self._lines, self._marks, self._now, self._start,
                     self._events):
            (self._series, self._lines, self._marks, self._now, self._start,
             self._events) = shown
            self.refresh()

    @property
    def series(self) -> tuple[Series, ...]:
        return self._series

    def drawn_marks(self) -> tuple[bool, bool]:
        """Whether the chart draws change marks, and drift/pause/restart marks: a chart with
        a time axis does (sparklines draw none)."""
        charted = self.size.height >= SPARK_ROWS and any(s.times for s in self._series)
        return charted and bool(self._marks), charted and bool(self._events)

    def render(self) -> Text:
        width, height = self.size.width, self.size.height
        key = (width, height, self._series, self._lines, self._marks, self._now, self._start,
               self._events)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        text = self._build(width, height)
        self._cache = (key, text)
        return text

    def _colors(self) -> list[str]:
        return [s.color or PALETTE[i % len(PALETTE)] for i, s in enumerate(self._series)]

    def _range(self, rows: int = 0) -> tuple[float, float]:
        """The y axis for a chart of `rows` rows (0: sparklines, which draw no lines)."""
        if self._y_limits is not None:
            return self._y_limits
        values = [v for s in self._series for v in s.values]
        lines = self._axis_lines(values)
        low, high = min(min(values + lines), 0.0), max(values + lines)
        clip = self._clip_at(values, lines, rows)
        if clip is not None:
            high = clip
        if high <= low:
            return low, low + 1.0
        return low, high * 1.1 if high > 0 else high  # headroom above the highest point

    def _clip_at(self, values: list[float], lines: list[float], rows: int) -> float | None:
        """Where the axis stops when a few outliers would flatten the rest (a resume's burst
        of 146k tok/s over a run of 340): OUTLIER_FACTOR times the 95th percentile, or the
        highest reference line; or where the highest reference line still sits a row above
        the axis's zero (a 100 s peak after a pause drew a 2 s SLO on the `0 ms` row). None
        when nothing lies that far out."""
        clips = []
        body = quantile(values, ROBUST_QUANTILE)
        if body is not None and body > 0 and max(values) > OUTLIER_FACTOR * body:
            clips.append(max([OUTLIER_FACTOR * body, *lines]))
        top = max(lines, default=0.0)
        if rows > 2 and top > 0:
            room = top * (rows - 1) / 1.1  # the line on row 1 of `rows`, after the headroom
            if max(values) > room:
                clips.append(room)
        return min(clips, default=None)

    def _axis_lines(self, values: list[float]) -> list[float]:
        """The reference lines the axis reaches for. One far above the data (an SLO of 2 s
        over TTFTs of 2 ms) would flatten it: the legend names it, the axis stays put."""
        return [line.value for line in self._lines if line.value <= LINE_REACH * max(values)]

    def _clipped(self, rows: int = 0) -> float | None:
        """The highest value the axis cut off, if any."""
        if self._y_limits is not None:
            return None
        values = [v for s in self._series for v in s.values]
        clip = self._clip_at(values, self._axis_lines(values), rows)
        return None if clip is None or max(values) <= clip else max(values)

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
            # the value is never cut, the label only below one spark of room
            label = series.label[: max(width - len(value) - 3, 0)]
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
        timed = any(s.times for s in self._series)
        rows = height - 1 - (2 if timed else 1)  # the legend above; the x axis (and its ticks)
        low, high = self._range(rows)
        shares = (1.0, 0.5, 0.0) if rows >= 5 else (1.0, 0.0)
        ticks = [low + (high - low) * share for share in shares]
        labels = [self._unit(tick) for tick in ticks]
        dots = (width - max(len(label) for label in labels) - 1) * 2  # braille: 2 dots a cell
        newest = max((s.times[-1] for s in self._series if s.times), default=0.0)
        now = self._now if self._now is not None else newest
        oldest = min((s.times[0] for s in self._series if s.times), default=now)
        if self._start is not None:
            oldest = min(oldest, self._start)
        span = next((s for s in SPANS_S if s >= now - oldest), SPANS_S[-1])

        figure = Terminal()._master  # its own figure: plotext's plt.figure is one global
        figure.theme("simple").canvas("default").legend(False).plot_size(width, height - 1)
        figure.axes(True, pixel=DIM).axes(False, axis=[0, 1], side=1)  # left and lower only
        figure.ruler("y").lim(low, high).ticks(ticks, labels)
        figure.ruler(["x", "y"]).pixel(DIM)
        for series, color in zip(self._series, self._colors(), strict=True):
            xs, ys = _columns(series, dots, now, span)
            ys = [min(y, high) for y in ys]  # clipped outliers touch the top edge
            figure.draw(figure.signal(xs, ys, marker=plt.marker("braille", _pixel(color))).lines())
        if timed:
            figure.ruler("x").lim(-span, 0.0).ticks(
                [-span, -span / 2, 0.0], [f"-{duration(span)}", f"-{duration(span / 2)}", "now"])
            for times, style in ((self._events, EVENT_STYLE), (self._marks, MARK_STYLE)):
                for mark in times:
                    if now - span <= mark <= now:
                        figure.line(mark - now, 1, pixel=_pixel(style), style="dotted")
        else:
            figure.ruler("x").lim(0, max(dots - 1, 1)).ticks([])
        right = 0.0 if timed else max(dots - 1, 1)
        for value, shared in self._rows_of_lines(low, high, rows):
            for line in shared:
                figure.line(line.value, 0, pixel=_pixel(line.color), style="dotted")
            tag = plt.colorize(" " + " · ".join(line.label for line in shared),
                               _pixel(shared[-1].color, bold=True))
            figure.draw(figure.text(right, value, tag, alignment="right"))

        text = Text(no_wrap=True, overflow="crop", end="")
        self._legend(text, width, rows, low, high)
        text.append("\n")
        chart = Text.from_ansi(figure.build().string(), no_wrap=True, end="")
        # plotext paints a line's cells on a white ground and has no "terminal default" one:
        # only the foreground and weight are kept, so the chart sits on the theme's background
        chart.spans = [Span(s.start, s.end, Style(color=s.style.color, bold=s.style.bold,
                                                  dim=s.style.dim))
                       for s in chart.spans if isinstance(s.style, Style)]
        text.append_text(chart)
        return text

    def _rows_of_lines(self, low: float, high: float,
                       rows: int) -> list[tuple[float, list[Line]]]:
        """The reference lines grouped by the chart row they fall on: one label per row."""
        tags: dict[int, list[Line]] = {}
        for line in self._lines:
            if not low <= line.value <= high:
                continue  # off the axis: the legend still names it
            tags.setdefault(round((line.value - low) / (high - low) * (rows - 1)), []).append(line)
        return [(shared[0].value, shared) for shared in tags.values()]

    def _legend(self, text: Text, width: int, rows: int, low: float, high: float) -> None:
        """One row: the series, then what the row has room for, by rank: the clip, a line
        the axis does not reach, the marks, and last a line drawn on the chart (labelled
        there already), on the axis from `low` to `high`. Entries keep their order."""
        entries: list[tuple[int, str, str]] = [  # (rank, entry, style)
            (0, f"━ {s.label}", color)
            for s, color in zip(self._series, self._colors(), strict=True)]
        clipped = self._clipped(rows)
        if clipped is not None:
            entries.append((1, f"↑ clipped, peak {self._unit(clipped)}", "dim"))
        entries += [(4 if low <= line.value <= high else 2, f"┈ {line.label}", line.color)
                    for line in self._lines]
        if self._mark_keys:
            entries += [(3, key, style) for (style, key), shown
                        in zip(MARK_KEYS, self.drawn_marks(), strict=True) if shown]
        kept: set[int] = set()
        used = 0
        for index in sorted(range(len(entries)), key=lambda i: entries[i][0]):
            room = len(entries[index][1]) + (2 if kept else 0)  # two spaces between entries
            if used + room <= width:
                kept.add(index)
                used += room
        for number, index in enumerate(sorted(kept)):
            text.append("  " if number else "")
            text.append(entries[index][1], style=entries[index][2])


def keyed_marks(plots: Iterable[Plot]) -> Text:
    """The key to the marks the `plots` draw, for their shared frame."""
    drawn = [any(flags) for flags in zip(*(p.drawn_marks() for p in plots), strict=True)]
    key = Text()
    for (style, entry), shown in zip(MARK_KEYS, drawn or (False, False), strict=True):
        if shown:
            key.append("  " if key else "")
            key.append(entry, style=style)
    return key


def _columns(series: Series, dots: int, now: float,
             span: float) -> tuple[list[float], list[float]]:
    """The series at most one point per braille dot column, each the highest value that falls in
    it (spikes survive, and plotext draws `dots` points, not thousands). Timed series sit at
    their age before `now` within `span`; others at their position, across `dots` columns."""
    if not series.times:
        points = downsample(list(series.values), dots)
        step = (dots - 1) / max(len(points) - 1, 1)
        return [i * step for i in range(len(points))], points
    columns: dict[int, float] = {}
    first = bisect_left(series.times, now - span)  # snapshot times only grow
    for ts, value in zip(series.times[first:], series.values[first:], strict=True):
        x = round((ts - now + span) / span * (dots - 1))
        columns[x] = max(columns.get(x, value), value)
    xs = sorted(columns)
    return [x * span / (dots - 1) - span for x in xs], [columns[x] for x in xs]
