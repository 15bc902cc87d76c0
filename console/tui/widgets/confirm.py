"""A yes/no question before an action on someone else's engine (k9s asks before it deletes)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from console.tui.text import plain


class Confirm(ModalScreen[bool]):
    """Dismissed with True on y, False on n or escape."""

    DEFAULT_CSS = """
    Confirm { align: center middle; }
    Confirm > Vertical { width: auto; max-width: 90%; height: auto; padding: 1 2;
                         background: $surface; border: thick $warning; }
    Confirm Static { width: auto; height: auto; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(plain(self.question), id="confirm-question")  # it may name a server
            yield Static("[b]y[/b] yes   [b]n[/b] / [b]esc[/b] no", classes="dim")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
