"""budget_score against the prefill plan: the plan itself, healthy engines scoring
near 1 at any load, faults scoring above the threshold, no verdict or C* before calibration,
a stable C*, and the first calibration at start.

Engines here run on a test clock that a step advances by exactly what a known predictor says
(the forward pass itself is real), so "healthy" and "slow" do not depend on this machine's
load; a fault is injected as steps that take longer than predicted, or as a mode.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Engine
from engine.batch import Batch, ModelRunnerOutput, StepShape
from engine.budget.auto import CStar, token_budget_for
from engine.budget.cost_model import BudgetModel
from engine.budget.peaks import DevicePeaks
from engine.budget.plan import (
    BUDGET_SCORE_DEFINITION,
    PlanItem,
    PlannedChunk,
    PlanRules,
    plan_prefills,
    replanned,
)
from engine.budget.predictor import StepTimePredictor
from engine.calibration.calibrate import FIRST_REASON
from engine.config import EngineConfig, SamplingParams
from engine.core.request import Request
from engine.events import CalibrationProgress, Event, SlowQuery
from engine.serve.session import EngineSession
from engine.store import calibration_history

KNOWN = StepTimePredictor(constant_s=2e-3, multi_token_s=1e-3, per_token_s=5e-5,
                          per_prefill_chunk_s=4e-4, per_decode_seq_s=1e-5,
                          per_prefill_pair_s=3e-9, per_decode_context_s=2e-8, points=0,
                          source="test")


class TestClock:
    __test__ = False

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed_engine(slowdown: Callable[[Batch], float] = lambda batch: 1.0, *,
                 calibrated: bool = True, **config: object) -> tuple[Engine, TestClock]:
    """A tiny engine whose steps take predicted × slowdown(batch) seconds of test time."""
    clock = TestClock()
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 **config), clock=clock)
    if calibrated:
        engine.apply_calibration(KNOWN)
    forward = engine.runner.run

    def run(batch: Batch) -> ModelRunnerOutput:
        output = forward(batch)
        clock.now += engine.predict(batch.shape()) * slowdown(batch)
        return output

    engine.runner.run = run
    return engine, clock


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 300 + 1 for i in range(n)]


def serve(engine: Engine, clock: TestClock, arrivals: list[tuple[float, int, int]],
          ) -> tuple[dict[str, Request], list[SlowQuery]]:
    """Add (time, prompt tokens, max tokens) requests as the test clock reaches them and step
    until all end; every request, and the slow queries published."""
    slow: list[SlowQuery] = []
    engine.bus.subscribe(lambda e: slow.append(e) if isinstance(e, SlowQuery) else None)
    pending = sorted(arrivals)
    ids = []
    while pending or engine.has_unfinished():
        while pending and (pending[0][0] <= clock.now or not engine.has_unfinished()):
            at, tokens, max_tokens = pending.pop(0)
            clock.now = max(clock.now, at)
            ids.append(engine.add_request(prompt(tokens, len(ids)),
                                          SamplingParams(max_tokens=max_tokens,
                                                         ignore_eos=True)))
        engine.step()
    done = {r.id: r for r in engine.scheduler.recent}
    return {i: done[i] for i in ids}, slow


def mixed_arrivals(n: int, rate: float, seed: int = 0) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        out.append((at, rng.choice((20, 40, 120, 300, 700)), rng.choice((4, 16, 40))))
    return out


# --- the plan ----------------------------------------------------------------------------

def test_a_plan_prices_every_step_that_carries_or_delays_the_chunks() -> None:
    predict = KNOWN.predict
    rules = PlanRules(budget=64, tile=16, slots=4, chunk_cap=float("inf"), chunked=True)
    plans = plan_prefills([PlanItem("a", 0, 100), PlanItem("b", 0, 40)], (10, 20), rules,
                          predict)
    # a goes first: 62 tokens beside two decodes, cut to whole tiles (48), then the rest
    assert [(c.start, c.tokens) for c in plans["a"]] == [(0, 48), (48, 52)]
    first, second = plans["a"]
    assert first.decodes == 2 and first.wait_s == 0.0 and first.other_prefill_tokens == 0
    assert first.predicted_s == pytest.approx(predict(StepShape(
        prefill=((48, 0),), decode_contexts=(10, 20))))
    # b waits while what a leaves is under a tile, then runs beside three decodes (a's
    # prefill done, it decodes too; the others' contexts have grown by two)
    (only,) = plans["b"]
    assert (only.start, only.tokens, only.wait_steps, only.decodes) == (0, 40, 2, 3)
    assert only.wait_s == pytest.approx(first.predicted_s + second.predicted_s)
    assert only.predicted_s == pytest.approx(predict(StepShape(
        prefill=((40, 0),), decode_contexts=(12, 22, 101))))


def test_a_replan_keeps_the_part_done_and_the_wait_already_spent() -> None:
    old = [PlannedChunk(0, 64, 0.010), PlannedChunk(64, 64, 0.012, wait_s=0.02, wait_steps=2),
           PlannedChunk(128, 32, 0.008)]
    new = [PlannedChunk(64, 32, 0.006, wait_s=0.003, wait_steps=1), PlannedChunk(96, 64, 0.01)]
    merged = replanned(old, 64, 1, new)  # one of the two planned waiting steps has passed
    assert [(c.start, c.tokens) for c in merged] == [(0, 64), (64, 32), (96, 64)]
    assert merged[1].wait_s == pytest.approx(0.003 + 0.01) and merged[1].wait_steps == 2
    cut = replanned(old, 32, 0, [PlannedChunk(32, 128, 0.02)])
    assert cut[0] == PlannedChunk(0, 32, 0.005)


def test_the_definition_is_written_down() -> None:
    for words in ("measured prefill time / planned prefill time", "CACHE_PRESSURE_WAIT",
                  "throttle", "preemption", "slower than predicted", "guard", "calibrating"):
        assert words in BUDGET_SCORE_DEFINITION


# --- healthy engines score near 1 --------------------------------------------------------

@pytest.mark.parametrize("rate", [5.0, 40.0, 400.0])  # idle, busy, a queue that builds
def test_a_healthy_engine_scores_near_one_at_any_load(rate: float) -> None:
    engine, clock = timed_engine(max_num_batched_tokens=128, max_prefill_chunks=2)
    requests, slow = serve(engine, clock, mixed_arrivals(40, rate))
    scores = [r.budget_score for r in requests.values()]
    assert all(s is not None for s in scores)
    assert max(scores) <= 1.15 and min(scores) >= 0.5, sorted(scores)
    assert not slow
    assert any(r.replans for r in requests.values()) or rate < 10


def test_tuning_mid_prefill_re_plans_instead_of_flagging() -> None:
    engine, _ = timed_engine(max_num_batched_tokens=64)
    rid = engine.add_request(prompt(600, 1), SamplingParams(max_tokens=2, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.update_config(max_num_batched_tokens=16)  # 4x more, smaller steps from here on
    while engine.has_unfinished():
        engine.step()
    request = next(r for r in engine.scheduler.recent if r.id == rid)
    assert request.replans >= 1 and 0.8 <= request.budget_score <= 1.1


# --- faults score above the threshold ----------------------------------------------------

def test_chunks_slower_than_predicted_are_flagged() -> None:
    slow_steps = {"on": False}
    engine, clock = timed_engine(lambda batch: 4.0 if slow_steps["on"] and batch.prefills
                                 else 1.0)
    requests, _ = serve(engine, clock, [(0.0, 300, 4)])
    assert requests and all(r.budget_score <= 1.1 for r in requests.values())
    slow_steps["on"] = True
    requests, slow = serve(engine, clock, [(clock.now, 300, 4), (clock.now, 120, 4)])
    assert {q.request_id for q in slow} == set(requests)
    assert all(q.budget_score > 2 for q in slow)


def test_time_in_cache_pressure_wait_is_flagged() -> None:
    # A pool of 64 blocks of 16 tokens (8 KiB each on the tiny model) and 64-token steps: the
    # later prompt, prefilling beside two decodes, takes usage past the watermark and waits
    # (decodes only) until they end.
    engine, clock = timed_engine(kv_cache_bytes=64 * 8192, cache_high_watermark=0.5,
                                 cache_low_watermark=0.3, max_num_batched_tokens=64)
    assert engine.blocks.num_blocks == 64
    modes: list[str] = []
    engine.bus.subscribe(lambda e: modes.append(e.new) if e.kind == "mode_changed" else None)
    requests, slow = serve(engine, clock, [(0.0, 120, 60), (0.0, 120, 60), (0.001, 400, 2)])
    late = list(requests)[-1]
    assert "CACHE_PRESSURE_WAIT" in modes
    assert [q.request_id for q in slow] == [late]
    assert requests[late].budget_score > 3
    assert all(r.budget_score == pytest.approx(1.0) for r in requests.values()
               if r.id != late)


# --- no verdicts before calibration --------------------------------------------------------

def test_an_uncalibrated_engine_gives_no_score_no_slow_query_and_no_cstar() -> None:
    engine, clock = timed_engine(lambda batch: 10.0, calibrated=False)
    assert engine.snapshot().calibration == "calibrating"
    requests, slow = serve(engine, clock, [(0.0, 300, 4), (0.0, 50, 4)])
    assert all(r.budget_score is None and not r.planned for r in requests.values())
    assert not slow
    snapshot = engine.snapshot()
    assert snapshot.recommended_chunk_size is None and snapshot.recommended_token_budget is None
    engine.apply_calibration(KNOWN)
    snapshot = engine.snapshot()
    assert snapshot.calibration == "calibrated" and snapshot.recommended_chunk_size is not None


def test_first_calibration_runs_at_start_with_progress_and_is_stored(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    config = EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32")
    seen: list[Event] = []
    with EngineSession.start(config, db=db, observers=[seen.append]) as session:
        assert session.engine.calibrated and session.first_calibration is not None
        assert session.calibration is not None and session.calibration.reason == FIRST_REASON
    progress = [e for e in seen if isinstance(e, CalibrationProgress)]
    assert progress and progress[-1].fraction == 1.0
    assert [e.fraction for e in progress] == sorted(e.fraction for e in progress)
    assert all(e.reason == FIRST_REASON for e in progress)
    seen.clear()
    with EngineSession.start(config, db=db, observers=[seen.append]) as session:
        # the stored one is used at once: no sweep, no progress
        assert session.engine.calibrated and session.first_calibration is None
        assert not any(isinstance(e, CalibrationProgress) for e in seen)
        with session.database.session() as db_session:
            assert len(calibration_history(db_session, model="synthetic:tiny")) == 1


# --- a stable C* ---------------------------------------------------------------------------

def cost_model() -> BudgetModel:
    """The tiny model on a fixed device: C* between 1 and thousands over these loads."""
    engine, _ = timed_engine(calibrated=False)
    return BudgetModel(engine.model_config, 4, DevicePeaks(name="test", flops=2e11,
                                                           bandwidth=2e10, source="test"))


def test_cstar_stays_put_under_a_fluctuating_load_and_within_bounds() -> None:
    budget = cost_model()
    cstar = CStar(window_s=30.0, hysteresis=0.25)
    rng = random.Random(3)
    values = []
    for step in range(20_000):  # 200 s of 10 ms steps, D jumping 2..14, S 100..900
        values.append(cstar.observe(step * 0.01, rng.randint(2, 14), rng.randint(100, 900),
                                    budget, tile=16, limit=256))
    assert all(16 <= v <= 256 for v in values)
    assert cstar.changes <= 3
    # instantaneous C* from single steps would have moved on most steps
    instant = {budget.recommended_chunk(rng.randint(2, 14), rng.randint(100, 900))
               for _ in range(100)}
    assert len(instant) > 20


def test_cstar_follows_a_lasting_change_and_is_clamped() -> None:
    budget = cost_model()
    cstar = CStar(window_s=10.0)
    for step in range(2000):  # 20 s at D=4, S=500
        cstar.observe(step * 0.01, 4, 500, budget, tile=16, limit=256)
    assert cstar.value == budget.recommended_chunk(4, 500) == 85
    for step in range(2000, 4000):  # many long decodes: C* far above the budget
        cstar.observe(step * 0.01, 64, 4000, budget, tile=16, limit=256)
    # once, when the window has held only the new load for a whole window: to the clamp
    assert cstar.value == 256 and cstar.changes == 1
    for step in range(4000, 6000):  # many short ones: C* under a tile
        cstar.observe(step * 0.01, 16, 0, budget, tile=16, limit=256)
    assert cstar.value == 16 and cstar.changes == 2
    assert token_budget_for(cstar.value, 3, 16) == 32
