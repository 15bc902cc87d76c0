"""Tokenizers: a byte-level one for synthetic models, `tokenizers` for model directories."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizerImpl

from engine.errors import ModelLoadError


class Tokenizer(Protocol):
    """`add_special_tokens` applies the tokenizer's own rules (a BOS where its post-processor
    adds one); `skip_special_tokens` leaves special tokens' text out, as transformers does."""

    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def piece(self, token_id: int) -> str | None: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past three special ids, so any text works with any vocab >= 259."""

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256 + self.OFFSET:
            raise ValueError("a byte tokenizer needs a vocabulary of at least 259")
        self.eos_token_ids = (self.EOS,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # it has no post-processor: no special token is ever added, as vLLM has none to add
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # PAD, BOS and EOS have no text, skipped or not
        data = bytes(t - self.OFFSET for t in token_ids if self.OFFSET <= t < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str | None:
        """A token's vocabulary string: the three specials by name, a printable ASCII byte as
        itself, any other byte as SentencePiece writes a byte ("<0x0A>"); None past them."""
        if 0 <= token_id < self.OFFSET:
            return ("<pad>", "<s>", "</s>")[token_id]
        byte = token_id - self.OFFSET
        if not 0 <= byte < 256:
            return None
        return chr(byte) if 0x21 <= byte <= 0x7E else f"<0x{byte:02X}>"


class HFTokenizer:
    def __init__(self, path: Path, eos_token_ids: tuple[int, ...]) -> None:
        try:
            self._tokenizer = HFTokenizerImpl.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for any bad file
            raise ModelLoadError(f"{path} is not a tokenizer file the tokenizers library reads "
                                 f"({exc}); re-export the model's tokenizer") from None
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # tokenizer.json's post-processor decides, as transformers 5 does when the file exists
        # (it then drops tokenizer_config.json's add_bos_token / add_eos_token)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def to_str(self) -> str:
        """The tokenizer as tokenizer.json holds it (what grammar libraries read)."""
        return self._tokenizer.to_str()

    def piece(self, token_id: int) -> str | None:
        """The vocabulary's string for `token_id` (None past it)."""
        return self._tokenizer.id_to_token(token_id)

    def special_ids(self) -> set[int]:
        return {i for i, token in self._tokenizer.get_added_tokens_decoder().items()
                if token.special}


CONTEXT_TOKENS = 4  # enough of the prompt to settle how its continuation's first token reads


def continuation(decode: Callable[[list[int]], str], prompt: Sequence[int],
                 output: list[int]) -> str:
    """The text `output` adds after `prompt`, as a detokenizer primed with the prompt reads
    it (vLLM's is): SentencePiece tokenizers drop a text's leading space, not a continuation's."""
    head = list(prompt[-CONTEXT_TOKENS:])
    if not output or not head:
        return decode(output)
    before = decode(head)
    whole = decode(head + output)
    return whole[len(before):] if whole.startswith(before) else decode(output)
