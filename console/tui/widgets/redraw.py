"""Redraw only what changed: an idle engine's figures repeat every poll, and a Static's
update lays its whole screen out again, so a repeated line is not shown again."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


def update_changed(static: Static, content: Text | str) -> None:
    """Show `content` in `static` unless it shows it already."""
    if static.content != content:
        static.update(content)
