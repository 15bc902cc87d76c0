"""One 512-token prefill chunk and one decode step at batch 32 with 512 tokens of context on
synthetic:150m, as fractions of this machine's matmul peak and memory bandwidth, both measured
in the same run (issue 2). Prints JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/step_micro.py [--model synthetic:150m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine import Engine, EngineConfig, SamplingParams
from engine.budget import StepShape
from engine.request import Request, RequestState
from engine.scheduler import ScheduledChunk


def _timed(engine: Engine, chunks: list[ScheduledChunk], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        engine.runner.run(chunks)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.runner.run(chunks)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _request(engine: Engine, rid: str, tokens: int, state: RequestState) -> Request:
    request = Request(rid, [3 + i % 250 for i in range(tokens)], SamplingParams(max_tokens=1),
                      arrival=0.0, state=state)
    engine.blocks.grow(request, tokens)
    return request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:150m")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, device="cpu", dtype="float32",
                                 kv_cache_bytes=1 << 30, max_model_len=4096))
    peaks = engine.peaks

    prefill = _request(engine, "prefill", args.chunk, RequestState.PREFILL_CHUNKING)
    prefill_chunks = [ScheduledChunk(prefill, 0, args.chunk)]
    prefill_s = _timed(engine, prefill_chunks, 2, args.repeats)
    prefill_shape = StepShape(prefill=((args.chunk, 0),))

    decodes = []
    for i in range(args.batch):
        request = _request(engine, f"d{i}", args.context, RequestState.DECODING)
        request.num_computed_tokens = args.context - 1
        decodes.append(ScheduledChunk(request, args.context - 1, 1))
    decode_s = _timed(engine, decodes, 3, args.repeats)
    decode_shape = StepShape(decode_contexts=(args.context - 1,) * args.batch)

    budget = engine.budget
    prefill_flops = budget.flops(prefill_shape)
    decode_bytes = budget.bytes_moved(decode_shape)
    print(json.dumps({
        "model": args.model,
        "params": budget.params,
        "peak_flops": peaks.flops,
        "peak_bandwidth": peaks.bandwidth,
        "peaks_source": peaks.source,
        "prefill": {"tokens": args.chunk, "seconds": prefill_s, "flops": prefill_flops,
                    "achieved_flops": prefill_flops / prefill_s,
                    "mfu": prefill_flops / prefill_s / peaks.flops},
        "decode": {"batch": args.batch, "context": args.context, "seconds": decode_s,
                   "bytes": decode_bytes, "achieved_bandwidth": decode_bytes / decode_s,
                   "mbu": decode_bytes / decode_s / peaks.bandwidth},
    }, indent=2))


if __name__ == "__main__":
    main()
