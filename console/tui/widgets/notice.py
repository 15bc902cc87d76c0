"""How a pane says it has nothing to show on this source, and why."""

from __future__ import annotations

from rich.text import Text

from console.tui.text import escaped


def unavailable(refusal: str) -> Text:
    """The refusal in its lines (it may quote a server), each shown as plain text."""
    return Text("\n".join(escaped(line) for line in refusal.split("\n")),
                style="italic yellow")
