"""The time-warp soak (engine.harness.soak): 24 simulated hours of the conversation trace,
with idle nights, a pause and a budget change every hour, through the real scheduler,
guards, metrics, store and journal on the simulated executor. Prints one JSON object: the
wall time, steps, final states, hour-by-hour figures, and any exception or request not
accounted for; exits 1 unless all are accounted for with 0 exceptions.

    python benchmarks/timewarp_soak.py [--hours 24] [--requests-per-hour 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from engine.clock import VirtualClock
from engine.config import EngineConfig
from engine.harness.soak import SoakPlan, day_of_trace, journaled_soak
from engine.sim.executor import simulated_engine
from engine.sim.target import resolve_target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hours", type=int, default=24)
    parser.add_argument("--requests-per-hour", type=int, default=300)
    parser.add_argument("--model", default="synthetic:small")
    parser.add_argument("--gpu", default="a100")
    args = parser.parse_args()
    config = EngineConfig(model=args.model, kv_cache_bytes=1 << 30)
    clock = VirtualClock(start=0.0)
    engine = simulated_engine(config, resolve_target(args.gpu, config), clock)
    # C*, budget scores and the step-time ratio are kept
    engine.scheduler.controller.calibrated = True
    plan = SoakPlan(hours=args.hours, requests_per_hour=args.requests_per_hour)
    workload = day_of_trace(plan, engine.model_config.vocab_size)
    with tempfile.TemporaryDirectory() as folder:
        report = journaled_soak(engine, clock, plan, workload, Path(folder) / "soak.db")
    print(json.dumps({"plan": dataclasses.asdict(plan), **dataclasses.asdict(report),
                      "ok": report.ok}, indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
