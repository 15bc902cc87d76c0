"""Output text read as tokens arrive, at a cost per token that does not grow with the output."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.model.tokenizer import continuation

REPLACEMENT = "\ufffd"
# A UTF-8 character spans at most 4 bytes, so at most 4 byte-level tokens: past this many
# pending tokens a text still ending in U+FFFD holds invalid bytes, not a character in progress.
MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    """One output's text, decoded as vLLM's incremental detokenizer decodes it.

    Each call decodes a short window only: the tokens since the last complete text, and the
    few before them (`prefix_offset`), so merges and leading spaces come out as in a whole
    decode. A text ending in U+FFFD waits for its character's next bytes; after
    MAX_PENDING_TOKENS tokens all but that last character is taken, since a decoder gives an
    unfinished UTF-8 sequence at the end one U+FFFD and nothing before it changes. A window
    four times that long moves on, keeping a character in progress pending however many
    tokens came in one call. The first window continues the prompt (`prime`), as the
    answer's text does."""

    def __init__(self, decode: Callable[[list[int]], str], prime: Sequence[int] = ()) -> None:
        self.decode = decode
        self.prime = prime
        self.tokens: list[int] = []
        self.pieces: list[str] = []  # every complete character so far, as it came
        self.length = 0  # characters in `pieces`
        self.prefix_offset = 0
        self.read_offset = 0
        self.taken = 0  # characters past the window's prefix already in `text`
        # the last few token ranges decoded (tokens only grow, so a range's text stays): the
        # window read for one token is the prefix of the next, and pending() follows extend()
        self._decoded: dict[tuple[int, int], str] = {}

    def extend(self, token_ids: Sequence[int]) -> str:
        """Add `token_ids`; the characters they complete (added to `text`)."""
        self.tokens += token_ids
        prefix, window = self._window()
        new = window[len(prefix) + self.taken:] if len(window) > len(prefix) else ""
        pending = len(self.tokens) - self.read_offset
        if not new:
            return ""
        end = len(self.tokens)
        if new.endswith(REPLACEMENT):
            if pending < MAX_PENDING_TOKENS:
                return ""  # a character in progress: its next bytes may finish it
            if pending < 4 * MAX_PENDING_TOKENS:
                new = new[:-1]
                self.taken += len(new)
                self._add(new)
                return new
            # a long window moves on, so the cost stays bounded: up to a character still in
            # progress, or past a run of invalid bytes (which come out as U+FFFD)
            end = self._last_whole()
            if end < len(self.tokens):
                new = self._text(self.prefix_offset, end)[len(prefix) + self.taken:]
        self.prefix_offset, self.read_offset = self.read_offset, end
        self.taken = 0
        self._add(new)
        return new

    @property
    def text(self) -> str:
        """Every complete character so far (joined once, then kept joined)."""
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def since(self, start: int) -> str:
        """`text[start:]`, read from the last pieces only."""
        parts: list[str] = []
        size = self.length
        for piece in reversed(self.pieces):
            if size <= start:
                break
            parts.append(piece)
            size -= len(piece)
        return "".join(reversed(parts))[max(0, start - size):]

    def pending(self) -> str:
        """The characters after `text` so far, the last maybe still in progress (U+FFFD)."""
        prefix, window = self._window()
        return window[len(prefix) + self.taken:]

    def _add(self, new: str) -> None:
        self.pieces.append(new)
        self.length += len(new)

    def _last_whole(self) -> int:
        """Where the window's text last ends on a whole character: the end less the tokens of
        a character in progress (at most 3 of its bytes, so 3 tokens), or the end itself."""
        for back in (1, 2, 3):
            end = len(self.tokens) - back
            if end > self.read_offset and not self._text(self.prefix_offset,
                                                          end).endswith(REPLACEMENT):
                return end
        return len(self.tokens)

    def _window(self) -> tuple[str, str]:
        """The decoded prefix (tokens already read) and the decoded window (all since it)."""
        return (self._text(self.prefix_offset, self.read_offset),
                self._text(self.prefix_offset, len(self.tokens)))

    def _text(self, start: int, end: int) -> str:
        found = self._decoded.get((start, end))
        if found is None:
            ids = self.tokens[start:end]
            # only the first window starts the output
            found = continuation(self.decode, self.prime, ids) if start == 0 else self.decode(ids)
            if len(self._decoded) >= 4:
                self._decoded.clear()
            self._decoded[start, end] = found
        return found
