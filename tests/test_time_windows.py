"""Every window kept over time is right after an empty window, a gap longer than itself, a
single sample, a clock that does not move, and a pause: all on a VirtualClock, so an idle
minute (or an idle night) passes in microseconds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from sqlalchemy import select

from console.sources.prometheus_text import MAX_READINGS, MetricWindow, Reading
from console.tui.history import MetricHistory
from engine import Engine
from engine.budget import auto, predictor
from engine.budget.auto import CStar
from engine.budget.predictor import StepTimeRatio
from engine.clock import VirtualClock
from engine.config import EngineConfig, SamplingParams
from engine.core.request import RequestState
from engine.events import EventBus, Finished, RequestAdded, StepComplete
from engine.harness.driver import drive
from engine.harness.workload import WorkloadRequest
from engine.ops.metrics import RATE_WINDOW_S, WINDOW_SAMPLES, Metrics
from engine.ops.telemetry import ModelBandwidth
from engine.sim.executor import simulated_engine
from engine.sim.target import resolve_target
from engine.snapshot import Snapshot
from engine.store import RetentionLimits, StoreWriter, open_database
from engine.store.models import JournalRow

CONFIG = EngineConfig(model="synthetic:tiny")


def calibrated_sim(clock: VirtualClock) -> Engine:
    """The real scheduler, metrics and guards on the simulated executor, pricing prefill
    plans as a calibrated engine does (the step-time ratio is only kept then)."""
    engine = simulated_engine(CONFIG, resolve_target("a100", CONFIG), clock)
    engine.scheduler.controller.calibrated = True
    return engine


def serve_one(engine: Engine, rid: str) -> str:
    engine.add_request([1, 2, 3, 4] * 8, SamplingParams(max_tokens=4, ignore_eos=True),
                       request_id=rid)
    while engine.has_unfinished():
        engine.step()
    return engine.scheduler.recent[-1].state.value


def test_an_idle_minute_between_requests_never_stops_the_engine() -> None:
    """The reproduction: two requests, 65 s of nothing, a third (a StatisticsError before)."""
    clock = VirtualClock(start=0.0)
    engine = calibrated_sim(clock)
    assert serve_one(engine, "a") == RequestState.FINISHED.value
    clock.sleep(5)
    assert serve_one(engine, "b") == RequestState.FINISHED.value
    clock.sleep(65)
    assert serve_one(engine, "c") == RequestState.FINISHED.value
    assert engine.step_ratio.value == 1.0  # the idle minute left no evidence in the window


def test_a_run_with_arrivals_at_0_and_62_s_serves_both() -> None:
    clock = VirtualClock(start=0.0)
    engine = calibrated_sim(clock)
    workload = [WorkloadRequest(request_id=f"r{i}", prompt_token_ids=tuple(range(1, 40)),
                                max_tokens=4, arrival_s=at) for i, at in enumerate((0.0, 62.0))]
    result = drive(engine, workload, sleep=clock.sleep)
    assert sorted(result.records) == ["r0", "r1"]
    assert all(r.state == RequestState.FINISHED.value for r in result.records.values())


# --- the step-time ratio ------------------------------------------------------------------

def test_ratio_empty_single_gap_and_pause() -> None:
    ratio = StepTimeRatio(window_s=60.0, bucket_s=1.0)
    assert (ratio.value, ratio.steps, ratio.span_s) == (1.0, 0, 0.0)  # empty
    ratio.observe(0.0, 2.0, 1.0)
    assert ratio.value == 1.0  # a single sample: no bucket is complete yet
    for t in range(1, 30):
        ratio.observe(float(t), 2.0, 1.0)
    assert ratio.value == 2.0 and ratio.span_s == 28.0
    ratio.observe(29.0 + 3600, 3.0, 1.0)  # an hour's pause: every bucket left the window
    assert (ratio.value, ratio.steps, ratio.span_s) == (1.0, 0, 0.0)
    ratio.observe(29.0 + 3601, 3.0, 1.0)
    assert ratio.value == 3.0  # and it measures again at once


def test_ratio_gap_just_inside_the_window_keeps_the_last_bucket() -> None:
    ratio = StepTimeRatio(window_s=60.0, bucket_s=1.0)
    ratio.observe(0.0, 2.0, 1.0)
    ratio.observe(0.5, 2.0, 1.0)
    ratio.observe(60.4, 1.0, 1.0)  # the bucket's last step, 0.5 s, is 59.9 s old
    assert ratio.value == 2.0 and ratio.steps == 2


def test_ratio_with_a_clock_that_does_not_move_is_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(predictor, "BUCKET_STEPS", 50)
    ratio = StepTimeRatio(window_s=2.0, bucket_s=1.0)
    for _ in range(500):
        ratio.observe(5.0, 1.5, 1.0)
    assert ratio.value == 1.5
    assert len(ratio._buckets) <= 3 and len(ratio._current) <= 50


def test_ratio_ignores_unusable_steps() -> None:
    ratio = StepTimeRatio()
    for t, measured, predicted in ((0.0, 1.0, 0.0), (1.0, float("nan"), 1.0),
                                   (2.0, -1.0, 1.0)):
        ratio.observe(t, measured, predicted)
    assert ratio.steps == 0 and ratio.value == 1.0


# --- C* -------------------------------------------------------------------------------------

class _Load:
    """A budget whose C* is the decode count times 100 (recommended_chunk's contract)."""

    @staticmethod
    def recommended_chunk(decodes: int, _context: int) -> int:
        return max(1, decodes * 100)


def test_cstar_after_a_gap_longer_than_its_window_waits_a_window_again() -> None:
    cstar = CStar(window_s=20.0, hysteresis=0.25)
    assert cstar.observe(0.0, 2, 100, _Load(), 16, 8192) == 200  # a single sample
    assert cstar.observe(1.0, 8, 100, _Load(), 16, 8192) == 200  # outside the band from now
    # 8 hours of nothing: one step at the new load must not count as a whole window of it
    assert cstar.observe(1.0 + 8 * 3600, 8, 100, _Load(), 16, 8192) == 200
    assert cstar.observe(1.0 + 8 * 3600 + 20, 8, 100, _Load(), 16, 8192) == 800
    assert cstar.changes == 1


def test_cstar_with_a_clock_that_does_not_move_is_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "MAX_SAMPLES", 100)
    cstar = CStar(window_s=20.0)
    for decodes in range(110):
        cstar.observe(7.0, decodes % 3, 50, _Load(), 16, 8192)
    assert len(cstar._samples) == 100
    assert cstar._decodes == sum(d for _, d, _ in cstar._samples)


