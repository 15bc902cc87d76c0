"""Structured output: every output of many random JSON schemas parses and validates, and
what the grammar masks cost a step.

Part 1 runs `--schemas` random schemas (tests/random_schemas.py) through the engine on
synthetic:tiny at temperature 1, `--batch` in flight at once, so the logits are random and
each step masks a batch of different grammars; it counts outputs that parse and validate,
and times the logits processors against the whole step.

Part 2 times `LogitsProcessors.apply` alone on random logits over a byte-level vocabulary of
`--vocab` tokens (random byte strings, as a BPE vocabulary's are), for batches of 1 to 32
JSON-schema requests, each advanced by the token it samples.

    python -m benchmarks.structured_output --schemas 1000 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import Engine, EngineConfig
from engine.config import SamplingParams
from engine.core.logits_processors import LogitsProcessors
from engine.core.runner_requests import RunnerRequest
from engine.model.tokenizer import HFTokenizer
from engine.serve.protocol import SamplingFields
from engine.serve.structured import structured_grammar
from tests.random_schemas import matches, random_schema


def schemas_through_the_engine(count: int, batch: int, seed: int) -> dict[str, float]:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    processors = engine.runner.logits_processors  # type: ignore[attr-defined]
    spent = [0.0]
    apply = processors.apply

    def timed(logits: torch.Tensor, requests: list[RunnerRequest]) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return apply(logits, requests)
        finally:
            spent[0] += time.perf_counter() - start

    processors.apply = timed  # type: ignore[method-assign]
    rng = random.Random(seed)
    valid = failed = steps = tokens_out = 0
    started = time.perf_counter()
    failures: list[str] = []
    for first in range(0, count, batch):
        asked: dict[str, tuple[dict[str, object], list[int]]] = {}
        for i in range(first, min(first + batch, count)):
            schema = random_schema(rng)
            grammar = structured_grammar(SamplingFields(guided_json=schema))
            request_id = engine.add_request("{", SamplingParams(
                max_tokens=2000, temperature=1.0, seed=i, structured_output=grammar))
            asked[request_id] = (schema, [])
        while engine.has_unfinished():
            steps += 1
            for output in engine.step():
                if output.request_id not in asked:
                    continue
                schema, tokens = asked[output.request_id]
                tokens += output.new_token_ids
                if output.finished:
                    tokens_out += len(tokens)
                    why = matches(engine.tokenizer.decode(tokens), schema)
                    if why is None and output.finish_reason == "stop":
                        valid += 1
                    else:
                        failed += 1
                        failures.append(f"{output.finish_reason}: {why}")
    total = time.perf_counter() - started
    for failure in failures[:5]:
        print("  failed:", failure)
    return {"schemas": count, "valid": valid, "failed": failed, "steps": steps,
            "tokens": tokens_out, "seconds": total, "processors_s": spent[0],
            "processors_per_step_us": spent[0] / steps * 1e6,
            "share_of_step": spent[0] / total}


def byte_level_vocabulary(size: int, directory: Path, seed: int) -> HFTokenizer:
    """A tokenizer.json of `size` byte-level tokens: the 256 bytes, then random strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    letters = "abcdefghijklmnopqrstuvwxyz\"{}[]:,0123456789 Ġ"
    vocab = {"<|endoftext|>": 0}
    for symbol in sorted(alphabet):
        vocab.setdefault(symbol, len(vocab))
    while len(vocab) < size:
        vocab.setdefault("".join(rng.choice(letters) for _ in range(rng.randint(2, 8))),
                         len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return HFTokenizer(path, (0,))


def mask_cost(vocab: int, batches: list[int], steps: int, seed: int) -> list[dict[str, float]]:
    rows = []
    with tempfile.TemporaryDirectory() as work:
        tokenizer = byte_level_vocabulary(vocab, Path(work), seed)
        rng = random.Random(seed)
        for batch in batches:
            processors = LogitsProcessors(tokenizer, vocab)
            grammars = [structured_grammar(SamplingFields(guided_json=random_schema(rng)))
                        for _ in range(batch)]
            requests = [RunnerRequest(str(i), [0], 1, SamplingParams(
                max_tokens=10_000, structured_output=g), []) for i, g in enumerate(grammars)]
            generator = torch.Generator().manual_seed(seed)
            times = []
            for _ in range(steps):
                logits = torch.randn(batch, vocab, generator=generator)
                start = time.perf_counter()
                processors.apply(logits, requests)
                masked = logits
                times.append(time.perf_counter() - start)
                for row, request in enumerate(requests):
                    allowed = masked[row].isfinite()
                    if allowed.any() and not (allowed.sum() == 1 and allowed[0]):
                        request.token_ids.append(int(masked[row].argmax()))
                    else:  # its JSON is complete: start it again
                        del request.token_ids[1:]
                        processors._tracked.pop(request, None)
            rows.append({"vocab": vocab, "batch": batch,
                         "median_ms": statistics.median(times) * 1e3,
                         "p90_ms": sorted(times)[int(len(times) * 0.9)] * 1e3,
                         "per_request_us": statistics.median(times) / batch * 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemas", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.schemas:
        print(json.dumps(schemas_through_the_engine(args.schemas, args.batch, args.seed)))
    if args.vocab:
        for row in mask_cost(args.vocab, [1, 8, 32], args.steps, args.seed):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
