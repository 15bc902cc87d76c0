"""One 512-token prefill chunk and one decode step at batch 32 with 512 tokens of context on
synthetic:150m, as fractions of this machine's matmul peak and memory bandwidth, both measured
in the same run (issue 2); CUDA events time it on a GPU. Prints JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/step_micro.py [--model synthetic:150m]
    PYTHONPATH=. .venv/bin/python benchmarks/step_micro.py --model synthetic:small --curve
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from engine import Engine, EngineConfig, SamplingParams
from engine.budget.calibrate import timed_step
from engine.core.batch import Batch, ScheduledChunk, StepShape
from engine.core.request import Request, RequestState


def _engine(model: str, device: str, dtype: str) -> Engine:
    """A 1 GiB KV pool on CPU; on a GPU the default share of its free memory."""
    return Engine(EngineConfig(model=model, device=device, dtype=dtype, max_model_len=4096,
                               kv_cache_bytes=(1 << 30) if device == "cpu" else None))


def _timed(engine: Engine, chunks: list[ScheduledChunk], warmup: int, repeats: int) -> float:
    batch = Batch(prefills=[c for c in chunks if not c.is_decode],
                  decodes=[c for c in chunks if c.is_decode])
    for _ in range(warmup):
        timed_step(engine, batch)
    return statistics.median(timed_step(engine, batch) for _ in range(repeats))


def _request(engine: Engine, rid: str, tokens: int, state: RequestState) -> Request:
    request = Request(rid, [3 + i % 250 for i in range(tokens)], SamplingParams(max_tokens=1),
                      arrival=0.0, state=state)
    engine.blocks.grow(request, tokens)
    return request


def _decodes(engine: Engine, count: int, context: int) -> list[ScheduledChunk]:
    """`count` requests, each `context` tokens long, scheduled for their next decode token."""
    chunks = []
    for i in range(count):
        request = _request(engine, f"d{i}", context, RequestState.DECODING)
        request.num_computed_tokens = context - 1
        chunks.append(ScheduledChunk(request, context - 1, 1))
    return chunks


def measure(model: str, *, device: str = "cpu", dtype: str = "float32", chunk: int = 512,
            batch: int = 32, context: int = 512, repeats: int = 10) -> dict[str, Any]:
    """One prefill chunk and one decode step on `model`, against the device's measured peaks
    (CUDA events on a GPU)."""
    engine = _engine(model, device, dtype)
    peaks = engine.peaks

    prefill = _request(engine, "prefill", chunk, RequestState.PREFILL_CHUNKING)
    prefill_s = _timed(engine, [ScheduledChunk(prefill, 0, chunk)], 2, repeats)
    prefill_shape = StepShape(prefill=((chunk, 0),))

    decode_s = _timed(engine, _decodes(engine, batch, context), 3, repeats)
    decode_shape = StepShape(decode_contexts=(context - 1,) * batch)

    budget = engine.budget
    prefill_flops = budget.flops(prefill_shape)
    decode_bytes = budget.bytes_moved(decode_shape)
    return {
        "model": model,
        "device": str(engine.runner.device),
        "attention": "flash-attn" if engine.runner.use_flash else "torch",
        "params": budget.params,
        "peak_flops": peaks.flops,
        "peak_bandwidth": peaks.bandwidth,
        "peaks_source": peaks.source,
        "prefill": {"tokens": chunk, "seconds": prefill_s, "flops": prefill_flops,
                    "achieved_flops": prefill_flops / prefill_s,
                    "mfu": prefill_flops / prefill_s / peaks.flops},
        "decode": {"batch": batch, "context": context, "seconds": decode_s,
                   "bytes": decode_bytes, "achieved_bandwidth": decode_bytes / decode_s,
                   "mbu": decode_bytes / decode_s / peaks.bandwidth},
    }


def step_curve(model: str, *, device: str = "cpu", dtype: str = "float32",
               decodes: tuple[int, ...] = (0, 8, 16, 32),
               prefills: tuple[int, ...] = (0, 16, 48, 112, 240, 496), context: int = 150,
               repeats: int = 7) -> list[dict[str, Any]]:
    """Step time for D decodes (at `context` tokens) beside a P-token prefill chunk: where the
    step stops being a decode floor and starts growing with every token (seed 003 §6).

    `ride_along` is what a prefill token adds to the decode-only step, as a share of what it
    costs in the largest chunk run alone: near 0 where decode is memory-bound and a chunk
    rides along for free (a GPU below C*), near 1 where the machine is compute-bound and
    chunking only moves the same work between steps. `decodes` must include 0."""
    engine = _engine(model, device, dtype)
    running = _decodes(engine, max(decodes), context)
    prefill = _request(engine, "prefill", max(prefills), RequestState.PREFILL_CHUNKING)
    step_ms: dict[tuple[int, int], float] = {}
    for d in decodes:
        for p in prefills:
            if d or p:
                chunks = running[:d] + ([ScheduledChunk(prefill, 0, p)] if p else [])
                step_ms[d, p] = _timed(engine, chunks, 2, repeats) * 1e3
    alone_per_token = step_ms[0, max(prefills)] / max(prefills)
    rows = []
    for (d, p), ms in step_ms.items():
        row = {"decodes": d, "prefill_tokens": p, "step_ms": ms, "tokens_per_s": (d + p) / ms * 1e3}
        if d and p:
            row["ride_along"] = (ms - step_ms[d, 0]) / p / alone_per_token
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic:150m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--curve", action="store_true",
                        help="instead: step time over a grid of decodes x prefill tokens")
    args = parser.parse_args()
    if args.curve:
        print(json.dumps(step_curve(args.model, device=args.device, dtype=args.dtype),
                         indent=2))
        return
    print(json.dumps(measure(args.model, device=args.device, dtype=args.dtype, chunk=args.chunk,
                             batch=args.batch, context=args.context, repeats=args.repeats),
                     indent=2))


if __name__ == "__main__":
    main()
