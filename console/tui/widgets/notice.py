"""How a pane says it has nothing to show on this source, and why."""

from __future__ import annotations

from rich.text import Text


def unavailable(refusal: str) -> Text:
    return Text(refusal, style="italic yellow")
