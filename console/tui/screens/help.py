"""Help: every command with its key, drawn from the same table as the bindings and palette;
a command this source cannot do is shown dimmed, with the reason."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from console.tui.keymap import COMMANDS
from console.tui.state import ConsoleState

SCREEN_KEYS = (
    ("Tables", "/ filter · o next sort column · O reverse · click a header to sort"),
    ("Tuning", "ctrl+s apply · ctrl+r revert · enter in a field applies · "
               "F1–F5 switch screens while typing"),
    ("Slow queries", "enter detail · e export CSV · E export JSON · r reload"),
    ("Drift", "r recalibrate"),
    ("Anywhere", "ctrl+p command palette · esc closes a dialog"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss", "Close")]

    def __init__(self, state: ConsoleState) -> None:
        super().__init__()
        self.state = state

    def compose(self) -> ComposeResult:
        keys = Table(show_header=False, box=None, padding=(0, 2))
        for command in COMMANDS:
            refusal = None if command.needs is None else self.state.refusal(command.needs)
            keys.add_row(command.key_display or command.key.replace(",", " "), command.title,
                         command.help if refusal is None else refusal,
                         style=None if refusal is None else "dim")
        screens = Table(show_header=False, box=None, padding=(0, 2))
        for name, text in SCREEN_KEYS:
            screens.add_row(name, text)
        with VerticalScroll(id="help"):
            yield Static(keys)
            yield Static(screens)

    def on_mount(self) -> None:
        self.query_one("#help").border_title = "tokenflow console · keys"
        self.query_one("#help").border_subtitle = "esc closes"
