"""Slow-query timelines: the parts cover the measured prefill and end-to-end times,
and the faults chaos injects are named as the cause of the requests they delayed."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from sqlalchemy import text

from console.cli.main import main
from engine import Engine, EngineConfig, SamplingParams
from engine.batch import Batch, ModelRunnerOutput
from engine.budget.peaks import measure_peaks
from engine.budget.predictor import StepTimePredictor
from engine.calibration.calibrate import first_calibration
from engine.clock import VirtualClock
from engine.core.request import Request
from engine.events import Event, EventBus, FailCause, Failed, ModeChanged, SlowQuery
from engine.harness import chaos
from engine.ops.telemetry import BandwidthSource, InjectedBandwidth, ModelBandwidth
from engine.ops.timeline import Cause
from engine.store import StoreWriter, list_slow_queries, open_database
from engine.store.database import upgrade_database
from tests.test_scheduler import STEP_S, SchedulerRig, sim

TOLERANCE = 0.05  # the parts add up to the measured time within 5%
IDLE_TICK_S = 0.001  # an idle engine loop's wait, on the virtual clock
MAX_STEPS = 100_000  # a bound on steps, so a broken scenario fails, not hangs


# --- on the scheduler, with a scripted clock --------------------------------------------
def throttled_rig(resumed_tokens: int | None = None) -> tuple[SchedulerRig, Request, Request]:
    """Two 64-token prompts share the steps (16 tokens each); after the first step a
    bandwidth spike (level 2: one prefill at a time) holds the second back. `resumed_tokens`:
    the second came back from the journal after a restart, with that many tokens."""
    s = sim(max_num_batched_tokens=32, chunk_tile=4, max_prefill_chunks=2,
            long_prefill_threshold=16)
    s.scheduler.controller.price_with(lambda shape: STEP_S)  # matches the rig's steps
    s.scheduler.controller.calibrated = True
    first, second = s.add(64, max_tokens=3), s.add(64, max_tokens=3)
    second.resumed_tokens = resumed_tokens
    s.step()
    s.bandwidth.inject(0.96, until_s=1.0)
    s.run()
    return s, first, second


def test_a_prefill_held_back_by_the_throttle_names_it_and_its_parts_cover_the_time() -> None:
    """The second prompt waits out the three steps the first still needs."""
    s, first, second = throttled_rig()
    slow = {e.request_id: e for e in s.of(SlowQuery)}
    assert set(slow) == {second.id}  # the first ran as planned: score 1
    held = slow[second.id]
    assert held.cause == Cause.BANDWIDTH_THROTTLE.value
    assert held.cause_share == pytest.approx(1.0)
    assert held.verdict == ("prefill took 70.0 ms: waited 30.0 ms while bandwidth throttle "
                            "level 2 held (100% of the overrun)\n"
                            "budget_score 1.75 (over its threshold 1.5): prefill 70.0 ms, "
                            "30.0 ms over its 40.0 ms plan")
    assert held.rules == ("budget_score",) and held.represents == 1
    t = held.timeline
    assert t["prefill_parts"]["chunks"] == pytest.approx(4 * STEP_S)
    assert t["prefill_parts"]["bandwidth_throttle"] == pytest.approx(3 * STEP_S)
    assert sum(t["prefill_parts"].values()) == pytest.approx(t["prefill_s"]) == 7 * STEP_S
    assert t["e2e_parts"] == pytest.approx({"queue_wait": 0.0, "prefill": 7 * STEP_S,
                                            "decode": 2 * STEP_S, "tail": 0.0})
    assert t["e2e_s"] == pytest.approx(9 * STEP_S)
    # its last chunk ran alone, the first request done: a lone request is not throttled
    assert [c["mode"] for c in held.chunks] == (["NORMAL"] + ["BANDWIDTH_THROTTLE"] * 2
                                                + ["NORMAL"])
    assert [c["other_prefill_tokens"] for c in held.chunks] == [16, 0, 0, 0]
    assert t["decode_gaps"]["count"] == 2 and t["decode_gaps"]["max_s"] == pytest.approx(STEP_S)
    assert first.state.is_final and second.state.is_final


# --- chaos's faults, on real engines ------------------------------------------------------
@pytest.fixture(scope="module")
def predictor() -> StepTimePredictor:
    """One first calibration of the chaos model on this CPU, applied to every chaos engine
    as a stored calibration of the same model and device is at start."""
    return first_calibration(Engine(EngineConfig(model=chaos.MODEL, device="cpu",
                                                 dtype="float32"))).predictor


@pytest.fixture(scope="module")
def workload() -> list[chaos.WorkloadRequest]:
    return chaos.workload(chaos.QUICK.requests, seed=7, prefix="chaos")


@pytest.fixture(scope="module")
def expected(workload: list[chaos.WorkloadRequest]) -> dict[str, list[int]]:
    return chaos.expected_outputs(workload)


@dataclass
class Observed:
    """Every engine a scenario builds, calibrated, with the events it published."""

    engines: list[Engine] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def slow(self) -> dict[str, SlowQuery]:
        return {e.request_id: e for e in self.events if isinstance(e, SlowQuery)}

    def mode_intervals(self, mode: str) -> list[tuple[float, float]]:
        intervals, since = [], None
        for event in self.events:
            if isinstance(event, ModeChanged):
                if event.new == mode and since is None:
                    since = event.ts
                elif event.new != mode and since is not None:
                    intervals.append((since, event.ts))
                    since = None
        return intervals + ([(since, math.inf)] if since is not None else [])


@pytest.fixture
def observed(monkeypatch: pytest.MonkeyPatch, predictor: StepTimePredictor,
             expected: dict[str, list[int]]) -> Observed:
    seen = Observed()
    build = chaos.chaos_engine

    def calibrated_engine(*args: object, **changes: object) -> Engine:
        engine = build(*args, **changes)  # type: ignore[arg-type]
        engine.apply_calibration(predictor)
        engine.bus.subscribe(seen.events.append)
        seen.engines.append(engine)
        return engine

    monkeypatch.setattr(chaos, "chaos_engine", calibrated_engine)
    return seen


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def waited_s(request: Request, intervals: list[tuple[float, float]]) -> float:
    """The time of its prefill a request spent inside `intervals` without a chunk of its own
    running: read from the fault's mode events and the request's chunk times alone."""
    assert request.prefill_started is not None
    end = request.prefill_finished or request.finish_time
    assert end is not None
    prefill = (request.prefill_started, end)
    inside = sum(_overlap(prefill, i) for i in intervals)
    running = sum(_overlap(prefill, _overlap_span(c.step_start, c.duration_s, i))
                  for c in request.chunks for i in intervals)
    return inside - running


def _overlap_span(start: float, duration: float, i: tuple[float, float]) -> tuple[float, float]:
    return max(start, i[0]), min(start + duration, i[1])


def affected(seen: Observed, mode: str) -> list[Request]:
    """The requests the fault alone made slow queries: their wait inside it overran their plan
    past both slow-query thresholds. A share of the prefill would not do: a plan counts the
    steps a request waits behind earlier prefills, which it may wait out inside the fault."""
    intervals = seen.mode_intervals(mode)
    return [r for engine in seen.engines for r in engine.scheduler.recent
            if r.prefill_started is not None and r.budgeted_prefill_s
            and engine.config.is_slow_query(waited_s(r, intervals), r.budgeted_prefill_s)]


class VirtualRun:
    """A chaos engine on a virtual clock whose every step takes exactly its predicted time,
    plus `delay_s` on prefill steps while a fault sets it. A verdict then weighs the fault
    alone: on real time, a loaded machine's slow chunks outweighed the fault they waited out."""

    def __init__(self, workload: list[chaos.WorkloadRequest],
                 bandwidth: Callable[[VirtualClock], BandwidthSource] | None = None,
                 **changes: object) -> None:
        self.clock = VirtualClock(start=0.0)
        source = None if bandwidth is None else bandwidth(self.clock)
        self.engine = chaos.chaos_engine(source, clock=self.clock, **changes)
        self.delay_s = 0.0
        forward = self.engine.runner.run

        def timed(batch: Batch) -> ModelRunnerOutput:
            output = forward(batch)
            self.clock.sleep(self.engine.predict(batch.shape())
                             + (self.delay_s if batch.prefills else 0.0))
            return output

        self.engine.runner.run = timed  # type: ignore[method-assign]
        self.harness = chaos._Harness(self.engine, workload)

    def run_until(self, condition: Callable[[], bool] = lambda: False) -> None:
        """Step until `condition()` or nothing is left to run; an idle step waits a loop tick."""
        for _ in range(MAX_STEPS):
            if not self.engine.has_unfinished() or condition():
                return
            self.harness.step()
            if not self.engine.stepping:
                self.clock.sleep(IDLE_TICK_S)
        raise AssertionError(f"still running after {MAX_STEPS} steps")

    def run_for(self, seconds: float, until: Callable[[], bool] = lambda: True) -> None:
        """Step through `seconds` of virtual time, and on until `until()` holds."""
        end = self.clock() + seconds
        self.run_until(lambda: self.clock() >= end and until())


