"""The cost of a streamed token's text, by output length: incremental against whole decodes.

    PYTHONPATH=. .venv/bin/python benchmarks/stream_text.py [--lengths 256 1024 4096 16384]

Streams one choice token by token through serve's `Texts` (what the SSE loop calls per
token: incremental detokenization) and, for comparison, decodes the whole output so far per
token (what it did before). Prints the mean microseconds per token for each output length and
tokenizer: the byte tokenizer of synthetic models (text with multi-byte characters) and a
word-level `tokenizers` tokenizer (benchmarks/vs_vllm.py's kind, 16,000 words).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from tokenizers import Tokenizer, models, pre_tokenizers

from engine.batch import RequestOutput
from engine.config import SamplingParams
from engine.model.tokenizer import ByteTokenizer, continuation
from engine.serve.completions import Choice, Texts

PROMPT = [5, 6, 7, 8]


def word_level(vocab: int) -> Callable[[list[int]], str]:
    words = {f"w{i}": i for i in range(vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer.decode


def incremental_us(decode: Callable[[list[int]], str], tokens: list[int]) -> float:
    texts = Texts(decode, SamplingParams(stop=("</answer>",)))  # holds back 8 characters
    choice = Choice(0, PROMPT)
    start = time.perf_counter()
    for token in tokens:
        choice.add(RequestOutput("x", (token,), False, None, "DECODING"))
        texts.delta(choice)
    return (time.perf_counter() - start) / len(tokens) * 1e6


def whole_us(decode: Callable[[list[int]], str], tokens: list[int], limit_s: float) -> float:
    """Per token, the whole output's decode; stops early past `limit_s` (a mean of the start
    would flatter it, so it times the last tokens only)."""
    tail = tokens[-64:]
    start = time.perf_counter()
    for i in range(len(tokens) - len(tail), len(tokens)):
        continuation(decode, PROMPT, tokens[:i + 1])
        if time.perf_counter() - start > limit_s:
            return (time.perf_counter() - start) / (i + 1 - len(tokens) + len(tail)) * 1e6
    return (time.perf_counter() - start) / len(tail) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    args = parser.parse_args()
    rng = random.Random(0)
    byte = ByteTokenizer(320)
    text = "".join(rng.choice("abcdef é€😀\n") for _ in range(max(args.lengths)))
    sources = {"bytes": (byte.decode, byte.encode(text)),
               "word-level": (word_level(16000),
                              [rng.randrange(16000) for _ in range(max(args.lengths))])}
    print(f"{'tokenizer':<11} {'tokens':>7} {'incremental us/token':>21} "
          f"{'whole decode us/token':>22}")
    for name, (decode, tokens) in sources.items():
        for length in args.lengths:
            part = tokens[:length]
            print(f"{name:<11} {length:>7} {incremental_us(decode, part):>21.1f} "
                  f"{whole_us(decode, part, 2.0):>22.1f}", flush=True)


if __name__ == "__main__":
    main()
