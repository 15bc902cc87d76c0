"""The time-warp soak, scaled down: six simulated hours (nights, busy hours, a pause and a
budget change each hour, clients that leave) in about a second; the full day is
benchmarks/timewarp_soak.py."""

from __future__ import annotations

from pathlib import Path

from engine.clock import VirtualClock
from engine.config import EngineConfig
from engine.harness.soak import SoakPlan, day_of_trace, journaled_soak
from engine.sim.executor import simulated_engine
from engine.sim.target import resolve_target


def test_six_simulated_hours_end_with_every_request_accounted_for(tmp_path: Path) -> None:
    config = EngineConfig(model="synthetic:small", kv_cache_bytes=256 << 20)
    clock = VirtualClock(start=0.0)
    engine = simulated_engine(config, resolve_target("a100", config), clock)
    engine.scheduler.controller.calibrated = True
    plan = SoakPlan(hours=6, busy_from=3, requests_per_hour=15, abort_share=0.2,
                    max_output_tokens=64)
    workload = day_of_trace(plan, engine.model_config.vocab_size)
    report = journaled_soak(engine, clock, plan, workload, tmp_path / "soak.db")
    assert report.exceptions == []
    assert report.unaccounted == [] and report.journal_unfinished == []
    assert report.states["FINISHED"] == len(workload) == 45 and report.states["aborted"] > 0
    assert report.simulated_s >= 6 * 3600
    assert [h.arrived for h in report.hours] == [0, 0, 0, 15, 15, 15]
    assert [h.budget for h in report.hours[3:]] == [128, 256, 512]  # one per hour
