"""One table of commands: it drives the key bindings, the footer and the command palette.

A command that needs a capability the source lacks is hidden from the footer and the palette;
its key still answers, with the reason (see ConsoleScreen.on_key).

Every command key is a priority binding, so it works from every screen, with a field
focused too (k9s: `?` helps everywhere). A key still goes to the focused field when the
field takes that character (a digit into a number Field, any letter into a filter box);
Escape leaves the field, and F1–F5 switch screens whatever is focused. Every key is decided
in the order it was sent (widgets.field.keystroke).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from textual.binding import Binding
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Input

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

    @property
    def shown_key(self) -> str:
        return self.key_display or self.keys[0]

    @property
    def screen(self) -> str | None:
        """The mode this command shows, if it is a screen key."""
        found = re.fullmatch(r"show\('(\w+)'\)", self.action)
        return None if found is None else found[1]


COMMANDS: tuple[Command, ...] = (
    Command("1,f1", "show('live')", "Live",
            "Requests, chunk queue, cache pressure, bandwidth, latency"),
    Command("2,f2", "show('tuning')", "Tuning",
            "Change token budget, tile, concurrency, watermarks and thresholds live"),
    Command("3,f3", "show('slow_queries')", "Slow queries",
            "Slow queries from the store: sort, filter, per-chunk detail, export"),
    Command("4,f4", "show('drift')", "Drift", "Calibration history, drift events, recalibration"),
    Command("5,f5", "show('diagnosis')", "Diagnosis",
            "Symptoms matched against the live metrics, with their cause and what to check"),
    Command("0", "show('fleet')", "Fleet",
            "Every attached server: health, load, latency, slow queries; enter opens one"),
    Command("c", "apply_recommended", "Apply C*",
            "Set the token budget to the recommended chunk size C*", needs=Capability.TUNE),
    Command("p", "toggle_pause", "Pause", "Pause or resume the engine", needs=Capability.PAUSE),
    Command("n", "next_server", "Next server",
            "With several --attach targets (a fleet), show the next one"),
    Command("question_mark", "help", "Help", "Keys, screens and a glossary", "?"),
    Command("q", "quit", "Quit", "Stop the engine and leave"),
)
# Textual's names for the printable keys above; every other key has no character to type.
CHARACTERS = {"question_mark": "?"}
# The key Textual reports for Escape and a digit at once: the character macOS's Option gives the
# digit, by its key name. Textual's table of such sequences is private, so the digits are copied
# here (tests/console/test_keys.py holds them to it).
OPTION_DIGITS = {"1": "inverted_exclamation_mark", "2": "trade_mark_sign", "3": "pound_sign",
                 "4": "cent_sign", "5": "infinity", "6": "section_sign", "7": "pilcrow_sign",
                 "8": "bullet", "9": "ª", "0": "º"}
INPUT_TYPES = {"integer": r"[-+]?(?:\d*|\d+_)*",  # as Textual's Input restricts its types
               "number": r"[-+]?(?:\d*|\d+_)*\.?(?:\d*|\d+_)*(?:\d[eE]?[-+]?(?:\d*|\d+_)*)?"}


def after_escape(key: str) -> str | None:
    """The key Textual reports when Escape and `key` arrive at once: ESC is the meta prefix,
    so a letter reads as alt+letter, and a digit as the character macOS's Option gives it
    (ESC 5 is "∞"). Escape then 5 at speed is still 5."""
    if len(CHARACTERS.get(key, key)) != 1:
        return None
    return OPTION_DIGITS.get(key, f"alt+{key}")


def bindings() -> list[Binding]:
    """One priority binding per key (and per key after a quick Escape), running the app's
    `command` action; Textual drops it while the focused widget consumes that key (see
    widgets.field.Field)."""
    return [Binding(pressed, f"command({key!r})", c.title, key_display=c.shown_key,
                    priority=True, show=False)
            for c in COMMANDS for key in c.keys
            for pressed in (key, after_escape(key)) if pressed is not None]


def own_keys(screen: Screen) -> set[str]:
    """The keys `screen` binds itself: there its own binding beats a command's (a question's
    `n` is "no", not the next server)."""
    return {key for cls in type(screen).__mro__ for binding in vars(cls).get("BINDINGS", ())
            if isinstance(binding, Binding) and not binding.priority
            for key in binding.key.split(",")}


def command_for(key: str) -> Command:
    return next(c for c in COMMANDS if key in c.keys)


def typed_into(focused: Widget | None, key: str) -> bool:
    """Whether `key`, pressed with `focused` focused, is text for that input rather than a
    command: it has a character, and the input's type and restriction accept it there."""
    character = CHARACTERS.get(key, key)
    if not isinstance(focused, Input) or len(character) != 1 or not character.isprintable():
        return False
    return accepts(focused, character)


def accepts(box: Input, character: str) -> bool:
    """Whether `box`'s type and restriction take `character` typed at its cursor (over its
    selection, if any)."""
    value = box.value
    selection = box.selection
    start, end = sorted(selection) if not selection.is_empty else (box.cursor_position,) * 2
    candidate = f"{value[:start]}{character}{value[end:]}"
    patterns = [p for p in (INPUT_TYPES.get(box.type), box.restrict) if p]
    return all(re.fullmatch(p, candidate) is not None for p in patterns)
