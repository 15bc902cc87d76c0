"""How fast the GPU twin simulates, and what the per-operation step price costs in speed.

    python -m benchmarks.twin_speed [--num-requests 3000] [--rounds 2]

One replica of synthetic:8b on a simulated H100 replays the conversation trace (vLLM's GPU
defaults, as `bench --simulate h100` takes them), alternating in one process between the
per-operation step price and the former single roofline max() over the whole step (same
peaks, its 75%/85% sustained shares), so that a loaded machine slows both alike. Prints
simulated seconds per host second (x real time) and host microseconds per step of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from engine.budget.cost_model import BudgetModel
from engine.budget.peaks import DevicePeaks
from engine.config import EngineConfig
from engine.harness.workload import build_workload
from engine.model.config import PRESETS
from engine.sim.fleet import run_fleet
from engine.sim.profiles import PROFILES, vllm_defaults
from engine.sim.router import RoutePolicy
from engine.sim.target import SimTarget, resolve_target

# the twin's former sustained shares of the datasheet peaks (one max() over the step)
FORMER_FLOPS, FORMER_BANDWIDTH = 0.75, 0.85


def single_max(target: SimTarget) -> SimTarget:
    peaks = target.peaks
    sustained = DevicePeaks(peaks.name, peaks.flops * FORMER_FLOPS,
                            peaks.bandwidth * FORMER_BANDWIDTH, peaks.source)
    return dataclasses.replace(target, predict=BudgetModel(PRESETS["8b"], 2, sustained).predict)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = dataclasses.replace(EngineConfig(model="synthetic:8b"),
                                 **vllm_defaults(PROFILES["h100"]))
    workload = build_workload("conv", vocab_size=PRESETS["8b"].vocab_size, max_model_len=8192,
                              num_requests=args.num_requests, rate=None, seed=0,
                              length_scale=1.0, time_scale=1.0)
    per_op = resolve_target("h100", config)
    targets = {"per-operation": per_op, "single max()": single_max(per_op)}
    speed: dict[str, list[float]] = {name: [] for name in targets}
    per_step: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(args.rounds):
        for name, target in targets.items():
            fleet = run_fleet(config, target, workload, 1, RoutePolicy.LEAST_TOKENS)
            steps = len(fleet.merged.steps)
            speed[name].append(fleet.merged.wall_s / fleet.host_wall_s)
            per_step[name].append(fleet.host_wall_s / steps * 1e6)
            print(f"{name:<14} {speed[name][-1]:6.1f}x real time, "
                  f"{per_step[name][-1]:6.1f} us a step over {steps} steps, "
                  f"{fleet.merged.wall_s:.0f} s simulated in {fleet.host_wall_s:.1f} s")
    for name in targets:
        print(f"{name:<14} median {statistics.median(speed[name]):.1f}x real time, "
              f"{statistics.median(per_step[name]):.1f} us a step")


if __name__ == "__main__":
    main()
