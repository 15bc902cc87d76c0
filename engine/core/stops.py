"""Stop strings found in a request's output text as tokens arrive, in time linear in the output."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import ahocorasick

from engine.model.detokenizer import IncrementalDetokenizer


class StopScanner:
    """One request's stop strings over its output, detokenized incrementally.

    Each new token decodes only a short window (IncrementalDetokenizer), and one Aho-Corasick
    pass reads the new characters and the longest stop string's tail before them: per token
    the cost does not grow with the output nor with the number of stop strings."""

    def __init__(self, stops: Sequence[str], include_stop: bool,
                 decode: Callable[[list[int]], str], prime: Sequence[int] = ()) -> None:
        self.automaton = automaton(tuple(stops))
        self.keep = max(map(len, stops)) - 1  # a match ending in new text starts after this
        self.include_stop = include_stop
        # the prompt primes it: the output's text continues it, as the answer's does
        self.text = IncrementalDetokenizer(decode, prime)
        self.tail = ""

    def feed(self, token_ids: list[int]) -> int | None:
        """Where the output text is cut if it now holds a stop string (after the string with
        include_stop, else before it), or None. `token_ids` is the whole output so far."""
        chars = self.text.length
        new = self.text.extend(token_ids[len(self.text.tokens):])
        if not new:
            return None  # no new character yet, or one still incomplete
        window = self.tail + new
        base = chars - len(self.tail)
        found: tuple[int, str] | None = None
        for end, stop in self.automaton.iter(window):
            match = (end - len(stop) + 1, stop)
            if found is None or match < found:
                found = match
        self.tail = window[-self.keep:] if self.keep else ""
        if found is None:
            return None
        start, stop = found
        return base + start + (len(stop) if self.include_stop else 0)


@functools.lru_cache(maxsize=64)
def automaton(stops: tuple[str, ...]) -> ahocorasick.Automaton:
    """The Aho-Corasick automaton of `stops`, built once per set: a client's requests mostly
    repeat theirs, and building one for many long strings costs the engine's thread more than
    a step. Read-only once made, so scanners share it."""
    made = ahocorasick.Automaton()
    for stop in stops:
        made.add_word(stop, stop)
    made.make_automaton()
    return made
