"""One table of commands: it drives the key bindings, the footer and the command palette."""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class Command:
    key: str  # Textual key names, comma-separated; the first is the one shown
    action: str  # a Textual action string run on the app
    title: str
    help: str
    key_display: str | None = None


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
            "Set the token budget to the recommended chunk size C*"),
    Command("p", "toggle_pause", "Pause", "Pause or resume the engine"),
    Command("n", "next_server", "Next server",
            "With several --attach targets (a fleet), show the next one"),
    Command("question_mark", "help", "Help", "Keys and what each screen shows", "?"),
    Command("q", "quit", "Quit", "Stop the engine and leave"),
)


def bindings() -> list[Binding]:
    return [Binding(c.key, c.action, c.title, key_display=c.key_display or c.key.split(",")[0])
            for c in COMMANDS]