def test_kv_exhaustion_flags_the_prefills_it_held_as_kv_pressure(
        observed: Observed, expected: dict[str, list[int]],
        workload: list[chaos.WorkloadRequest]) -> None:
    """chaos's KV exhaustion: every free block reserved away once a request decodes."""
    run = VirtualRun(workload)
    engine = run.engine
    run.run_until(lambda: any(r.is_decoding for r in engine.scheduler.requests.values()))
    engine.blocks.reserve(engine.blocks.num_blocks)
    run.run_for(chaos.QUICK.fault_s, lambda: engine.scheduler.cache_pressure)
    engine.blocks.reserve(0)
    run.run_until()
    assert run.harness.lost(expected) == 0
    held = affected(observed, "CACHE_PRESSURE_WAIT")
    assert held, "no prefill waited out the fault"
    slow = observed.slow()
    for request in held:
        assert slow[request.id].cause in (Cause.CACHE_PRESSURE, Cause.PREEMPTION), \
            slow[request.id].verdict


def test_slow_chunks_flags_the_requests_the_chunk_timeout_failed_as_slow_chunks(
        observed: Observed, expected: dict[str, list[int]],
        workload: list[chaos.WorkloadRequest]) -> None:
    """chaos's slow chunks: prefill steps three times the chunk timeout's base, until one
    times out; the client retries the failed ones."""
    base_ms = 100.0
    run = VirtualRun(workload, chunk_timeout_base_ms=base_ms)
    run.delay_s = 3 * base_ms / 1000
    run.run_for(chaos.QUICK.fault_s, lambda: bool(run.harness.failed))
    run.delay_s = 0.0
    run.harness.retry_failed = True
    for rid in list(run.harness.failed):
        run.harness.submit(rid)
    run.run_until()
    assert run.harness.lost(expected) == 0
    assert run.engine.blocks.num_used == 0
    timed_out = {e.request_id for e in observed.events
                 if isinstance(e, Failed) and e.cause is FailCause.CHUNK_TIMEOUT}
    assert timed_out
    slow = observed.slow()
    # A request planned after the slow steps raised the engine's live step scale has a
    # budget that already counts them, and may not overrun it: not every timed-out request
    # is slow. Every one that is, is slow chunks.
    flagged = timed_out & slow.keys()
    assert flagged, "no timed-out request was flagged slow"
    for request_id in flagged:
        assert slow[request_id].cause == Cause.SLOW_CHUNKS, slow[request_id].verdict
        assert "then failed: chunk timeout" in slow[request_id].verdict


