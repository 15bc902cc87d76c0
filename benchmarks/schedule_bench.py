"""Benchmark of Scheduler.schedule() with 256 running decodes (target: under 1 ms).

A Scheduler over a BlockManager holds 256 decoding requests of varied context (64 to 4096
tokens) and some waiting ones that cannot be admitted (max_num_seqs is full), as in a
saturated server. Each iteration times schedule() alone, then schedule() plus the scheduler's
own update() of a decode-only step (one token appended per decode, stop checks). Prints the
median and p99 in microseconds as JSON.

`--bandwidth model` reads a ModelBandwidth holding one recorded step per iteration, as the
engine's default source does, so its 5 s window scan is part of the measured cost.

    PYTHONPATH=. .venv/bin/python benchmarks/schedule_bench.py [--iterations 3000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine.batch import ModelRunnerOutput, StepTiming
from engine.budget.controller import BudgetController
from engine.budget.cost_model import BudgetModel
from engine.budget.peaks import DevicePeaks
from engine.config import EngineConfig, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestState
from engine.core.scheduler import Scheduler
from engine.model.config import PRESETS
from engine.ops.slow_query_watch import SlowQueryWatch
from engine.ops.telemetry import BandwidthReading, BandwidthSource, ModelBandwidth
from engine.stats import quantile

RUNNING = 256
WAITING = 32
BLOCK_SIZE = 16


class ConstantBandwidth:
    def reading(self) -> BandwidthReading:
        return BandwidthReading(0.5, "injected")

    def record(self, bytes_moved: float, duration_s: float) -> None:
        """A constant source learns nothing from steps."""


def build(iterations: int, bandwidth: BandwidthSource) -> Scheduler:
    rng = random.Random(0)
    config = EngineConfig(model="synthetic:tiny", device="cpu", block_size=BLOCK_SIZE,
                          max_num_seqs=RUNNING, max_num_batched_tokens=512)
    contexts = [rng.randint(64, 4096) for _ in range(RUNNING)]
    grown = sum(-(-(c + iterations + 1) // BLOCK_SIZE) for c in contexts)
    blocks = BlockManager(grown + 64, BLOCK_SIZE)
    model = BudgetModel(PRESETS["tiny"], 4, DevicePeaks("bench", 1e12, 1e11, "bench"))
    scheduler = Scheduler(config, blocks, bandwidth, BudgetController(lambda shape: 1e-3, model),
                          lambda event: None, time.monotonic,
                          watch=SlowQueryWatch(lambda event: None), eos_token_ids=(),
                          max_model_len=1 << 30)
    params = SamplingParams(max_tokens=1_000_000, ignore_eos=True)
    for index, context in enumerate(contexts):
        request = Request(id=f"run{index}", prompt_token_ids=[5] * context, params=params,
                          arrival=float(index), tenant=f"t{index % 4}", priority=index % 3)
        scheduler.add(request)
        scheduler.waiting.remove(request)  # placed as running, as if admitted long ago
        scheduler.running.append(request)
        blocks.allocate(request, context)
        request.num_computed_tokens = context
        request.output_token_ids.append(5)
        request.set_state(RequestState.DECODING, "prefill complete")
    for index in range(WAITING):
        scheduler.add(Request(id=f"wait{index}", prompt_token_ids=[5] * rng.randint(16, 2048),
                              params=params, arrival=float(RUNNING + index)))
    return scheduler


def measure(iterations: int, bandwidth: BandwidthSource) -> dict[str, float]:
    scheduler = build(iterations + 200, bandwidth)
    schedule_ns: list[int] = []
    total_ns: list[int] = []
    for iteration in range(iterations + 200):
        start = time.perf_counter_ns()
        batch = scheduler.schedule()
        scheduled = time.perf_counter_ns()
        output = ModelRunnerOutput(token_ids={c.request_id: 5 for c in batch.decodes})
        scheduler.update(batch, output, StepTiming(end=0.0, duration_s=1e-3, predicted_s=1e-3))
        end = time.perf_counter_ns()
        bandwidth.record(1e6, 1e-3)
        assert len(batch.decodes) == RUNNING and not batch.prefills
        if iteration >= 200:  # warm-up
            schedule_ns.append(scheduled - start)
            total_ns.append(end - start)
    return {
        "schedule_median_us": statistics.median(schedule_ns) / 1e3,
        "schedule_p99_us": quantile(schedule_ns, 0.99) / 1e3,
        "schedule_and_update_median_us": statistics.median(total_ns) / 1e3,
        "schedule_and_update_p99_us": quantile(total_ns, 0.99) / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--bandwidth", choices=["constant", "model"], default="constant")
    args = parser.parse_args()
    source = ConstantBandwidth() if args.bandwidth == "constant" else ModelBandwidth(1e9)
    result = {"running": RUNNING, "waiting": WAITING, "iterations": args.iterations,
              "bandwidth": args.bandwidth, **measure(args.iterations, source)}
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v
                      for k, v in result.items()}))


if __name__ == "__main__":
    main()