# --- metrics: rates and latency windows ----------------------------------------------------

def step(ts: float, duration_s: float, tokens: int) -> StepComplete:
    return StepComplete(step=1, prefill_tokens=tokens, decode_seqs=0, duration_s=duration_s,
                        ts=ts)


def test_rates_of_a_single_step_are_its_own_tokens_over_its_own_time() -> None:
    metrics = Metrics()
    assert metrics.rates(0.0) == (0.0, 0.0)  # empty
    metrics.observe(step(ts=10.0, duration_s=0.5, tokens=100))
    assert metrics.rates(10.0)[0] == pytest.approx(200.0)  # not 100 tokens over 1 ms
    assert metrics.rates(10.0 + 3600)[0] == 0.0  # an hour later: nothing in the window
    metrics.observe(step(ts=11.0, duration_s=0.0, tokens=100))
    assert metrics.rates(11.0)[0] == pytest.approx(200 / 1.5)


def test_rates_with_a_clock_that_does_not_move() -> None:
    metrics = Metrics()
    for _ in range(WINDOW_SAMPLES + 5):
        metrics.observe(step(ts=4.0, duration_s=0.0, tokens=8))
    assert metrics.rates(4.0) == (0.0, 0.0)  # no time passed: no rate, not infinity
    assert len(metrics._rate) == WINDOW_SAMPLES


def test_latency_window_is_empty_after_a_gap_longer_than_itself() -> None:
    metrics = Metrics(window_s=60.0)
    metrics.observe(step(ts=0.0, duration_s=0.2, tokens=8))
    assert metrics.latency(0.0).step.p50 == pytest.approx(200.0)  # a single sample
    assert metrics.latency(61.0).step.p50 is None


# --- bandwidth, 5 s average -------------------------------------------------------------

def test_bandwidth_average_after_a_gap_and_with_a_standing_clock() -> None:
    clock = VirtualClock(start=0.0)
    source = ModelBandwidth(100.0, window_s=5.0, clock=clock)
    assert source.reading().util_5s == 0.0  # empty, and no time passed
    clock.sleep(1.0)
    source.record(50.0, 1.0)
    assert source.reading().util_5s == pytest.approx(0.5)  # a single step over its second
    clock.sleep(3600)
    assert source.reading().util_5s == 0.0  # the idle hour
    source.record(100.0, 0.0)  # a step of no time on a clock that did not move
    assert 0.0 <= source.reading().util_5s <= 2.0


# --- the console's scrape window ----------------------------------------------------------

def reading(ts: float, count: float) -> Reading:
    return Reading(ts, {"tokens": count}, {})


