"""Input fields whose keystrokes are applied in the order they were sent.

Textual forwards a key to the focused input's own queue, and a key the input handles by a
binding (Backspace, Delete, the arrows) bubbles back up to the app before it acts, so the
characters sent behind it landed first: `424`, three Backspaces and `7` read `4`. The app
hands every key for a focused input to `keystroke` instead, as the key arrives.

A Field takes only the characters its type allows, so every other key (c, p, q, ?) stays a
command while it is focused. It does not select its value on focus by itself: whoever
focuses it from a key selects the value at once (`start_edit`), so a digit typed right after
Tab replaces the value instead of landing before the selection does.
"""

from __future__ import annotations

from typing import Any

from textual import events
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Input

from console.tui.keymap import accepts, typed_into

# The input's own editing keys, run at once; Enter is left to the screen (it applies).
EDITING_KEYS: dict[str, str] = {key: binding.action for binding in Input.BINDINGS
                                if isinstance(binding, Binding) and binding.action != "submit"
                                for key in binding.key.split(",")}


class Field(Input):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, select_on_focus=False, **kwargs)

    def check_consume_key(self, key: str, character: str | None) -> bool:
        return typed_into(self, key)


async def keystroke(box: Input, event: events.Key) -> bool:
    """Apply `event` to the focused `box` now, if it is the box's: a character its type takes,
    or one of its editing keys. False: the key is a command (the app's bindings decide)."""
    character = event.character
    if event.is_printable and character is not None and accepts(box, character):
        selection = box.selection
        if selection.is_empty:
            box.insert_text_at_cursor(character)
        else:
            box.replace(character, *selection)
        return True
    action = EDITING_KEYS.get(event.key)
    if action is None:
        return False
    await box.run_action(action)
    return True


def start_edit(screen: Screen, box: Input) -> None:
    """Focus `box` with its whole value selected, both at once: typing replaces the value."""
    screen.set_focus(box)
    box.select_all()
