"""Text from outside, shown as text: never as markup, never as terminal escapes.

Request ids, tenants, model names, server names and error messages come from clients,
attached servers and traces. A DataTable cell, a notification or a border title parses a
plain string as markup (`[/]` raises MarkupError and ends the app), and a control character
reaches the terminal as it is (`ESC ] 0 ; … BEL` retitles the window, `ESC [ 2 J` clears it).
Every widget renders such strings through `plain` (or `escaped` where a str is required, with
markup off), so control characters appear as their escapes: `\\x1b]0;x\\x07`.
"""

from __future__ import annotations

import unicodedata

from rich.text import Text


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escaped(value: object) -> str:
    """`value` as one line of printable text: control characters escaped."""
    text = str(value)
    if text.isprintable():  # the common case, without a copy
        return text
    # controls (C0, DEL, C1), formats such as bidirectional overrides, line separators and
    # unassigned code points are escaped; spaces of every width are kept
    return "".join(char if char.isprintable() or unicodedata.category(char) == "Zs"
                   else _escape(char) for char in text)


def plain(value: object, style: str = "") -> Text:
    """`value` as a rich Text (never parsed as markup), control characters escaped."""
    return Text(escaped(value), style=style)