def test_metric_window_single_gap_and_standing_clock() -> None:
    window = MetricWindow(span_s=60.0, min_span_s=10.0)
    assert window.rate("tokens") is None  # empty
    window.add(reading(0.0, 0.0))
    assert window.rate("tokens") is None  # a single reading
    window.add(reading(3600.0, 7200.0))  # a paused console, an hour between scrapes
    assert window.seconds == 3600.0 and window.rate("tokens") == pytest.approx(2.0)
    window.add(reading(3630.0, 7500.0))
    window.add(reading(3700.0, 7700.0))
    assert window.rate("tokens") == pytest.approx(200 / 70)  # the hour has left the window
    for _ in range(MAX_READINGS + 10):
        window.add(reading(3700.0, 7700.0))
    assert len(window.readings) == MAX_READINGS and window.rate("tokens") is None


# --- the console's history: charts, diagnoses, before/after figures ------------------------

def test_history_windows_end_at_the_newest_snapshot_not_the_newest_sample() -> None:
    history = MetricHistory()
    base = Snapshot(ts=0.0, step=1, preemptions_total=0)
    history.record(base)
    history.record(dataclasses.replace(base, ts=10.0, step=2, preemptions_total=5))
    assert history.window("preemptions_total", 60.0) == [0.0, 5.0]
    # an hour idle: the same step, snapshot after snapshot, and no sample is recent any more
    history.record(dataclasses.replace(base, ts=3610.0, step=2, preemptions_total=5))
    assert history.newest_ts == 3610.0 and history.window("preemptions_total", 60.0) == []
    history.record(dataclasses.replace(base, ts=3610.0, step=2))  # a clock that stands
    assert history.newest_ts == 3610.0


def test_arrival_rates_are_taken_over_the_rate_window_across_polls_and_idle_gaps() -> None:
    history = MetricHistory()
    base = Snapshot(ts=0.0, step=0)
    # 3 requests a second, polled every 0.4 s: each poll sees 1 or 2 arrive, never 7.5/s
    for n in range(1, 76):
        ts = n * 0.4
        history.record(dataclasses.replace(base, ts=ts, step=n,
                                           requests_finished_total=int(ts * 3)))
    rates = history.values("arrival_rate")[-50:]  # a full window behind each
    assert all(2.8 <= rate <= 3.2 for rate in rates), rates
    # an hour idle, then 6 arrive: 6 over the last window, not 6 over the hour
    history.record(dataclasses.replace(base, ts=3630.0, step=100,
                                       requests_finished_total=90 + 6))
    assert history.values("arrival_rate")[-1] == pytest.approx(6 / RATE_WINDOW_S)


def test_pauses_resumes_and_restarts_are_marked_though_the_step_stands() -> None:
    history = MetricHistory()
    base = Snapshot(ts=0.0, step=3)
    history.record(base)
    history.record(dataclasses.replace(base, ts=5.0, paused=True))  # the same step, paused
    history.record(dataclasses.replace(base, ts=9000.0, paused=True))  # hours later, still
    history.record(dataclasses.replace(base, ts=9001.0))  # resumed
    history.record(dataclasses.replace(base, ts=9002.0, step=4, engine_restarts=1))
    assert list(history.events) == [5.0, 9001.0, 9002.0]
    history.clear()
    assert not history.events


# --- the store writer's retention timer ---------------------------------------------------

def test_store_retention_runs_on_the_writers_clock(tmp_path: Path) -> None:
    clock = VirtualClock(start=0.0)
    database = open_database(tmp_path / "store.db")
    bus = EventBus()
    writer = StoreWriter(database, bus, retention=RetentionLimits(journal=2),
                         retention_interval_s=3600.0, clock=clock)
    try:
        def deliver(rid: str) -> None:
            bus.publish(RequestAdded(request_id=rid, prompt_token_ids=(1, 2), sampling={},
                                     tenant="t"))
            bus.publish(Finished(request_id=rid, reason="length", prompt_tokens=2,
                                 generated_tokens=1, ttft_s=0.1, e2e_s=0.1, budget_score=None))
            bus.drain()
            assert writer.flush(timeout=10)

        def rows() -> int:
            with database.session() as session:
                return len(session.scalars(select(JournalRow.request_id)).all())

        for rid in ("a", "b", "c", "d"):
            deliver(rid)
        assert rows() == 4  # the hour has not passed on the writer's clock
        clock.sleep(2 * 3600)  # an idle night: the next batch applies retention
        deliver("e")
        assert rows() == 2
    finally:
        writer.close()
        database.close()
