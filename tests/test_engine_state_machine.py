"""Arbitrary interleavings of arrivals, idle gaps of 1 s to 8 h, pauses, live config patches
and aborts, on the simulated executor and a VirtualClock: the engine never raises, and every
request ends finished, aborted or failed (or rejected) with a reason.

500 examples by default (about 10 s of CPU); TOKENFLOW_SOAK_EXAMPLES=5000 hunts longer."""

from __future__ import annotations

import contextlib
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from engine import Engine
from engine.batch import RequestOutput
from engine.clock import VirtualClock
from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.core.request import RequestState
from engine.sim.executor import simulated_engine
from engine.sim.target import resolve_target

CONFIG = EngineConfig(model="synthetic:tiny", kv_cache_bytes=1 << 20, max_model_len=512)
TARGET = resolve_target("a100", CONFIG)
FINAL = {RequestState.FINISHED.value, RequestState.FAILED.value, RequestState.REJECTED.value}
MAX_DRAIN_STEPS = 20_000
HOUR_S = 3600.0

# about 10 s of CPU for 500 examples; TOKENFLOW_SOAK_EXAMPLES raises it for a longer hunt
EXAMPLES = int(os.environ.get("TOKENFLOW_SOAK_EXAMPLES", "500"))


class EngineUnderTime(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize()
    def start(self) -> None:
        self.clock = VirtualClock(start=0.0)
        self.engine: Engine = simulated_engine(CONFIG, TARGET, self.clock)
        self.engine.scheduler.controller.calibrated = True  # the windows a calibrated engine keeps
        self.last: dict[str, RequestOutput] = {}
        self.added: list[str] = []

    def _steps(self, n: int) -> None:
        for _ in range(n):
            for output in self.engine.step():
                self.last[output.request_id] = output

    @rule(target=requests, prompt=st.integers(1, 600), max_tokens=st.integers(1, 48),
          priority=st.integers(-2, 2))
    def arrive(self, prompt: int, max_tokens: int, priority: int) -> str:
        rid = f"r{len(self.added)}"
        self.engine.add_request([1 + i % 300 for i in range(prompt)],
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                request_id=rid, priority=priority)
        self.added.append(rid)
        return rid

    @rule(n=st.integers(1, 30))
    def run(self, n: int) -> None:
        self._steps(n)

    @rule(gap=st.one_of(st.floats(1.0, 120.0), st.floats(120.0, 8 * HOUR_S)))
    def idle(self, gap: float) -> None:
        """Time passes and the loop ticks once, as a serving loop does when it wakes."""
        self.clock.sleep(gap)
        self._steps(1)

    @rule(gap=st.floats(0.0, 2 * HOUR_S))
    def pause(self, gap: float) -> None:
        """Paused: the clock runs on and not a single step is taken."""
        self.clock.sleep(gap)

    @rule(budget=st.sampled_from([0, 1, 16, 64, 128, 256, 1024, -5]),
          chunked=st.booleans(), auto=st.booleans())
    def patch(self, budget: int, chunked: bool, auto: bool) -> None:
        # a bad value is refused and changes nothing: the next step runs the old config
        with contextlib.suppress(ConfigError):
            self.engine.update_config("test", max_num_batched_tokens=budget,
                                      chunked_prefill=chunked, auto_budget=auto)

    @rule(rid=consumes(requests))
    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    @invariant()
    def snapshot_reads(self) -> None:
        if hasattr(self, "engine"):
            snapshot = self.engine.snapshot()
            assert snapshot.num_running + snapshot.num_waiting == len(
                self.engine.scheduler.requests)

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        for _ in range(MAX_DRAIN_STEPS):
            if not self.engine.has_unfinished():
                break
            self._steps(1)
            self.clock.sleep(0.001)
        assert not self.engine.has_unfinished(), "requests left running"
        for rid in self.added:
            output = self.last.get(rid)
            assert output is not None and output.finished, rid
            assert output.state in FINAL and output.finish_reason, output


EngineUnderTime.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestEngineUnderTime = pytest.mark.soak(pytest.mark.slow(EngineUnderTime.TestCase))  # many runs


def test_a_patch_that_strands_a_queued_prefill_fails_it_with_the_reason() -> None:
    """Found by the machine above: a prompt accepted under chunked prefill waited forever
    once a patch turned chunking off under a budget smaller than it."""
    engine = simulated_engine(CONFIG, TARGET, VirtualClock(start=0.0))
    engine.add_request([5] * 300, SamplingParams(max_tokens=4, ignore_eos=True),
                       request_id="long")
    engine.add_request([5] * 100, SamplingParams(max_tokens=4, ignore_eos=True),
                       request_id="fits")
    engine.update_config("test", max_num_batched_tokens=128, chunked_prefill=False)
    ended = {}
    for _ in range(MAX_DRAIN_STEPS):
        ended.update({o.request_id: o for o in engine.step() if o.finished})
    assert ended["fits"].state == RequestState.FINISHED.value
    assert ended["long"].state == RequestState.FAILED.value
    assert "chunked prefill off and max_num_batched_tokens 128" in str(
        ended["long"].finish_reason)
