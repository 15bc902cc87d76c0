"""The GPU twin against published GPU measurements (benchmarks/published_gpu_cases.json):
arithmetic only, on the shipped factors."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.batch import StepShape
from engine.sim.profiles import FITTED_EFFICIENCY, profile
from engine.sim.published import agreement, load_cases
from engine.sim.target import Deployment

CASES = Path(__file__).parent.parent / "benchmarks" / "published_gpu_cases.json"


def test_published_table_is_big_and_varied_enough() -> None:
    cases = load_cases(CASES)
    assert len(cases) >= 15 and len({c.source for c in cases}) >= 4
    assert sum(c.held_back for c in cases) >= 5


def test_twin_agrees_with_published_gpu_measurements() -> None:
    cases = load_cases(CASES)
    held = agreement([c for c in cases if c.held_back], FITTED_EFFICIENCY)
    assert held.median_abs <= 0.10 and held.worst_abs <= 0.25, held.errors
    every = agreement(cases, FITTED_EFFICIENCY)
    assert every.median_abs <= 0.10 and every.worst_abs <= 0.25, every.errors


def test_weight_only_int8_reads_one_byte_a_weight_at_the_bf16_peak() -> None:
    model = next(c.model for c in load_cases(CASES) if c.id == "gptfast-7b-int8")
    a100 = profile("a100")
    bf16, w8a8, weight_only = (Deployment(model, a100, 1, d) for d in ("bfloat16", "int8",
                                                                         "int8-wo"))
    assert weight_only.weight_bytes == w8a8.weight_bytes == bf16.weight_bytes // 2
    assert weight_only.peaks.flops == bf16.peaks.flops < w8a8.peaks.flops
    # dequantising on the way in streams the weights at their own share of the bandwidth
    decode = StepShape(decode_contexts=(100,))
    e = a100.efficiency
    gemm = {d.weight_dtype: d.step_price().operations(decode)["gemm"]
            for d in (bf16, weight_only)}
    assert gemm["int8-wo"] / gemm["bfloat16"] == pytest.approx(
        e.memory / e.weight_only_memory / 2, rel=0.01)
