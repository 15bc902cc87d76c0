"""When the engine loop builds the snapshot it publishes: a command that wakes an idle loop
runs first, and the pass that ran it publishes once after it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from engine.config import EngineConfig, SamplingParams
from engine.core.engine_core import RequestOutput
from engine.ops.equipped import Engine
from engine.serve.loop import EngineLoop
from engine.snapshot import Snapshot


@pytest.fixture()
def counted() -> Iterator[tuple[EngineLoop, list[int]]]:
    """A started loop whose clock never moves (no interval's snapshot is ever due), and the
    count of snapshots its engine has built since it went idle."""
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    loop = EngineLoop(engine, snapshot_interval_s=3600.0, clock=lambda: 0.0)
    builds = [0]
    build = engine.snapshot

    def counting() -> Snapshot:
        builds[0] += 1
        return build()

    engine.snapshot = counting  # type: ignore[method-assign]
    loop.start()
    try:
        yield loop, builds
    finally:
        loop.stop()


def wait_idle(loop: EngineLoop) -> None:
    while not loop._wake._waiters:  # type: ignore[attr-defined]  # the thread waits idle
        threading.Event().wait(0.001)


def test_a_command_waking_an_idle_loop_is_published_once_after_it_runs(
        counted: tuple[EngineLoop, list[int]]) -> None:
    loop, builds = counted
    wait_idle(loop)
    builds[0] = 0
    ran = loop.call(lambda engine: engine.scheduler.steps).result(30)
    wait_idle(loop)
    assert ran == 0 and builds[0] == 1


def test_a_request_served_from_idle_is_published_once_when_it_ends(
        counted: tuple[EngineLoop, list[int]]) -> None:
    loop, builds = counted
    wait_idle(loop)
    builds[0] = 0
    finished = threading.Event()

    def listen(output: RequestOutput) -> None:
        if output.finished:
            finished.set()

    loop.submit([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), on_output=listen)
    assert finished.wait(30)
    wait_idle(loop)
    # no snapshot before the request was added, none while it ran (the interval never came),
    # one once it ended: the published state shows it finished with its 4 tokens
    assert builds[0] == 1
    assert [view.generated_tokens for view in loop.snapshot().requests] == [4]
