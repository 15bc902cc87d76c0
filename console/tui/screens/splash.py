"""What the console shows while the embedded engine starts: each stage as the engine
reports it (loading the model, calibrating, restoring the settings), so the terminal is never
blank for the seconds a model load and a first calibration take."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Center, Middle
from textual.message import Message
from textual.screen import Screen
from textual.widgets import ProgressBar, Static

from console.tui.keymap import COMMANDS
from console.tui.text import plain


class EngineStarting(Message):
    """A start-up stage the engine reported: `fraction` of it done, `what` runs now."""

    def __init__(self, fraction: float, what: str) -> None:
        super().__init__()
        self.fraction = fraction
        self.what = what


class EngineStarted(Message):
    """The engine is ready (`error` None), with the requests the last session left
    unfinished, closed as aborted at start; or why it did not start."""

    def __init__(self, error: str | None, orphans: tuple[str, ...] = (),
                 quarantined: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.error = error
        self.orphans = orphans
        self.quarantined = quarantined  # held back: they killed the runs that resumed them


class SplashScreen(Screen[None]):
    DEFAULT_CSS = """
    SplashScreen { align: center middle; }
    #splash { width: auto; max-width: 76; height: auto; padding: 1 2;
              border: round $primary-darken-1; }
    #splash-stage { width: 70; height: auto; }
    """

    def __init__(self, source_name: str) -> None:
        super().__init__()
        self.source_name = source_name
        self.started = time.monotonic()
        self.stage = "starting the engine process"

    def compose(self) -> ComposeResult:
        with Middle(), Center(id="splash"):
            yield Static(Text.assemble(("tokenflow console", "bold"), "  ",
                                       plain(self.source_name, "dim")))
            yield Static(id="splash-stage")
            yield ProgressBar(total=1.0, show_eta=False, id="splash-progress")
            quit_key = next(c.shown_key for c in COMMANDS if c.action == "quit")
            yield Static(Text(f"{quit_key} quits", style="dim"))

    def on_mount(self) -> None:
        self.show_stage(0.0, self.stage)
        self.set_interval(1.0, self._tick)  # the elapsed time moves even between stages

    def show_stage(self, fraction: float, what: str) -> None:
        self.stage = what
        self.query_one("#splash-progress", ProgressBar).update(progress=fraction)
        self._tick()

    def _tick(self) -> None:
        elapsed = time.monotonic() - self.started
        self.query_one("#splash-stage", Static).update(
            Text.assemble((self.stage, "bold cyan"), (f"  {elapsed:.0f} s", "dim")))
