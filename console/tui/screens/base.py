"""What every console screen shares: the console's state, a header and a footer, redraws only
while shown, and keys that follow what the source can do."""

from __future__ import annotations

from typing import ClassVar

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import Input

from console.sources.base import Capability
from console.tui.keymap import COMMANDS
from console.tui.state import ConsoleState
from console.tui.text import escaped
from console.tui.widgets.header import EngineHeader
from console.tui.widgets.keybar import KeyBar
from engine.snapshot import Snapshot


class ConsoleScreen(Screen):
    AUTO_FOCUS = "DataTable"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "leave_input", "Leave the field", show=False)]
    NEEDS: ClassVar[dict[str, Capability]] = {}  # this screen's actions -> what they need

    def __init__(self, state: ConsoleState) -> None:
        super().__init__()
        self.state = state
        self._styled_for: tuple[object, ...] | None = None  # the app's look when it left
        self.switched_to = False  # set by the app's switch_mode: the next resume is its own
        self._shown: Snapshot | None = None  # the snapshot last drawn

    def _app_look(self) -> tuple[object, ...]:
        """What of the app a screen's styles follow, beside its own classes: the theme, the
        app's pseudo-classes (focus or blur, dark or light) and its size (the width rules)."""
        return self.app.theme, frozenset(self.app.get_pseudo_classes()), self.app.size

    def compose_header(self) -> ComposeResult:
        yield EngineHeader()

    def compose_footer(self) -> ComposeResult:
        yield KeyBar(self.state)

    def show_snapshot(self, snapshot: Snapshot) -> None:
        """Redraw from a new snapshot; the app calls it only on the screen being shown, and
        on the screen it is about to show."""
        self._shown = snapshot
        # A poll can land while this screen is still mounting or already tearing down.
        header = self.query(EngineHeader)
        if header:
            header.first().update_from(snapshot, self.state.source.name, self.state.slo)

    def show_failure(self, error: str) -> None:
        header = self.query(EngineHeader)
        if header:
            header.first().show_failure(error, self.state.source.name)

    def show_capabilities(self) -> None:
        """Show or hide what depends on the source's capabilities; on resume, and when the
        source changes what it can do (a fleet switched server)."""
        self.refresh_bindings()

    def on_screen_resume(self, event: events.ScreenResume) -> None:
        # Textual restyles a resumed screen whole, and a restyle empties every widget's
        # rendered lines; a screen's own changes restyle it as they happen, so only an app
        # that changed its look while the screen was away needs one.
        # Only a screen key's switch skips the restyle: a screen uncovered by a pop (the
        # splash, help, a dialog) may never have been styled while it lay underneath.
        same_look = self._styled_for == self._app_look()
        if same_look and self.switched_to:
            event.refresh_styles = False
        self.switched_to = False
        self.show_capabilities()
        # the switch drew the latest snapshot already, as a rule, but at the size the screen
        # had when it left: a terminal resized meanwhile needs the figures fitted again
        if self.state.latest is not None and (self.state.latest is not self._shown
                                              or not same_look):
            self.show_snapshot(self.state.latest)
        if self.state.failure:
            self.show_failure(self.state.failure)

    def on_screen_suspend(self) -> None:
        """Leaving a screen leaves its field: coming back, the digits are screen keys."""
        self.end_edit()
        self._styled_for = self._app_look()

    def leave(self) -> None:
        """The app is switching to another screen: end the edit now, before the keys sent
        after the screen key arrive."""
        self.end_edit()

    def action_leave_input(self) -> None:
        """Escape leaves a field, so the screen's keys (1–5, c, p) are keys again."""
        self.end_edit()

    def end_edit(self) -> None:
        if isinstance(self.focused, Input):
            self.set_focus(None)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A key whose capability the source lacks is hidden from the footer."""
        need = self.NEEDS.get(action)
        return need is None or need in self.state.capabilities

    def on_key(self, event: events.Key) -> None:
        """A hidden key still answers: pressed, it says why it does nothing here."""
        need = self._gated_keys().get(event.key)
        refusal = None if need is None else self.state.refusal(need)
        if refusal is not None:
            event.stop()
            self.notify(escaped(refusal), severity="warning", markup=False)

    def _gated_keys(self) -> dict[str, Capability]:
        gated = {key: c.needs for c in COMMANDS if c.needs is not None for key in c.keys}
        for binding in self.BINDINGS:
            need = self.NEEDS.get(binding.action.split("(")[0]) if isinstance(
                binding, Binding) else None
            if need is not None:
                gated.update(dict.fromkeys(binding.key.split(","), need))
        return gated
