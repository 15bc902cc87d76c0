"""Benchmark of the StoreWriter: events/s it absorbs, and what it costs the engine loop.

(a) throughput: a decode-heavy event stream (256 requests in flight, each prefilled in two
    chunks, then one TokensGenerated per step, a SlowQuery for one in ten) is published
    and drained as fast as possible; events/s = events / time until `flush` returns.
(b) overhead: a loop doing a fixed amount of work per iteration publishes `--rate` x
    `--iter-ms` events and drains the bus, as the engine does each step. The work is pure
    Python (the worst case: it needs the GIL throughout, like a kernel-launching loop) or
    torch matmuls (which release it, like a CPU forward pass). Runs with and without a
    writer attached alternate; each is compared with the run just before it.

    PYTHONPATH=. .venv/bin/python benchmarks/store_writer.py [--events 100000] [--work python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.events import (
    ChunkComplete,
    Event,
    EventBus,
    Finished,
    RequestAdded,
    SlowQuery,
    TokensGenerated,
)
from engine.store import StoreWriter, open_database

PROMPT = tuple(range(128))
CONFIG = {"max_num_batched_tokens": 512, "chunk_tile": 16, "max_prefill_chunks": 4}


def request_events(rid: str, step: int) -> Iterator[Event]:
    """The events request `rid` produces at its `step`-th engine step (66 steps in all)."""
    if step == 0:
        yield RequestAdded(request_id=rid, prompt_token_ids=PROMPT, sampling={"max_tokens": 64},
                           tenant="bench")
    if step < 2:
        yield ChunkComplete(request_id=rid, chunk_index=step, tokens=64, start=64 * step,
                            duration_s=0.004, estimated_bytes=2e8, predicted_s=0.004,
                            prefill_done=step == 1)
    if step >= 1:
        yield TokensGenerated(request_ids=(rid,), token_ids=(step,))
    if step == 65:
        yield Finished(request_id=rid, reason="length", prompt_tokens=128, generated_tokens=65,
                       ttft_s=0.01, e2e_s=1.0, budget_score=1.7)
        if rid.endswith("0"):  # one request in ten is slow
            yield SlowQuery(request_id=rid, tenant="bench", budget_score=1.7, prompt_tokens=128,
                            prefill_s=0.0085, budgeted_s=0.005, config=CONFIG,
                            chunks=({"tokens": 64, "duration_s": 0.004},) * 2)


def event_stream(in_flight: int = 256) -> Iterator[list[Event]]:
    """Endless engine steps; each yields the events of every request in flight."""
    steps: dict[str, int] = {}
    serial = 0
    while True:
        while len(steps) < in_flight:
            steps[f"req-{serial}"] = 0
            serial += 1
        events: list[Event] = []
        for rid, step in list(steps.items()):
            events.extend(request_events(rid, step))
            if step == 65:
                del steps[rid]
            else:
                steps[rid] = step + 1
        yield events


def measure_throughput(path: Path, total: int) -> dict[str, float]:
    events: list[Event] = []
    for step_events in event_stream():
        events.extend(step_events)
        if len(events) >= total:
            break
    database = open_database(path)
    bus = EventBus()
    writer = StoreWriter(database, bus)
    start = time.perf_counter()
    for event in events:
        bus.publish(event)
    bus.drain()
    drained = time.perf_counter()
    assert writer.flush(timeout=600), "writer did not finish"
    elapsed = time.perf_counter() - start
    writer.close()
    database.close()
    return {
        "events": len(events),
        "seconds": round(elapsed, 3),
        "events_per_s": round(len(events) / elapsed),
        "publish_and_drain_us_per_event": round((drained - start) / len(events) * 1e6, 3),
    }


def busy_work(units: int) -> int:
    total = 0
    for i in range(units):
        total += i * i % 7
    return total


def make_work(kind: str, iter_ms: float) -> Callable[[], object]:
    """`iter_ms` of work: pure Python (holds the GIL throughout) or torch matmuls (release it,
    like a real forward pass), sized by the fastest of five timings."""
    if kind == "python":
        units = int(200_000 * iter_ms / 1e3 / min(_timed(lambda: busy_work(200_000))
                                                   for _ in range(5)))
        return lambda: busy_work(units)
    import torch

    torch.set_num_threads(1)
    matrix = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    repeats = max(1, round(iter_ms / 1e3 / min(_timed(lambda: matrix @ matrix)
                                               for _ in range(20))))
    return lambda: [matrix @ matrix for _ in range(repeats)]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_loop(bus: EventBus, events: Iterator[list[Event]], iterations: int,
               work: Callable[[], object], per_iter: int) -> tuple[float, float]:
    """Wall and process CPU seconds of `iterations` engine-like steps."""
    batches = [next(events)[:per_iter] for _ in range(iterations)]
    start, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        work()
        for event in batch:
            bus.publish(event)
        bus.drain()
    return time.perf_counter() - start, time.process_time() - cpu


def measure_overhead(path: Path, work_kind: str, rate: int, iter_ms: float, seconds: float,
                     rounds: int) -> dict[str, float]:
    work = make_work(work_kind, iter_ms)
    iter_s = statistics.median(_timed(work) for _ in range(20))  # as it runs, not as asked
    per_iter = max(1, round(rate * iter_s))
    iterations = int(seconds / iter_s)
    database = open_database(path)
    stream = event_stream(in_flight=per_iter)  # one event per request per step, like decode
    without: list[tuple[float, float]] = []
    with_writer: list[tuple[float, float]] = []
    for _ in range(rounds):
        without.append(timed_loop(EventBus(), stream, iterations, work, per_iter))
        bus = EventBus()
        writer = StoreWriter(database, bus)
        start_cpu = time.process_time()
        wall, _ = timed_loop(bus, stream, iterations, work, per_iter)
        writer.close()  # the writer's catch-up after the loop counts towards its CPU
        with_writer.append((wall, time.process_time() - start_cpu))
    database.close()
    # Other processes share this machine, so each round with the writer is compared with the
    # round without it that ran just before (same conditions); the median ratio is reported,
    # and the fastest round of each as a second view.
    paired = statistics.median(w / wo for (w, _), (wo, _) in zip(with_writer, without,
                                                                   strict=True))
    base, loaded = min(w for w, _ in without), min(w for w, _ in with_writer)
    writer_cpu = statistics.median(c for _, c in with_writer) - statistics.median(
        c for _, c in without)
    return {
        "work": work_kind,
        "iterations": iterations,
        "events_per_iter": per_iter,
        "iter_ms_without_writer": round(base / iterations * 1e3, 3),
        "events_per_s": round(per_iter * iterations / loaded),
        "loop_s_without_writer": round(base, 4),
        "loop_s_with_writer": round(loaded, 4),
        "slowdown_pct": round((paired - 1) * 100, 2),
        "fastest_round_slowdown_pct": round((loaded / base - 1) * 100, 2),
        "writer_cpu_us_per_event": round(writer_cpu / (per_iter * iterations) * 1e6, 2),
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rate", type=int, default=10_000, help="events/s of the loop")
    parser.add_argument("--iter-ms", type=float, default=2.0, help="CPU work per loop iteration")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one timed loop")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--work", nargs="+", choices=("python", "torch"),
                        default=["python", "torch"], help="what each loop iteration computes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenflow-bench-") as tmp:
        result = {
            "throughput": measure_throughput(Path(tmp) / "throughput.db", args.events),
            "overhead": [
                measure_overhead(Path(tmp) / f"overhead_{kind}.db", kind, args.rate,
                                 args.iter_ms, args.seconds, args.rounds)
                for kind in args.work
            ],
            "targets": {"events_per_s": ">= 10000", "slowdown_pct": "<= 5"},
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
