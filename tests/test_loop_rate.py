"""The embedded traffic's arrival rate is a live knob: EngineLoop.set_arrival_rate."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine import Engine
from engine.config import EngineConfig
from engine.harness.workload import WorkloadRequest
from engine.serve.loop import EngineLoop


@pytest.fixture
def loop() -> Iterator[EngineLoop]:
    loop = EngineLoop(Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                                          dtype="float32"))).start()
    yield loop
    loop.stop()


def workload(count: int, gap_s: float) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"r{i}", i * gap_s, (1, 2, 3), 2) for i in range(count)]


def arrived(loop: EngineLoop) -> int:
    """Requests the loop has handed the engine (read on the loop thread)."""
    return loop.call(lambda engine: engine.metrics.requests_finished_total
                     + len(engine.scheduler.requests)).result(timeout=30)


def test_the_rate_reads_the_workloads_own_and_turns_live(loop: EngineLoop) -> None:
    loop.play(workload(11, 60.0))  # 11 requests over 10 min (one at once, the next in 60 s)
    assert loop.arrival_rate == pytest.approx(11 / 600)
    assert loop.set_arrival_rate(0.0) == 0.0  # holds every arrival after the first
    assert loop.arrival_rate == 0.0
    loop.call(lambda engine: None).result(timeout=30)  # the new rate is installed
    for _ in range(20):  # steps pass; with the workload's clock held, nothing more arrives
        loop.call(lambda engine: engine.step()).result(timeout=30)
    assert arrived(loop) == 1
    loop.set_arrival_rate(1e6)  # the rest arrive at once
    loop.call(lambda engine: None).result(timeout=30)
    for _ in range(200):
        if arrived(loop) == 11:
            break
        loop.call(lambda engine: engine.step()).result(timeout=30)
    assert arrived(loop) == 11


def test_a_bad_rate_is_refused_and_changes_nothing(loop: EngineLoop) -> None:
    with pytest.raises(ValueError, match="no workload with a rate"):
        loop.set_arrival_rate(1.0)
    loop.play(workload(3, 1.0))
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite number >= 0"):
            loop.set_arrival_rate(bad)
    assert loop.arrival_rate == pytest.approx(1.5)
