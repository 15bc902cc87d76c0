"""One 512-token prefill chunk and one decode step at batch 32 with 512 tokens of context on
synthetic:150m, as fractions of this machine's matmul peak and memory bandwidth, both measured
in the same run; CUDA events time it on a GPU. Prints JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/step_micro.py [--model synthetic:150m]
    PYTHONPATH=. .venv/bin/python benchmarks/step_micro.py --model synthetic:small --curve

`--limits`: on synthetic:small, a decode step at D = 8 as weight-read bandwidth
against the streaming (copy) bandwidth, and a 256-token prefill chunk as FLOP/s against the
matmul peak, each peak measured at the same thread count, at one thread and at the engine's;
three engines side by side in the same process, their steps interleaved, so a busy machine
slows them alike: `graphs` (the CPU default: the kernels, decode steps replayed as CPU
graphs), `eager` (the kernels, every step's Python run: --no-cpu-graphs) and `compiled`
(torch.compile). `cpu_ms` is the process CPU time of a step, which counts neither waiting for
a core nor other processes. Beside the steps: the step's GEMMs alone (the engines' weights,
`batch` rows each: the ceiling the step's kernels allow), the bytes the step moves by the
budget model (weights, and the KV history that weights alone leave out), and a read-only
stream (a sum; the copy that `streaming_bandwidth` times both reads and writes).

    PYTHONPATH=. .venv/bin/python benchmarks/step_micro.py --limits

`--split`: where the eager decode step of `--limits` (no CPU graph) spends its
time, by taking the step with its attention kernel, its GEMMs, or both stubbed out (outputs
left uninitialised, so only for timing), interleaved: attention is what stubbing it saves,
GEMMs likewise, and the rest (norms, RoPE, the cache write, sampling and Python) what remains
with both gone. A part's figure also holds the Python it leaves to run from cold caches:
timed call by call, the step's GEMMs take what they take alone (see the README). Beside
them, `graph`: the same step replayed as a CPU graph, which runs the same kernels without
that Python.

    PYTHONPATH=. .venv/bin/python benchmarks/step_micro.py --split

`--flex`: one layer's decode attention at D = 8, the engine's gather-then-SDPA
path against FlexAttention (compiled) reading the paged cache in place through a block mask
built from the block tables, with the mask's build time (once a step), in process CPU ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine import Engine, EngineConfig, SamplingParams
from engine.batch import Batch, ScheduledChunk, StepShape
from engine.budget.peaks import measure_peaks
from engine.calibration.calibrate import timed_step
from engine.core.request import Request, RequestState
from engine.kernels import attention, cpu_kernels


def _engine(model: str, device: str, dtype: str, compile: bool = False,
            kv_bytes: int = 1 << 30, cpu_graphs: bool = True) -> Engine:
    """A 1 GiB KV pool on CPU; on a GPU the default share of its free memory."""
    return Engine(EngineConfig(model=model, device=device, dtype=dtype, max_model_len=4096,
                               kv_cache_bytes=kv_bytes if device == "cpu" else None,
                               compile=compile, cpu_graphs=cpu_graphs))


def _batch(chunks: list[ScheduledChunk]) -> Batch:
    return Batch(prefills=[c for c in chunks if not c.is_decode],
                 decodes=[c for c in chunks if c.is_decode])


def _timed(engine: Engine, chunks: list[ScheduledChunk], warmup: int, repeats: int) -> float:
    batch = _batch(chunks)
    for _ in range(warmup):
        timed_step(engine, batch)
    return statistics.median(timed_step(engine, batch) for _ in range(repeats))


def _request(engine: Engine, rid: str, tokens: int, state: RequestState) -> Request:
    """A request holding the KV blocks of its `tokens`, lent to the runner for the run."""
    request = Request(rid, [3 + i % 250 for i in range(tokens)], SamplingParams(max_tokens=1),
                      arrival=0.0, state=state)
    engine.blocks.allocate(request, tokens)
    engine.runner.run(Batch(new_requests=[request.entering()]))
    return request


def _decodes(engine: Engine, count: int, context: int) -> list[ScheduledChunk]:
    """`count` requests, each `context` tokens long, scheduled for their next decode token."""
    chunks = []
    for i in range(count):
        request = _request(engine, f"d{i}", context, RequestState.DECODING)
        request.num_computed_tokens = context - 1
        chunks.append(request.chunk(context - 1, 1))
    return chunks


def measure(model: str, *, device: str = "cpu", dtype: str = "float32", chunk: int = 512,
            batch: int = 32, context: int = 512, repeats: int = 10) -> dict[str, Any]:
    """One prefill chunk and one decode step on `model`, against the device's measured peaks
    (CUDA events on a GPU)."""
    engine = _engine(model, device, dtype)
    peaks = engine.peaks

    prefill = _request(engine, "prefill", chunk, RequestState.PREFILL_CHUNKING)
    prefill_s = _timed(engine, [prefill.chunk(0, chunk)], 2, repeats)
    prefill_shape = StepShape(prefill=((chunk, 0),))

    decode_s = _timed(engine, _decodes(engine, batch, context), 3, repeats)
    decode_shape = StepShape(decode_contexts=(context - 1,) * batch)

    budget = engine.budget
    prefill_flops = budget.flops(prefill_shape)
    decode_bytes = budget.bytes_moved(decode_shape)
    return {
        "model": model,
        "device": str(engine.runner.device),
        "attention": "flash-attn" if engine.runner.backend.name == "flash" else "torch",
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
                chunks = running[:d] + ([prefill.chunk(0, p)] if p else [])
                step_ms[d, p] = _timed(engine, chunks, 2, repeats) * 1e3
    alone_per_token = step_ms[0, max(prefills)] / max(prefills)
    rows = []
    for (d, p), ms in step_ms.items():
        row = {"decodes": d, "prefill_tokens": p, "step_ms": ms, "tokens_per_s": (d + p) / ms * 1e3}
        if d and p:
            row["ride_along"] = (ms - step_ms[d, 0]) / p / alone_per_token
        rows.append(row)
    return rows


def limits(model: str = "synthetic:small", *, device: str = "cpu", dtype: str = "float32",
           batch: int = 8, context: int = 256, chunk: int = 256, repeats: int = 15,
           rounds: int = 3) -> dict[str, Any]:
    """Decode weight-read bandwidth and prefill FLOP/s against this machine's measured limits,
    at one thread and at the engine's count, for the three engines (see the
    module's docstring). Peaks are measured afresh at each thread count."""
    engines = {"graphs": _engine(model, device, dtype, kv_bytes=1 << 28),
               "eager": _engine(model, device, dtype, kv_bytes=1 << 28, cpu_graphs=False),
               "compiled": _engine(model, device, dtype, compile=True, kv_bytes=1 << 28)}
    compile_s = engines["compiled"].runner.compile_s
    engine_threads = torch.get_num_threads()  # what ModelRunner chose for the engine
    budget = engines["eager"].budget
    prefill_flops = budget.flops(StepShape(prefill=((chunk, 0),)))
    decode_bytes = budget.bytes_moved(StepShape(decode_contexts=(context - 1,) * batch))
    gemms = _decode_gemms(engines["eager"], batch)
    stream = torch.ones(_READ_BYTES // 4, device=device)
    copy = torch.empty_like(stream)
    steps = {}
    for name, engine in engines.items():
        prefill = _request(engine, "prefill", chunk, RequestState.PREFILL_CHUNKING)
        steps[name] = {"decode": _batch(_decodes(engine, batch, context)),
                       "prefill": _batch([prefill.chunk(0, chunk)])}
    result: dict[str, Any] = {"model": model, "device": device, "batch": batch,
                              "context": context, "chunk": chunk, "compile_s": compile_s,
                              "weight_bytes": budget.weight_bytes,
                              "decode_bytes_moved": decode_bytes, "threads": {}}
    for threads in sorted({1, engine_threads}):
        torch.set_num_threads(threads)
        peaks = measure_peaks.__wrapped__(device, getattr(torch, dtype))  # at this count
        times: dict[tuple[str, str], list[tuple[float, float]]] = {
            (name, kind): [] for name in engines for kind in ("decode", "prefill")}
        alone: dict[str, list[float]] = {"gemms": [], "read": [], "copy": []}
        for _ in range(rounds):  # interleaved: load on the machine hits every variant alike
            for kind, run in (("gemms", gemms), ("read", stream.sum),
                              ("copy", lambda: copy.copy_(stream))):
                run()
                for _ in range(repeats):
                    cpu = time.process_time()
                    run()
                    alone[kind].append(time.process_time() - cpu)
            for name, engine in engines.items():
                for kind, step in steps[name].items():
                    timed_step(engine, step)  # warm
                    for _ in range(repeats if kind == "decode" else max(2, repeats // 5)):
                        cpu = time.process_time()
                        wall = timed_step(engine, step)
                        times[name, kind].append((wall, time.process_time() - cpu))
        gemms_cpu, read_cpu, copy_cpu = (statistics.median(alone[kind])
                                         for kind in ("gemms", "read", "copy"))
        # the copy again by CPU time, as the steps' `cpu` figures are compared against it
        streaming_cpu = 2 * stream.nbytes / copy_cpu
        row: dict[str, Any] = {
            "streaming_bandwidth": peaks.bandwidth,
            "streaming_bandwidth_cpu": streaming_cpu,
            "read_only_bandwidth_cpu": stream.nbytes / read_cpu,
            "matmul_peak_flops": peaks.flops,
            "decode_gemms_alone_cpu_ms": gemms_cpu * 1e3,
            "decode_gemms_alone_weight_read_bandwidth": budget.weight_bytes / gemms_cpu,
            "decode_gemms_alone_cpu_share_of_streaming": budget.weight_bytes / gemms_cpu
            / streaming_cpu,
        }
        for name in engines:
            decode_s, decode_cpu = map(statistics.median, zip(*times[name, "decode"],
                                                              strict=True))
            prefill_s, prefill_cpu = map(statistics.median, zip(*times[name, "prefill"],
                                                                strict=True))
            read = budget.weight_bytes / decode_s
            row[name] = {
                "decode_ms": decode_s * 1e3, "decode_cpu_ms": decode_cpu * 1e3,
                "decode_weight_read_bandwidth": read,
                "decode_share_of_streaming": read / peaks.bandwidth,
                # by CPU time, which a busy machine inflates least
                "decode_cpu_weight_read_bandwidth": budget.weight_bytes / decode_cpu,
                "decode_cpu_share_of_streaming": budget.weight_bytes / decode_cpu
                / streaming_cpu,
                # weights, the KV history, activations and logits (BudgetModel.bytes_moved)
                "decode_cpu_bytes_moved_bandwidth": decode_bytes / decode_cpu,
                "prefill_ms": prefill_s * 1e3, "prefill_cpu_ms": prefill_cpu * 1e3,
                "prefill_flops": prefill_flops / prefill_s,
                "prefill_share_of_matmul_peak": prefill_flops / prefill_s / peaks.flops,
            }
        result["threads"][threads] = row
    torch.set_num_threads(engine_threads)
    return result


def decode_split(model: str = "synthetic:small", *, batch: int = 8, context: int = 256,
                 repeats: int = 15, rounds: int = 6) -> dict[str, Any]:
    """The eager decode step of `limits` (one thread) whole and with attention, its GEMMs or
    both stubbed out, and the same step replayed as a CPU graph, in ms, and what each part
    costs (see the module's docstring)."""
    engine = _engine(model, "cpu", "float32", kv_bytes=1 << 28, cpu_graphs=False)
    graphed = _engine(model, "cpu", "float32", kv_bytes=1 << 28)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    step = _batch(_decodes(engine, batch, context))
    graph_step = _batch(_decodes(graphed, batch, context))
    decode, linear_rows = attention.paged_decode, cpu_kernels.linear_rows

    def no_attention(q: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.empty_like(q)

    def no_gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: Any) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    variants = {"step": (decode, linear_rows), "no_attention": (no_attention, linear_rows),
                "no_gemms": (decode, no_gemm), "neither": (no_attention, no_gemm)}
    times: dict[str, list[float]] = {name: [] for name in (*variants, "graph")}
    try:
        for _ in range(rounds):
            for name, (attend, gemm) in variants.items():
                attention.paged_decode, cpu_kernels.linear_rows = attend, gemm
                timed_step(engine, step)
                times[name] += [timed_step(engine, step) for _ in range(repeats)]
            attention.paged_decode, cpu_kernels.linear_rows = decode, linear_rows
            timed_step(graphed, graph_step)
            times["graph"] += [timed_step(graphed, graph_step) for _ in range(repeats)]
    finally:
        attention.paged_decode, cpu_kernels.linear_rows = decode, linear_rows
        torch.set_num_threads(threads)
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return {"model": model, "batch": batch, "context": context, "ms": ms,
            "attention_ms": ms["step"] - ms["no_attention"],
            "gemms_ms": ms["step"] - ms["no_gemms"], "rest_ms": ms["neither"]}


# far beyond this CPU's 32 MiB of L3, as the copy of measure_peaks
_READ_BYTES = 128 << 20


def _decode_gemms(engine: Engine, rows: int) -> Callable[[], None]:
    """Every GEMM of a `rows`-token step on the engine's own weights (packed as its steps
    read them), in model order, without the rest of the step."""
    linears = [m for m in engine.runner.model.modules() if isinstance(m, nn.Linear)]
    inputs = [torch.randn(rows, m.in_features, device=engine.runner.device,
                          dtype=m.weight.dtype) for m in linears]

    @torch.inference_mode()
    def run() -> None:
        for linear, x in zip(linears, inputs, strict=True):
            linear(x)
    return run


def flex_vs_gather(model: str = "synthetic:small", *, batch: int = 8,
                   contexts: tuple[int, ...] = (256, 1024)) -> list[dict[str, Any]]:
    """Decode attention of layer 0 on CPU: PagedAttention as the engine runs it, against
    flex_attention over the whole cache viewed as one sequence ([1, Hkv, blocks * bs, D], no
    copy), each query row allowed its own blocks by a BlockMask (see the module docstring)."""
    from torch.nn.attention.flex_attention import flex_attention

    engine = _engine(model, "cpu", "float32", kv_bytes=1 << 28)
    flex = torch.compile(flex_attention, dynamic=False)
    return [_flex_row(engine, flex, _decodes(engine, batch, context)) for context in contexts]


def _flex_row(engine: Engine, flex: Any, chunks: list[ScheduledChunk], repeats: int = 30,
              rounds: int = 2) -> dict[str, Any]:
    from torch.nn.attention.flex_attention import BlockMask

    runner, config = engine.runner, engine.model_config
    attention = runner.model.layers[0].self_attn.attn
    k_cache, v_cache = runner.kv_cache[0, 0], runner.kv_cache[1, 0]
    bs, slots, batch = runner.block_size, runner.num_blocks * runner.block_size, len(chunks)
    meta = runner.prepare(chunks).meta
    tables = [runner.requests.held[c.request_id].block_table for c in chunks]
    owner = torch.full((runner.num_blocks,), -1, dtype=torch.int64)
    order = torch.zeros(runner.num_blocks, dtype=torch.int64)
    for row, table in enumerate(tables):
        owner[table] = row
        order[table] = torch.arange(len(table))
    lengths = torch.tensor([c.start + 1 for c in chunks])

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        block = kv_idx // bs
        return (owner[block] == q_idx) & (order[block] * bs + kv_idx % bs < lengths[q_idx])

    def block_mask() -> BlockMask:  # built once a step, from the block tables
        indices = torch.zeros(1, 1, batch, runner.num_blocks, dtype=torch.int32)
        for row, table in enumerate(tables):
            indices[0, 0, row, :len(table)] = torch.tensor(table, dtype=torch.int32)
        counts = torch.tensor([[[len(t) for t in tables]]], dtype=torch.int32)
        return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=(1, bs), mask_mod=mask_mod,
                                        seq_lengths=(batch, slots))

    q = torch.randn(batch, config.num_heads, config.head_dim)
    k = torch.randn(batch, config.num_kv_heads, config.head_dim)
    v = torch.randn_like(k)
    flat_k = k_cache.reshape(1, config.num_kv_heads, slots, config.head_dim)
    flat_v = v_cache.reshape(1, config.num_kv_heads, slots, config.head_dim)
    mask = block_mask()

    def in_place() -> torch.Tensor:
        out = flex(q.transpose(0, 1)[None], flat_k, flat_v, block_mask=mask,
                   scale=attention.scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    def gathered() -> torch.Tensor:
        return attention(q, k, v, k_cache, v_cache, meta)  # also writes k, v

    runs = {"gather_sdpa": gathered, "flex": in_place, "flex_mask_build": block_mask}
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        diff = float((gathered() - in_place()).abs().max())
        for _ in range(rounds):  # interleaved, as in limits()
            for name, run in runs.items():
                run()
                for _ in range(repeats):
                    start = time.process_time()
                    run()
                    times[name].append(time.process_time() - start)
    return {"batch": batch, "context": chunks[0].start + 1, "max_abs_diff": diff,
            **{f"{name}_cpu_ms": statistics.median(t) * 1e3 for name, t in times.items()}}


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
    parser.add_argument("--limits", action="store_true",
                        help="instead: decode weight-read bandwidth and prefill FLOP/s against "
                             "the measured limits, with CPU graphs, eager and compiled, at 1 "
                             "and engine threads")
    parser.add_argument("--split", action="store_true",
                        help="instead: the eager decode step of --limits split into attention, "
                             "GEMMs and the rest, and the same step as a CPU graph")
    parser.add_argument("--flex", action="store_true",
                        help="instead: decode attention, gather + SDPA against FlexAttention "
                             "over the paged cache in place (CPU)")
    args = parser.parse_args()
    if args.flex:
        print(json.dumps(flex_vs_gather(), indent=2))
        return
    if args.split:
        print(json.dumps(decode_split(), indent=2))
        return
    if args.limits:
        print(json.dumps(limits(device=args.device, dtype=args.dtype), indent=2))
        return
    if args.curve:
        print(json.dumps(step_curve(args.model, device=args.device, dtype=args.dtype),
                         indent=2))
        return
    print(json.dumps(measure(args.model, device=args.device, dtype=args.dtype, chunk=args.chunk,
                             batch=args.batch, context=args.context, repeats=args.repeats),
                     indent=2))


if __name__ == "__main__":
    main()
