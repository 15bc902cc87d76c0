"""Stop strings found in a request's output text as tokens arrive, in time linear in the output."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import ahocorasick

from engine.model.tokenizer import continuation

# A UTF-8 character spans at most 4 bytes, so at most 4 byte-level tokens; past this many
# pending tokens the replacement character is real (invalid bytes), not a character in progress.
MAX_PENDING_TOKENS = 8


class StopScanner:
    """One request's stop strings over its output, detokenized incrementally.

    Each new token decodes only a short window (the tokens since the last complete text, and
    the few before it, so merges and leading spaces come out as in a whole decode), and one
    Aho-Corasick pass reads the new characters and the longest stop string's tail before them:
    per token the cost does not grow with the output nor with the number of stop strings."""

    def __init__(self, stops: Sequence[str], include_stop: bool,
                 decode: Callable[[list[int]], str], prime: Sequence[int] = ()) -> None:
        self.automaton = ahocorasick.Automaton()
        for stop in stops:
            self.automaton.add_word(stop, stop)
        self.automaton.make_automaton()
        self.keep = max(map(len, stops)) - 1  # a match ending in new text starts after this
        self.include_stop = include_stop
        self.decode = decode
        self.prime = prime  # the prompt: the output's text continues it, as the answer's does
        self.prefix_offset = 0
        self.read_offset = 0
        self.tail = ""
        self.chars = 0  # characters of output text read so far

    def feed(self, token_ids: list[int]) -> int | None:
        """Where the output text is cut if it now holds a stop string (after the string with
        include_stop, else before it), or None."""
        prefix = self._text(token_ids[self.prefix_offset:self.read_offset])
        text = self._text(token_ids[self.prefix_offset:])
        pending = len(token_ids) - self.read_offset
        if len(text) <= len(prefix) or (text.endswith("\ufffd")
                                         and pending < MAX_PENDING_TOKENS):
            return None  # no new character yet, or one still incomplete
        new = text[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        window = self.tail + new
        base = self.chars - len(self.tail)
        found: tuple[int, str] | None = None
        for end, stop in self.automaton.iter(window):
            match = (end - len(stop) + 1, stop)
            if found is None or match < found:
                found = match
        self.chars += len(new)
        self.tail = window[-self.keep:] if self.keep else ""
        if found is None:
            return None
        start, stop = found
        return base + start + (len(stop) if self.include_stop else 0)

    def _text(self, window: list[int]) -> str:
        # only the first window starts the output: a SentencePiece leading space is kept there
        # as a detokenizer primed with the prompt keeps it
        if self.prefix_offset == 0:
            return continuation(self.decode, self.prime, window)
        return self.decode(window)
