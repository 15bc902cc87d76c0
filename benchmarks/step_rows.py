"""What each running request adds to a decode step: the median wall time of `Engine.step()`
with N requests decoding on synthetic:tiny (vocab 320, hidden 64, 2 layers: a step is almost
all host work), at temperature 1 (sampling runs) and 0 (greedy), built as `tokenflow serve`
builds its engine on the CPU. Variants and sizes are interleaved round by round, so a busy
machine slows them alike. Prints JSON: each variant's step ms by N and the ms each row over
the first adds.

    PYTHONPATH=. .venv/bin/python benchmarks/step_rows.py [--rows 1 17 33] [--rounds 5]

`--churn N`: instead, serve's steady state under N clients: N requests of 64 tokens
(temperature 1) on the prompt "hello there", each replaced by a new one as it ends, so
some steps also admit and prefill; the median, mean and p90 step ms over 3,000 steps.

    PYTHONPATH=. .venv/bin/python benchmarks/step_rows.py --churn 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from console.cli.engine_flags import SERVE_MIXED_STEP_PREFILL_TOKENS
from engine import Engine, EngineConfig, SamplingParams
from engine.slo_targets import CHAT_ITL_MS, CHAT_TTFT_MS

PROMPT_TOKENS = 16
TEMPERATURES = {"temperature_1": 1.0, "temperature_0": 0.0}


def serve_engine(model: str) -> Engine:
    """An engine as `tokenflow serve --model MODEL --device cpu --dtype float32` makes it."""
    return Engine(EngineConfig(model=model, device="cpu", dtype="float32",
                               slo_ttft_ms=CHAT_TTFT_MS, slo_itl_ms=CHAT_ITL_MS,
                               mixed_step_prefill_tokens=SERVE_MIXED_STEP_PREFILL_TOKENS))


def step_ms(engine: Engine, rows: int, params: SamplingParams, steps: int,
            warmup: int) -> list[float]:
    """Each of `steps` decode steps' wall ms with `rows` requests decoding (then aborted)."""
    ids = [engine.add_request([3 + (i * 7 + j) % 250 for j in range(PROMPT_TOKENS)], params)
           for i in range(rows)]
    live = engine.scheduler.requests
    if len(live) != rows:
        raise SystemExit(f"{rows - len(live)} of {rows} requests were not admitted")
    while any(not r.is_decoding for r in live.values()):
        engine.step()
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    for rid in ids:
        engine.abort(rid)
    engine.step()  # books the aborts
    return times


def measure(model: str, rows: list[int], rounds: int, steps: int,
            warmup: int) -> dict[str, object]:
    engine = serve_engine(model)
    # as long as the model allows: every request decodes through the round
    longest = engine.max_model_len - PROMPT_TOKENS
    variants = {name: SamplingParams(max_tokens=longest, temperature=t, ignore_eos=True)
                for name, t in TEMPERATURES.items()}
    if longest < warmup + steps + 8:
        raise SystemExit(f"{model} holds {engine.max_model_len} tokens: too few for "
                         f"{warmup + steps} steps")
    times: dict[tuple[str, int], list[float]] = {(v, n): [] for v in variants for n in rows}
    for _ in range(rounds):
        for name, params in variants.items():
            for n in rows:
                times[name, n] += step_ms(engine, n, params, steps, warmup)
    engine.close()
    result: dict[str, object] = {"model": model, "rounds": rounds, "steps_per_round": steps}
    for name in variants:
        ms = {n: statistics.median(times[name, n]) for n in rows}
        base = min(rows)
        result[name] = {
            "step_ms": {str(n): round(v, 4) for n, v in ms.items()},
            "us_per_extra_row": {str(n): round((ms[n] - ms[base]) / (n - base) * 1e3, 2)
                                 for n in rows if n != base}}
    return result


def churn(model: str, clients: int, steps: int = 3_000, warmup: int = 200
          ) -> dict[str, object]:
    """Step ms with `clients` 64-token requests in flight, each replaced as it ends."""
    engine = serve_engine(model)
    prompt = engine.prompt_token_ids("hello there")
    params = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True)
    for _ in range(clients):
        engine.add_request(prompt, params)
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        outputs = engine.step()
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
        for output in outputs:
            if output.finished:
                engine.add_request(prompt, params)
    engine.close()
    times.sort()
    return {"model": model, "clients": clients, "steps": steps,
            "step_ms": {"median": round(statistics.median(times), 4),
                        "mean": round(statistics.fmean(times), 4),
                        "p90": round(times[int(0.9 * len(times))], 4)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:tiny")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 17, 33])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--churn", type=int, default=0, metavar="N",
                        help="instead: N 64-token requests, each replaced as it ends")
    args = parser.parse_args()
    if args.churn:
        print(json.dumps(churn(args.model, args.churn), indent=2))
        return
    print(json.dumps(measure(args.model, args.rows, args.rounds, args.steps, args.warmup),
                     indent=2))


if __name__ == "__main__":
    main()
