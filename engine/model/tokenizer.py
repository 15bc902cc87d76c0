"""Tokenizers: a byte-level one for synthetic models, `tokenizers` for model directories."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizerImpl


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past three special ids, so any text works with any vocab >= 259."""

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256 + self.OFFSET:
            raise ValueError("a byte tokenizer needs a vocabulary of at least 259")
        self.eos_token_ids = (self.EOS,)

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        data = bytes(t - self.OFFSET for t in token_ids if self.OFFSET <= t < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = HFTokenizerImpl.from_file(str(path))
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)
