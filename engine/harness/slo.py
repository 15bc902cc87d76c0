"""SLOs, goodput and capacity, in multiples of one decode step (as Sarathi-Serve, DistServe)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from engine.batch import Batch, StepShape, lent
from engine.config import SamplingParams
from engine.core.engine_core import EngineCore
from engine.core.request import Request, RequestState
from engine.errors import EngineError
from engine.harness.driver import RunResult
from engine.slo_targets import SLO
from engine.stats import ms, quantile


def measure_decode_step(engine: EngineCore, batch: int = 8, context: int = 128,
                        repeats: int = 7) -> float:
    """Median time of one decode-only step of `batch` sequences at `context` tokens."""
    requests = []
    for i in range(batch):
        request = Request(f"slo-probe-{i}", [3] * context, SamplingParams(max_tokens=1),
                          arrival=0.0, state=RequestState.DECODING)
        if engine.blocks.allocate(request, context) is None:
            blocks = engine.blocks
            raise EngineError(f"the KV pool ({blocks.num_blocks} blocks of {blocks.block_size} "
                              f"tokens) cannot hold the {batch} sequences of {context} tokens "
                              "whose decode step sets the TPOT target: lower --block-size, or "
                              "raise the pool (--kv-cache-bytes, --gpu-memory-utilization)")
        request.num_computed_tokens = context - 1
        requests.append(request)
    step = Batch(decodes=[r.chunk(context - 1, 1) for r in requests])
    try:
        with lent(engine.runner.run, [r.entering() for r in requests]):
            engine.runner.run(step)
            samples = []
            for _ in range(repeats):  # on the engine's clock: a simulated step takes simulated time
                start = engine.clock()
                engine.runner.run(step)
                samples.append(engine.clock() - start)
    finally:
        for request in requests:
            engine.blocks.release(request)
        engine.blocks.take_newly_allocated()
    return statistics.median(samples)


def goodput(result: RunResult, slo: SLO, prefill_s: Callable[[int], float]) -> float:
    """Share of all requests that finished within their TTFT SLO and the TPOT SLO."""
    records = list(result.records.values())
    if not records:
        return 0.0
    good = 0
    for r in records:
        ttft, tpot = r.ttft_s, r.tpot_s
        if r.state != "FINISHED" or ttft is None:
            continue
        if ttft <= slo.ttft_s(prefill_s(r.prompt_tokens)) and (tpot is None
                                                               or tpot <= slo.tpot_s):
            good += 1
    return good / len(records)


def isolated_prefill(engine: EngineCore) -> Callable[[int], float]:
    """Predicted time to prefill a prompt alone, in chunks of the engine's token budget."""
    budget = engine.config.max_num_batched_tokens

    def predict(tokens: int) -> float:
        total, start = 0.0, 0
        while start < tokens:
            size = min(budget, tokens - start)
            total += engine.predict(StepShape(prefill=((size, start),)))
            start += size
        return total

    return predict


# TPOT SLO against "tpot" (mean per request) or "tbt" (every gap between two tokens).
LATENCY_METRICS = ("tpot", "tbt")


@dataclass(frozen=True)
class CapacityProbe:
    rate: float
    requests: int
    ok: bool
    tpot_p99_ms: float | None
    tbt_p99_ms: float | None
    delay_p99_ms: float | None

    @classmethod
    def of(cls, rate: float, result: RunResult, slo: SLO, metric: str) -> CapacityProbe:
        """P99 TPOT (or TBT) and P99 scheduling delay within the SLO, every request done."""
        records = list(result.records.values())
        tpot = quantile([r.tpot_s for r in records if r.tpot_s is not None], 0.99)
        tbt = quantile([gap for r in records for gap in r.inter_token_s()], 0.99)
        delay = quantile([r.scheduling_delay_s for r in records
                          if r.scheduling_delay_s is not None], 0.99)
        latency = tpot if metric == "tpot" else tbt
        ok = (all(r.state == "FINISHED" for r in records)
              and (latency is None or latency <= slo.tpot_s)
              and (delay is None or delay <= slo.delay_s))
        return cls(rate, len(records), ok,
                   ms(tpot), ms(tbt), ms(delay))


def capacity(run_at: Callable[[float], RunResult], slo: SLO, low: float, high: float,
             iterations: int = 5, metric: str = "tpot") -> tuple[float, list[CapacityProbe]]:
    """Highest sustainable rate in [low, high] (requests/s), by binary search in log space."""
    if metric not in LATENCY_METRICS:
        raise ValueError(f"metric must be one of {LATENCY_METRICS}, got {metric!r}")
    probes: list[CapacityProbe] = []
    best = 0.0
    for _ in range(iterations):
        rate = math.sqrt(low * high)
        probe = CapacityProbe.of(rate, run_at(rate), slo, metric)
        probes.append(probe)
        if probe.ok:
            best, low = max(best, rate), rate
        else:
            high = rate
    return best, probes
