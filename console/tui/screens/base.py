"""What every console screen shares: a header, a footer, and redraws only while shown."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer

from console.tui.widgets.header import EngineHeader
from engine.snapshot import Snapshot

if TYPE_CHECKING:
    from console.tui.app import TokenflowApp


class ConsoleScreen(Screen):
    AUTO_FOCUS = "DataTable"
    @property
    def console(self) -> TokenflowApp:
        return cast("TokenflowApp", self.app)

    def compose_header(self) -> ComposeResult:
        yield EngineHeader()

    def compose_footer(self) -> ComposeResult:
        yield Footer()

    def show_snapshot(self, snapshot: Snapshot) -> None:
        """Redraw from a new snapshot; the app calls it only on the screen being shown."""
        # A poll can land while this screen is still mounting or already tearing down.
        header = self.query(EngineHeader)
        if header:
            header.first().update_from(snapshot, self.console.source.name)

    def show_failure(self, error: str) -> None:
        header = self.query(EngineHeader)
        if header:
            header.first().show_failure(error, self.console.source.name)

    def on_screen_resume(self) -> None:
        if self.console.latest is not None:
            self.show_snapshot(self.console.latest)
        if self.console.failure:
            self.show_failure(self.console.failure)
