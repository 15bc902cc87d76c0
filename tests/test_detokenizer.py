"""Streamed text read incrementally is the whole decode's text, for any tokens and any split."""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.batch import RequestOutput
from engine.config import SamplingParams
from engine.model.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from engine.model.tokenizer import ByteTokenizer, HFTokenizer, continuation
from engine.serve.completions import Choice, Texts

SPECIALS = ["<unk>", "<s>", "</s>"]
TRAINING = ["the budget of a step is spent on decodes first, then on chunks",
            "naïve café, 3 € each; 😀 and 中文 text with ünïcödé", "def f(x):\n    return x"]


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    """A byte-level BPE (GPT-2's scheme): its tokens split multi-byte characters."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TRAINING, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _saved(tokenizer, tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def word_level(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    """A word-level tokenizer (benchmarks/vs_vllm.py's kind): whole words joined by spaces."""
    words = sorted({w for line in TRAINING for w in line.split()})
    vocab = {w: i for i, w in enumerate([*SPECIALS, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIALS)
    return _saved(tokenizer, tmp_path_factory.mktemp("word"))


def _saved(tokenizer: Tokenizer, folder: Path) -> HFTokenizer:
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return HFTokenizer(path, eos_token_ids=(2,))


def _vocab(tokenizer: object) -> int:
    if isinstance(tokenizer, ByteTokenizer):
        return 256 + ByteTokenizer.OFFSET
    return tokenizer._tokenizer.get_vocab_size()  # type: ignore[attr-defined]


def streamed(texts: Texts, tokens: list[int], splits: list[int], last: RequestOutput
             ) -> tuple[str, str]:
    """(every delta joined, final text) of one choice fed `tokens` in pieces cut at `splits`."""
    choice = Choice(0, [5, 6, 7])
    cuts = sorted({0, *(s % (len(tokens) + 1) for s in splits), len(tokens)})
    out = []
    for start, end in itertools.pairwise(cuts):
        finished = end == len(tokens)
        output = (RequestOutput("x", tuple(tokens[start:end]), False, None, "DECODING")
                  if not finished else RequestOutput(
                      "x", tuple(tokens[start:end]), True, last.finish_reason, "FINISHED",
                      text_end=last.text_end))
        choice.add(output)
        out.append(texts.delta(choice))
    return "".join(out), texts.final(choice)


@pytest.mark.parametrize("kind", ["bytes", "byte_bpe", "word_level"])
@pytest.mark.parametrize("skip", [True, False])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_streamed_text_is_the_whole_decode_for_random_tokens(
        kind: str, skip: bool, data: st.DataObject, request: pytest.FixtureRequest) -> None:
    tokenizer = ByteTokenizer(300) if kind == "bytes" else request.getfixturevalue(kind)
    decode = functools.partial(tokenizer.decode, skip_special_tokens=skip)
    ids = st.integers(0, _vocab(tokenizer) - 1)
    tokens = data.draw(st.lists(ids, max_size=60))
    splits = data.draw(st.lists(st.integers(0, 60), max_size=12))
    whole = continuation(decode, [5, 6, 7], tokens).rstrip("\ufffd")
    joined, final = streamed(Texts(decode, SamplingParams()), tokens, splits,
                             RequestOutput("x", (), True, "length", "FINISHED"))
    assert joined == final
    # the whole decode, but for invalid bytes at the end: held back while they may still be a
    # character's start, streamed once enough tokens show they are not
    assert final.rstrip("\ufffd") == whole
    assert set(final[len(whole):]) <= {"\ufffd"}


@pytest.mark.parametrize("kind", ["bytes", "byte_bpe"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stop_strings_hold_back_and_cut_as_the_whole_text(
        kind: str, data: st.DataObject, request: pytest.FixtureRequest) -> None:
    """Text that may start a stop string is not sent while the choice runs; the end is cut
    where the engine said (`text_end`), and the stop token itself has no text."""
    tokenizer = ByteTokenizer(300) if kind == "bytes" else request.getfixturevalue(kind)
    text = data.draw(st.text("ab é€😀", max_size=30))
    tokens = tokenizer.encode(text)
    stops = data.draw(st.lists(st.text("ab é", min_size=1, max_size=3), min_size=1, max_size=3))
    cut = None
    for count in range(1, len(tokens) + 1):  # the engine stops at the first token that
        so_far = continuation(tokenizer.decode, [5, 6, 7], tokens[:count]).rstrip("\ufffd")
        found = [(at, s) for s in stops if (at := so_far.find(s)) >= 0]
        if found:  # completes a stop string
            tokens, cut = tokens[:count], min(found)[0]
            break
    params = SamplingParams(max_tokens=64, stop=tuple(stops))
    texts = Texts(tokenizer.decode, params, eos_token_ids=(2,))
    last = RequestOutput("x", (), True, "length" if cut is None else "stop", "FINISHED",
                         text_end=cut)
    joined, final = streamed(texts, tokens, data.draw(st.lists(st.integers(0, 60))), last)
    expected = continuation(tokenizer.decode, [5, 6, 7], tokens).rstrip("\ufffd")[:cut]
    assert final == expected and joined == expected


def test_an_eos_that_stops_a_choice_has_no_text() -> None:
    tokenizer = ByteTokenizer(300)
    texts = Texts(tokenizer.decode, SamplingParams(skip_special_tokens=False), (2,))
    tokens = [*tokenizer.encode("ok"), 2]
    joined, final = streamed(texts, tokens, [1, 2],
                             RequestOutput("x", (), True, "stop", "FINISHED"))
    assert joined == final == "ok"


def test_a_long_run_of_invalid_bytes_is_read_in_bounded_windows() -> None:
    """Continuation bytes that never complete still come out, as U+FFFD, and the window moves
    on; a character split over the pending limit still comes out whole."""
    tokenizer = ByteTokenizer(300)
    read: list[int] = []

    def decode(ids: list[int]) -> str:
        read.append(len(ids))
        return tokenizer.decode(ids)

    tokens = ([0xFF + ByteTokenizer.OFFSET, 0xE2 + ByteTokenizer.OFFSET] * 40
              + tokenizer.encode("€x"))
    detokenizer = IncrementalDetokenizer(decode)
    for token in tokens:
        detokenizer.extend([token])
    assert detokenizer.text + detokenizer.pending() == tokenizer.decode(tokens)
    assert max(read) <= 2 * 4 * MAX_PENDING_TOKENS  # the run is 80 tokens long


@pytest.mark.parametrize("first", [33, 35, 42])  # 1, 3 and 2 bytes into an emoji
def test_a_character_begun_in_a_long_call_still_comes_out_whole(first: int) -> None:
    """Tokens that arrive many at once and end inside a character keep it pending: the
    window moves on before it, and its last bytes finish it."""
    tokenizer = ByteTokenizer(300)
    text = "a a a" + "é" * 5 + "€" * 3 + "😀" * 9
    tokens = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer.decode)
    got = detokenizer.extend(tokens[:first]) + detokenizer.extend(tokens[first:first + 1])
    got += detokenizer.extend(tokens[first + 1:])
    assert got == detokenizer.text == text


def test_each_token_decodes_a_window_whatever_the_output_length() -> None:
    read: list[int] = []
    tokenizer = ByteTokenizer(300)

    def decode(ids: list[int]) -> str:
        read.append(len(ids))
        return tokenizer.decode(ids)

    texts = Texts(decode, SamplingParams())
    choice = Choice(0, [])
    rng = random.Random(0)
    text = "".join(rng.choice("ab é€😀\n") for _ in range(3000))
    sent = []
    for token in tokenizer.encode(text):
        choice.add(RequestOutput("x", (token,), False, None, "DECODING"))
        sent.append(texts.delta(choice))
    assert "".join(sent) == text
    assert max(read) <= 2 * 4  # a character's bytes and the one before: never the output
    # a window is decoded once a token (its prefix and itself), not again for the chunk
    assert len(read) <= 2 * len(tokenizer.encode(text))


def _decode_of(tokenizer: HFTokenizer) -> Callable[[list[int]], str]:
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def test_word_level_continuations_keep_the_space_before_each_word(
        word_level: HFTokenizer) -> None:
    tokens = word_level.encode("the budget of a step")
    joined, final = streamed(Texts(_decode_of(word_level), SamplingParams()), tokens,
                             [1, 2, 3, 4], RequestOutput("x", (), True, "length", "FINISHED"))
    assert joined == final == " the budget of a step"
