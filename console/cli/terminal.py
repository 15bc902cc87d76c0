"""Printing text that came from outside (request ids, tenants, tags) without letting it
drive the terminal: control and format characters are shown as escapes, not obeyed."""

from __future__ import annotations

import unicodedata

# Controls (ESC starts colour, title and cursor sequences), format characters (bidi
# overrides reorder what follows), lone surrogates (unprintable) and line separators.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def terminal_safe(text: str) -> str:
    r"""`text` with each unsafe character written as an escape (\x1b, \n, \u202e, ...)."""
    if text.isprintable():
        return text  # the common case, without a pass per character
    return "".join(ascii(ch)[1:-1] if unicodedata.category(ch) in _UNSAFE_CATEGORIES else ch
                   for ch in text)
