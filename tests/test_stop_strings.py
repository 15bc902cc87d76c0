"""Stop strings found as tokens arrive agree with a search of the whole text, at any split."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.stops import StopScanner
from engine.model.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer(512)
ALPHABET = "abé€ \n"


def whole_text_cut(tokens: list[int], stops: list[str], include: bool) -> tuple[int, int] | None:
    """(tokens read, cut) of the first prefix whose whole decode holds a stop string."""
    for count in range(1, len(tokens) + 1):
        text = TOKENIZER.decode(tokens[:count]).rstrip("\ufffd")
        found = [(at, stop) for stop in stops if (at := text.find(stop)) >= 0]
        if found:
            at, stop = min(found)
            return count, at + len(stop) if include else at
    return None


def scanned_cut(tokens: list[int], stops: list[str], include: bool) -> tuple[int, int] | None:
    scanner = StopScanner(stops, include, TOKENIZER.decode)
    for count in range(1, len(tokens) + 1):
        cut = scanner.feed(tokens[:count])
        if cut is not None:
            return count, cut
    return None


@settings(max_examples=300, deadline=None)
@given(text=st.text(ALPHABET, max_size=40),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=5),
       include=st.booleans())
def test_the_scanner_cuts_where_a_whole_text_search_does(text: str, stops: list[str],
                                                         include: bool) -> None:
    tokens = TOKENIZER.encode(text)  # multi-byte characters arrive a byte at a time
    assert scanned_cut(tokens, stops, include) == whole_text_cut(tokens, stops, include)


def test_invalid_bytes_do_not_hold_the_scan_forever() -> None:
    lone = [0x80 + ByteTokenizer.OFFSET] * 20  # continuation bytes that never complete
    tokens = lone + TOKENIZER.encode("END")
    assert scanned_cut(tokens, ["END"], False) == whole_text_cut(tokens, ["END"], False)


def test_a_scan_reads_each_new_character_once_whatever_the_output_length() -> None:
    read: list[int] = []

    def decode(ids: list[int]) -> str:
        read.append(len(ids))
        return TOKENIZER.decode(ids)

    scanner = StopScanner(["never"], False, decode)
    tokens = TOKENIZER.encode("x" * 5000)
    for count in range(1, len(tokens) + 1):
        assert scanner.feed(tokens[:count]) is None
    assert max(read) <= 2  # the window, never the output so far


def test_scanners_of_the_same_stop_strings_share_one_automaton() -> None:
    stops = [f"{chr(0x4e00 + i)}{'z' * 62}" for i in range(64)]
    first = StopScanner(stops, False, TOKENIZER.decode)
    second = StopScanner(list(stops), True, TOKENIZER.decode)
    assert first.automaton is second.automaton
    assert StopScanner(stops[:-1], False, TOKENIZER.decode).automaton is not first.automaton
    tokens = TOKENIZER.encode("ab" + stops[7] + "cd")
    assert scanned_cut(tokens, stops, True) == whole_text_cut(tokens, stops, True)
