"""The footer: the screens as tabs with the current one highlighted, this screen's own keys,
and the commands, `?` and `q` last and never dropped.

As the terminal narrows, this screen's keys and the other commands go first (help lists
them), then the other tabs' titles (their keys stay): where you can go stays named, and `?`
and `q` stay visible from 80 columns up.
"""

from __future__ import annotations

from rich.text import Text
from textual.screen import Screen
from textual.widget import Widget

from console.tui.keymap import COMMANDS, Command
from console.tui.state import ConsoleState

ALWAYS = ("question_mark", "q")  # kept at any width


def key_label(key: str, title: str, *, current: bool = False) -> Text:
    if current:
        return Text(f" {key} {title} ", style="bold reverse")
    return Text.assemble((f" {key}", "bold"), f" {title} " if title else " ")


class KeyBar(Widget):
    DEFAULT_CSS = "KeyBar { height: 1; dock: bottom; background: $panel; }"

    def __init__(self, state: ConsoleState) -> None:
        super().__init__()
        self.state = state

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, self._bindings_changed)

    def on_unmount(self) -> None:
        self.screen.bindings_updated_signal.unsubscribe(self)

    def _bindings_changed(self, screen: Screen) -> None:
        self.refresh()

    def _commands(self) -> list[Command]:
        """The commands other than screens that this source can do (the others' keys
        answer with the reason, and help lists them dimmed)."""
        capabilities = self.state.capabilities
        return [c for c in COMMANDS
                if c.screen is None and (c.needs is None or c.needs in capabilities)]

    def _screen_keys(self) -> list[Text]:
        shown = []
        seen: set[str] = set()
        for active in self.screen.active_bindings.values():
            binding = active.binding
            if (active.node is self.app or not binding.show or not active.enabled
                    or binding.action in seen):
                continue
            seen.add(binding.action)
            shown.append(key_label(binding.key_display or self.app.get_key_display(binding),
                                   binding.description))
        return shown

    def render(self) -> Text:
        width = self.size.width
        mode = self.app.current_mode
        screens = [c for c in COMMANDS if c.screen is not None]
        commands = self._commands()
        tail = Text("").join(key_label(c.shown_key, c.title) for c in commands
                             if c.key.split(",")[0] in ALWAYS)
        middle = [key_label(c.shown_key, c.title) for c in commands
                  if c.key.split(",")[0] not in ALWAYS]
        local = self._screen_keys()
        extras = [*local, *middle]  # dropped from the end as the width runs out

        def tabs(short: bool) -> Text:
            return Text("").join(
                key_label(c.shown_key, "" if short and c.screen != mode else c.title,
                          current=c.screen == mode) for c in screens)

        line = tabs(short=False)
        if len(line) + 1 + len(tail) > width:
            line = tabs(short=True)  # the other screens keep their keys, not their titles
        while extras and len(line) + 1 + sum(map(len, extras)) + len(tail) > width:
            extras.pop()
        line.append("│", style="dim")
        for extra in extras:
            line.append_text(extra)
        pad = max(width - len(line) - len(tail), 1)
        line.append(" " * pad)
        line.append_text(tail)
        line.truncate(width)
        return line
