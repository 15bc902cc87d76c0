"""A line plot drawn by plotext at the widget's own size, its series squeezed to that width."""

from __future__ import annotations

from dataclasses import dataclass

import plotext
from rich.text import Text
from textual.widget import Widget

from console.tui.history import downsample

Y_AXIS_COLUMNS = 8  # room plotext takes for the y tick labels and the frame


@dataclass(frozen=True)
class Series:
    label: str
    values: tuple[float, ...]


class Plot(Widget):
    """Renders its series with plain plotext (built to a string, shown as Rich Text).

    plotext keeps one global figure, so plots are built only on the UI thread, one at a time.
    """

    DEFAULT_CSS = "Plot { width: 1fr; height: 1fr; min-height: 3; }"

    def __init__(self, *, y_limits: tuple[float, float] | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._series: tuple[Series, ...] = ()
        self._lines: tuple[float, ...] = ()
        self._y_limits = y_limits
        self._cache: tuple[object, Text] | None = None

    def show(self, series: tuple[Series, ...], lines: tuple[float, ...] = ()) -> None:
        """Plot `series`; `lines` are horizontal markers such as watermarks."""
        if series != self._series or lines != self._lines:
            self._series = series
            self._lines = lines
            self.refresh()

    def render(self) -> Text:
        width, height = self.size.width, self.size.height
        key = (width, height, self._series, self._lines)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        text = self._build(width, height)
        self._cache = (key, text)
        return text

    def _build(self, width: int, height: int) -> Text:
        if not any(s.values for s in self._series):
            return Text("waiting for samples…", style="dim")
        if width < Y_AXIS_COLUMNS + 4 or height < 3:
            return Text("")
        points = width - Y_AXIS_COLUMNS
        figure = plotext.figure
        figure.clear()
        figure.theme("simple")
        figure.plot_size(width, height)
        figure.ruler("x").frequency(0)
        figure.ruler("y").frequency(max(2, min(4, height - 2)))
        if self._y_limits is not None:
            figure.ruler("y").lim(*self._y_limits)
        drawn = 2
        for series in self._series:
            if series.values:
                values = downsample(list(series.values), points)
                signal = figure.signal(values if len(values) > 1 else values * 2)
                signal.lines()
                figure.draw(signal)
                drawn = max(drawn, len(values))
        for value in self._lines:
            figure.draw(figure.signal([value] * drawn).lines())
        return Text.from_ansi(figure.build().string(), no_wrap=True, end="")