def test_a_bandwidth_spike_mid_prefill_flags_the_prefills_it_held_as_the_throttle(
        observed: Observed, expected: dict[str, list[int]],
        workload: list[chaos.WorkloadRequest]) -> None:
    """chaos's spike, hitting once several prefills share the steps (chaos.bandwidth_spike
    starts it before the first step, when the throttle only delays admission)."""
    peak = measure_peaks("cpu", torch.float32).bandwidth
    run = VirtualRun(workload, lambda clock: InjectedBandwidth(ModelBandwidth(peak, clock=clock),
                                                               clock=clock),
                     long_prefill_threshold=chaos.CHUNK_TILE)
    engine, injected = run.engine, run.engine.bandwidth
    assert isinstance(injected, InjectedBandwidth)
    run.run_until(lambda: sum(r.state == "PREFILL_CHUNKING"
                              for r in engine.scheduler.requests.values()) >= 3)
    injected.inject(chaos.SPIKE_UTIL, math.inf)
    run.run_for(chaos.QUICK.fault_s)
    injected.clear()
    run.run_until()
    assert run.harness.lost(expected) == 0
    held = affected(observed, "BANDWIDTH_THROTTLE")
    assert held, "no prefill waited out the spike"
    slow = observed.slow()
    for request in held:
        assert slow[request.id].cause == Cause.BANDWIDTH_THROTTLE, slow[request.id].verdict
        assert "bandwidth throttle level" in slow[request.id].verdict


# --- a loaded run through the store ---------------------------------------------------------
def test_stored_slow_queries_of_a_loaded_run_add_up(tmp_path: Path,
                                                    predictor: StepTimePredictor) -> None:
    """32 prompts at once on a small pool and budget (queueing, preemption), every stored slow
    query's parts add up to its measured prefill and end-to-end times within 5%. The plan is
    priced a thousand times too fast, so every scored request overruns it and is stored: which
    ones overran the true plan would depend on the machine's load (and on what ran beside the
    calibration), the adding up must hold for all of them."""
    engine = chaos.chaos_engine(max_prefill_chunks=2, slow_query_threshold=1e-9,
                                slow_query_min_overrun_ms=0)
    fast = {name: getattr(predictor, name) / 1000 for name in (
        "constant_s", "multi_token_s", "per_token_s", "per_prefill_chunk_s", "per_decode_seq_s",
        "per_prefill_pair_s", "per_decode_context_s")}
    engine.apply_calibration(dataclasses.replace(predictor, **fast))
    database = open_database(tmp_path / "store.db")
    writer = StoreWriter(database, engine.bus)
    rng = random.Random(5)
    for i in range(32):
        engine.add_request([rng.randrange(3, 300) for _ in range(rng.randrange(20, 200))],
                           SamplingParams(max_tokens=rng.randrange(4, 24)), request_id=f"q{i}")
    while engine.has_unfinished():
        engine.step()
    assert writer.flush(60.0)
    with database.session() as session:
        stored = list_slow_queries(session)
    writer.close()
    database.close()
    assert len(stored) >= 5
    for record in stored:
        t = record.timeline
        assert t is not None and record.verdict and record.cause in set(Cause)
        assert sum(t["prefill_parts"].values()) == pytest.approx(record.prefill_s,
                                                                 rel=TOLERANCE)
        assert sum(t["e2e_parts"].values()) == pytest.approx(t["e2e_s"], rel=TOLERANCE)
        assert sum(t["overrun_by_cause"].values()) == pytest.approx(t["overrun_s"], abs=1e-9)
        assert 0.0 <= record.cause_share <= 1.0


