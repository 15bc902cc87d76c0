"""A one-line horizontal gauge with optional marks (watermarks, thresholds) drawn into it."""

from __future__ import annotations

from rich.text import Text


def gauge(fraction: float, width: int, marks: tuple[float, ...] = (), style: str = "green") -> Text:
    """`width` cells filled to `fraction`; each mark shows as │ at its position."""
    width = max(width, 1)
    filled = round(min(max(fraction, 0.0), 1.0) * width)
    cells = ["█" if i < filled else "░" for i in range(width)]
    for mark in marks:
        position = min(width - 1, max(0, round(mark * width) - 1))
        cells[position] = "┃"
    text = Text()
    for cell in cells:
        text.append(cell, style={"█": style, "░": "bright_black"}.get(cell, "bold white"))
    return text


def level_style(value: float, warn: float, alarm: float) -> str:
    """green below `warn`, yellow up to `alarm`, red at or above it."""
    if value >= alarm:
        return "bold red"
    if value >= warn:
        return "yellow"
    return "green"
