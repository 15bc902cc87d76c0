"""An input field that takes only the characters its type allows, so every other key (c, p,
q, ?) stays a command while it is focused. Textual's Input claims every printable key, and
the bindings of those keys then never run."""

from __future__ import annotations

from textual.widgets import Input

from console.tui.keymap import typed_into


class Field(Input):
    def check_consume_key(self, key: str, character: str | None) -> bool:
        return typed_into(self, key)