def test_show_prints_the_verdict_and_timeline_and_json_returns_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s, _, second = throttled_rig()
    database = open_database(tmp_path / "store.db")
    bus = EventBus()
    writer = StoreWriter(database, bus)
    for event in s.of(SlowQuery):
        bus.publish(event)
    bus.drain()
    assert writer.close()
    database.close()
    db = str(tmp_path / "store.db")
    assert main(["slow-queries", "show", "1", "--db", db]) == 0
    out = capsys.readouterr().out
    assert ("verdict: prefill took 70.0 ms: waited 30.0 ms while bandwidth throttle level 2 "
            "held (100% of the overrun)  [cause bandwidth_throttle, 100%]\n         "
            "budget_score 1.75 (over its threshold 1.5)") in out
    assert "stored by budget_score\n" in out
    assert "end to end 90.0 ms = queue wait 0 µs + prefill 70.0 ms + decode 20.0 ms" in out
    assert "prefill 70.0 ms: chunks 40.0 ms, bandwidth throttle 30.0 ms" in out
    assert "_s=" not in out  # no raw floats
    assert main(["slow-queries", "show", "1", "--db", db, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["request_id"] == second.id and record["cause"] == "bandwidth_throttle"
    assert record["verdict"].startswith("prefill took 70.0 ms: waited 30.0 ms")
    assert record["rules"] == "budget_score" and record["represents"] == 1
    assert record["timeline"]["prefill_parts"]["bandwidth_throttle"] == pytest.approx(0.03)
    assert len(record["chunks"]) == 4 and record["chunks"][1]["mode"] == "BANDWIDTH_THROTTLE"


def test_a_resumed_request_says_so_once_beside_its_cached_tokens(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A request resumed from the journal carries the mark to its slow query, its stored
    record and `slow-queries show`, which says it once, on the prompt's line; the verdict
    stays about the time."""
    s, first, second = throttled_rig(resumed_tokens=2)
    (held,) = s.of(SlowQuery)
    assert held.request_id == second.id and held.resumed_tokens == 2
    assert "resumed" not in held.verdict
    database = open_database(tmp_path / "store.db")
    bus = EventBus()
    writer = StoreWriter(database, bus)
    bus.publish(held)
    bus.drain()
    assert writer.close()
    with database.session() as session:
        (record,) = list_slow_queries(session)
    database.close()
    assert record.resumed_tokens == 2 and record.cached_tokens == 0
    assert main(["slow-queries", "show", "1", "--db", str(tmp_path / "store.db")]) == 0
    out = capsys.readouterr().out
    assert out.count("resumed from the journal") == 1 and out.count("prefix cache") == 1
    assert ("\n64 prompt tokens, none found in the prefix cache; resumed from the journal "
            "after a restart with 2 output tokens already generated, prefilled again with its "
            "prompt\n") in out
    assert first.resumed_tokens is None  # a request that was never resumed says nothing


def test_slow_queries_stored_before_timelines_still_show(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Revision 0004 adds the timeline columns; rows from before it keep NULLs and show."""
    path = tmp_path / "old.db"
    database = open_database(path, upgrade=False)
    try:
        upgrade_database(database, "0001")
        with database.engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO slow_queries (created_at, request_id, tenant, tag, budget_score, "
                "prompt_tokens, prefill_s, budgeted_s, chunks, config) VALUES (1.0, 'old', "
                "'t', NULL, 2.5, 64, 0.5, 0.2, '[{\"index\": 0, \"duration_s\": 0.5}]', '{}')"))
        upgrade_database(database)
    finally:
        database.close()
    assert main(["slow-queries", "show", "1", "--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert "prefill 500.0 ms against a budget of 200.0 ms" in out and "verdict" not in out
    assert main(["slow-queries", "show", "1", "--db", str(path), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["timeline"] is None and record["cause"] is None
