"""What scoring a prompt costs on the hot path: the prefill of one prompt, plain and with
prompt logprobs (a logits row, log_softmax and top-N per prompt token), measured and as the
budget model prices it.

    python -m benchmarks.prompt_scoring --model synthetic:small --prompt 512 --budget 128
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine import Engine, EngineConfig, SamplingParams
from engine.batch import Batch, ModelRunnerOutput


def prefill_seconds(engine: Engine, prompt: list[int], params: SamplingParams
                    ) -> tuple[float, float]:
    """(measured, predicted) seconds of the steps that prefill `prompt` alone."""
    predicted = 0.0
    original = engine.runner.run

    def run(batch: Batch) -> ModelRunnerOutput:
        nonlocal predicted
        predicted += engine.predict(batch.shape())
        return original(batch)

    engine.runner.run = run  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        rid = engine.add_request(prompt, params)
        while not any(o.request_id == rid and o.finished for o in engine.step()):
            pass
        return time.perf_counter() - start, predicted
    finally:
        engine.runner.run = original  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:small")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--budget", type=int, default=128, help="max_num_batched_tokens")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, device="cpu", dtype="float32",
                                 max_num_batched_tokens=args.budget,
                                 enable_prefix_caching=False))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    results: dict[str, dict[str, float]] = {}
    for name, params in (("plain", SamplingParams(max_tokens=0)),
                         ("scored", SamplingParams(max_tokens=0, prompt_logprobs=1))):
        runs = [prefill_seconds(engine, [rng.randrange(3, vocab) for _ in range(args.prompt)],
                                params) for _ in range(args.repeat)]
        results[name] = {"measured_s_min": min(m for m, _ in runs),
                         "predicted_s": runs[0][1]}
    plain, scored = results["plain"], results["scored"]
    print(json.dumps({
        "model": args.model, "prompt_tokens": args.prompt, "budget": args.budget,
        **results,
        "measured_extra": scored["measured_s_min"] / plain["measured_s_min"] - 1,
        "predicted_extra": scored["predicted_s"] / plain["predicted_s"] - 1}, indent=2))


if __name__ == "__main__":
    main()
