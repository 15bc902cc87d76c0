"""A prompt's token ids at intake: lists and tuples of ints are packed in C, everything else goes
through int() one id at a time, and both give the same ids and the same errors."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest

from engine.core.intake import prompt_token_ids
from engine.errors import RequestError

VOCAB = 1000


def ids(prompt: object) -> list[int]:
    return prompt_token_ids(prompt, lambda text: [ord(c) for c in text], VOCAB)  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt", [
    [5, 6, 999], (0, 1, 2), [True, 7], list(np.arange(3, 9)), (np.int32(4), 11),
    [3.9, 4.0], ["12", "13"], range(5, 9),
])
def test_ids_are_those_int_gives_each(prompt: Iterable[object]) -> None:
    got = ids(prompt)
    assert got == [int(t) for t in prompt]  # type: ignore[call-overload]
    assert all(type(t) is int for t in got)


def test_text_is_encoded() -> None:
    assert ids("ab") == [97, 98]


def test_a_generator_is_read_once() -> None:
    assert ids(t for t in (4, 5.5, 6)) == [4, 5, 6]


@pytest.mark.parametrize("prompt, bad", [
    ([4, 1000, -1], 1000), ((3, -2), -2), ([2**70, 5], 2**70), ([5, 2.0**64], 2**64),
])
def test_the_first_id_outside_the_vocabulary_is_named(prompt: list[object], bad: int) -> None:
    with pytest.raises(RequestError, match=rf"token id {bad} is outside the vocabulary"):
        ids(prompt)


@pytest.mark.parametrize("prompt", [[], ()])
def test_an_empty_prompt_is_refused(prompt: list[int]) -> None:
    with pytest.raises(RequestError, match="the prompt is empty"):
        ids(prompt)


@pytest.mark.parametrize("prompt", [[1, None], (2, "x"), [object()]])
def test_ids_that_are_no_integers_are_refused(prompt: list[object]) -> None:
    with pytest.raises(RequestError, match="integer token ids"):
        ids(prompt)
