"""One table of commands: it drives the key bindings, the footer and the command palette.

A command that needs a capability the source lacks is hidden from the footer and the palette;
its key still answers, with the reason (see ConsoleScreen.on_key).
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding

from console.sources.base import Capability


@dataclass(frozen=True)
class Command:
    key: str  # Textual key names, comma-separated; the first is the one shown
    action: str  # a Textual action string run on the app
    title: str
    help: str
    key_display: str | None = None
    needs: Capability | None = None  # what the source must be able to do

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.key.split(","))


COMMANDS: tuple[Command, ...] = (
    Command("1,f1", "show('live')", "Live",
            "Requests, chunk queue, cache pressure, bandwidth, latency"),
    Command("2,f2", "show('tuning')", "Tuning",
            "Change token budget, tile, concurrency, watermarks and thresholds live"),
    Command("3,f3", "show('slow_queries')", "Slow queries",
            "Slow queries from the store: sort, filter, per-chunk detail, export"),
    Command("4,f4", "show('drift')", "Drift", "Calibration history, drift events, recalibration"),
    Command("5,f5", "show('diagnosis')", "Diagnosis",
            "Seed 003 §11 symptoms evaluated against the live metrics"),
    Command("0", "show('fleet')", "Fleet",
            "Every attached server: health, load, latency, slow queries; enter opens one"),
    Command("c", "apply_recommended", "Apply C*",
            "Set the token budget to the recommended chunk size C*", needs=Capability.TUNE),
    Command("p", "toggle_pause", "Pause", "Pause or resume the engine", needs=Capability.PAUSE),
    Command("n", "next_server", "Next server",
            "With several --attach targets (a fleet), show the next one"),
    Command("question_mark", "help", "Help", "Keys and what each screen shows", "?"),
    Command("q", "quit", "Quit", "Stop the engine and leave"),
)


def bindings() -> list[Binding]:
    return [Binding(c.key, c.action, c.title, key_display=c.key_display or c.keys[0])
            for c in COMMANDS]


def needs(action: str) -> Capability | None:
    """The capability the app action `action` (its name, without arguments) needs, if any."""
    return next((c.needs for c in COMMANDS if c.action.split("(")[0] == action), None)
