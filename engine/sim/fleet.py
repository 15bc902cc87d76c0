"""A fleet of simulated replicas behind a router: one discrete-event loop over their clocks."""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.errors import EngineError
from engine.harness.driver import Recorder, RunResult, add, idle
from engine.harness.workload import WorkloadRequest
from engine.sim.executor import SimulatedExecutor, VirtualClock, simulated_engine
from engine.sim.router import RoutePolicy, Router
from engine.sim.target import SimTarget

# each replica is a whole engine in this process (an 8B H100 twin: 0.5 MB, 2.5 ms to build),
# and least-tokens routing reads every replica at each arrival
MAX_REPLICAS = 1024
# An idle engine starts its step a little after an arrival, so a burst shares that step.
HOST_WAKE_S = 0.002


@contextmanager
def _no_collections() -> Iterator[None]:
    """A run's many short-lived objects are acyclic: a collection during it would only walk
    them. After it, what survived goes to the oldest generation unwalked (freeze, then
    unfreeze), so the first young collection does not walk the whole run either; the next
    full collection still finds any cycle."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class FleetResult:
    replicas: tuple[RunResult, ...]
    policy: RoutePolicy
    host_wall_s: float

    @property
    def merged(self) -> RunResult:
        """The fleet as one service: every request and step, over the longest replica."""
        records = {k: v for r in self.replicas for k, v in r.records.items()}
        steps = [s for r in self.replicas for s in r.steps]
        return RunResult(records, steps, max(r.wall_s for r in self.replicas),
                         sum(r.preemptions for r in self.replicas),
                         sum(r.slow_queries for r in self.replicas))

    def summary(self) -> dict[str, Any]:
        return {**self.merged.summary(), **self.routing()}

    def routing(self, per_replica: bool = True) -> dict[str, Any]:
        """What the fleet adds to its merged run's summary: the router, the host's time, and
        each replica's own summary (a run's summary walks every request: only when asked)."""
        wall_s = max(r.wall_s for r in self.replicas)
        return {"router": self.policy.value, "host_wall_s": self.host_wall_s,
                "x_real_time": wall_s / max(self.host_wall_s, 1e-9),
                **({"replicas": [r.summary() for r in self.replicas]} if per_replica else {})}


def run_fleet(config: EngineConfig, target: SimTarget, workload: list[WorkloadRequest],
              replicas: int, policy: RoutePolicy) -> FleetResult:
    if not 1 <= replicas <= MAX_REPLICAS:
        raise EngineError(f"a simulated fleet holds 1 to {MAX_REPLICAS} replicas, got "
                          f"{replicas}")
    started = time.perf_counter()
    router = Router(policy, replicas)
    clocks = [VirtualClock(start=0.0) for _ in range(replicas)]
    engines = [simulated_engine(config, target, clock) for clock in clocks]
    executors = [_executor(engine) for engine in engines]
    recorders = [Recorder() for _ in range(replicas)]
    for engine, recorder in zip(engines, recorders, strict=True):
        engine.bus.subscribe(recorder, Recorder.KINDS)
        engine.stop_metrics()  # the run is its recorders': the engines' metrics go unread
    pending = deque(sorted(workload, key=lambda w: w.arrival_s))
    wake_s = HOST_WAKE_S if target.calibration is not None else 0.0
    busy: set[int] = set()
    with _no_collections():
        while pending or busy:
            arrival = pending[0].arrival_s if pending else math.inf
            behind = min(busy, key=lambda i: clocks[i].now) if busy else None
            if behind is None or arrival <= clocks[behind].now:
                item = pending.popleft()
                i = router.route(item)
                clocks[i].advance_to(arrival + (0.0 if i in busy else wake_s))
                recorders[i].expect(item, arrival)
                add(engines[i], item, arrival)
                busy.add(i)
                continue
            _step(engines[behind], executors[behind], clocks[behind], recorders[behind],
                  router)
            if not engines[behind].has_unfinished():
                busy.discard(behind)
    results = tuple(r.result(c.now) for r, c in zip(recorders, clocks, strict=True))
    return FleetResult(results, policy, time.perf_counter() - started)


def _executor(engine: EngineCore) -> SimulatedExecutor:
    runner = engine.runner
    assert isinstance(runner, SimulatedExecutor)
    return runner


def _step(engine: EngineCore, executor: SimulatedExecutor, clock: VirtualClock,
          recorder: Recorder, router: Router) -> None:
    before = clock.now
    for output in engine.step():
        recorder.settle(output)
        if output.finished:
            router.finished(output.request_id)
    if clock.now == before:
        idle(clock.sleep)
    else:
        clock.now += executor.host_s
