"""What the user felt, stored and named: requests past the operator's SLO stored beside
budget_score's rule (and sampled past a rate, by count, saying so), a backlog's queue with
its arrival and finish rates, the operator's pause, a host taken by other processes
mid-prefill, and the bandwidth throttle held off a lone request and a modelled figure. All
on a scripted clock with injected host and bandwidth readings."""

from __future__ import annotations

import re

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.batch import HostMark, StepTiming
from engine.calibration.drift import DriftMonitor, Job
from engine.core.modes import Modes
from engine.core.scheduler import RECENT_FINISHED
from engine.events import CalibrationProgress, SlowQuery, StepComplete
from engine.ops.host import HostCounters, HostSensor
from engine.ops.slow_query_watch import RATE_LOG, STEP_LOG, SloSampler
from engine.ops.telemetry import ModelBandwidth
from tests.test_scheduler import STEP_S, SchedulerRig, sim

RATES = re.compile(r"(\d+\.\d) arrivals/s against (\d+\.\d) finishes/s, (\d+) queued when it "
                   r"arrived")


def priced(**changes: object) -> SchedulerRig:
    """A rig whose plan prices every step at what the rig's steps take: on plan, score 1."""
    s = sim(**changes)
    s.scheduler.controller.price_with(lambda shape: STEP_S)
    s.scheduler.controller.calibrated = True
    return s


def slow_queries(s: SchedulerRig) -> list[SlowQuery]:
    return [e for e in s.events if isinstance(e, SlowQuery)]


def backlog(s: SchedulerRig, steps: int = 10, per_step: int = 3) -> None:
    """`per_step` 32-token prompts arrive each step for `steps` steps; one fills a step."""
    for _ in range(steps):
        for _ in range(per_step):
            s.add(32, max_tokens=2)
        s.step()
    s.run()


def test_a_backlog_stores_every_request_past_the_ttft_slo_naming_the_queue_and_its_rates(
        ) -> None:
    s = priced(max_num_batched_tokens=32, chunk_tile=4, slo_ttft_ms=100)
    backlog(s)
    late = {r.id for r in s.requests if r.ttft_s is not None and r.ttft_s > 0.1}
    stored = slow_queries(s)
    assert len(late) >= 15 and {e.request_id for e in stored} == late
    for event in stored:
        assert event.rules == ("ttft_slo",) and event.represents == 1
        felt, budget = event.verdict.split("\n")
        assert felt.startswith("waited ") and " in the queue: arrivals outran finishes, " in felt
        arrivals, finishes, queued = RATES.search(felt).groups()
        assert float(arrivals) > float(finishes) and int(queued) > 0
        assert budget.startswith("budget_score 1.00 (within its threshold 1.5)")
        assert (event.felt_part, event.felt_cause) == ("queue_wait", "queued")
        assert event.budget_score == pytest.approx(1.0)  # its prefill ran as planned


def test_slo_breaches_past_the_burst_are_counted_and_the_next_stored_one_says_so() -> None:
    s = priced(max_num_batched_tokens=32, chunk_tile=4, slo_ttft_ms=100)
    s.scheduler.watch.sampler = SloSampler(burst=4, rate_per_s=20.0)
    backlog(s)
    late = [r for r in s.requests if r.ttft_s is not None and r.ttft_s > 0.1]
    stored = slow_queries(s)
    assert 4 < len(stored) < len(late)
    # by count: every breach is stored, or counted on a stored row, or still pending
    assert sum(e.represents for e in stored) + s.scheduler.watch.sampler.unstored == len(late)
    assert s.scheduler.watch.unstored == len(late) - len(stored)
    sampled = [e for e in stored if e.represents > 1]
    assert sampled and all(f"sampled: stands for {e.represents} requests past the SLO"
                           in e.verdict for e in sampled)


def test_the_sampler_refills_on_its_clock_across_a_gap_longer_than_its_burst() -> None:
    sampler = SloSampler(burst=3, rate_per_s=1.0)
    assert [sampler.admit(0.0) for _ in range(5)] == [True, True, True, False, False]
    assert not sampler.admit(0.5) and sampler.admit(1.0)
    assert sampler.take_represented() == 4 and sampler.take_represented() == 1
    assert [sampler.admit(3600.0) for _ in range(4)] == [True, True, True, False]


def test_the_operators_pause_is_named_as_a_pause() -> None:
    s = priced(max_num_batched_tokens=64, slo_ttft_ms=100, slo_itl_ms=100)
    waited = s.add(16, max_tokens=3)
    s.scheduler.watch.hold(s.now, True)
    s.now += 20.0
    s.scheduler.watch.hold(s.now, False)
    s.run()
    stalled = s.add(16, max_tokens=4)
    s.step()
    s.step()
    s.scheduler.watch.hold(s.now, True)
    s.now += 5.0
    s.scheduler.watch.hold(s.now, False)
    s.run()
    by_id = {e.request_id: e for e in slow_queries(s)}
    first = by_id[waited.id]
    assert first.rules == ("ttft_slo",)
    assert first.verdict.startswith(
        "waited 20.0 s in the queue: the operator paused the engine for 20.0 s of it; ")
    assert (first.felt_cause, first.felt_share) == ("paused", pytest.approx(1.0))
    assert "sat between steps" not in first.verdict
    second = by_id[stalled.id]
    assert second.rules == ("itl_slo",)
    assert second.verdict.startswith("stalled 5.01 s between two tokens at step ")
    assert "the operator paused the engine" in second.verdict.split("\n")[0]
    assert second.felt_cause == "paused"


def test_contention_starting_mid_prefill_names_the_host_not_the_chunks() -> None:
    s = priced(max_num_batched_tokens=16, chunk_tile=4, long_prefill_threshold=16)
    request = s.add(128, max_tokens=2)  # 8 chunks of 16, each planned at one step
    for _ in range(3):
        s.step()
    s.host = HostMark(contended=True, others_cpus=1.8, own_cpus=0.2, measured=True)
    s.step_s = 3 * STEP_S  # the other 5 chunks take three times their prediction
    s.run()
    (event,) = slow_queries(s)
    assert event.request_id == request.id and event.rules == ("budget_score",)
    assert event.cause == "host_busy" and event.felt_cause == "host_busy"
    assert event.verdict.split("\n")[0] == (
        "prefill took 180.0 ms: other processes took the CPU (1.8 CPUs of their work) while "
        "its steps ran: +100.0 ms (100% of the overrun)")
    contended = [c["contended"] for c in event.chunks]
    assert contended == [False] * 3 + [True] * 5


def test_another_process_on_the_gpu_is_named_as_the_cpu_one_is() -> None:
    s = priced(max_num_batched_tokens=16, chunk_tile=4, long_prefill_threshold=16)
    request = s.add(128, max_tokens=2)
    for _ in range(3):
        s.step()
    s.host = HostMark(contended=True, own_cpus=1.0, measured=True, others_gpu=0.4,
                      gpu_others="python[4242] 40% SM 2.0 GiB")
    s.step_s = 3 * STEP_S
    s.run()
    (event,) = slow_queries(s)
    assert event.request_id == request.id and event.felt_cause == "host_busy"
    assert event.verdict.split("\n")[0] == (
        "prefill took 180.0 ms: other processes took the GPU (40% of the GPU's SM time) while "
        "its steps ran: +100.0 ms (100% of the overrun)")


def test_contended_steps_teach_the_step_ratio_nothing() -> None:
    controller = priced().scheduler.controller
    busy = HostMark(contended=True, others_cpus=1.5, measured=True)
    for i in range(50):
        controller.after_step(StepTiming(i * 0.1, 4 * STEP_S, STEP_S, busy), i * 0.1 - 1, True,
                              True)
    assert controller.step_ratio.value == 1.0 and controller.step_scale == 1.0
    assert not controller.overheads


def test_the_throttle_never_acts_on_a_lone_request() -> None:
    s = sim(max_num_batched_tokens=64, chunk_tile=16, bandwidth_pause_s=2 * STEP_S)
    s.add(900, max_tokens=8)
    for _ in range(10):  # a measured 99%, past the pause line for longer than its time
        s.bandwidth.inject(0.99, until_s=s.now + 1.0)
        s.step()
        assert s.scheduler.throttle_level == 0 and s.scheduler.mode == "NORMAL"
    assert "one request is running" in s.scheduler.modes.throttle_note
    s.add(900, max_tokens=8)  # a second prompt: now there are prefills to hold back
    s.bandwidth.inject(0.96, until_s=s.now + 1.0)
    s.step()
    assert s.scheduler.throttle_level == 2 and s.scheduler.modes.throttle_note == ""


def test_the_throttle_is_off_on_a_modelled_figure_and_says_so() -> None:
    now = [0.0]
    modelled = ModelBandwidth(1e9, clock=lambda: now[0])
    now[0] = 1.0
    modelled.record(2e9, 1.0)  # twice the modelled peak: a reading over 100%
    modes = Modes(modelled, lambda event: None, lambda: now[0])
    modes.update(EngineConfig(), 0.1, live=6, prefills=5)
    assert modelled.reading().util_5s > 1.0 and not modelled.reading().measured
    assert modes.throttle_level == 0 and modes.mode == "NORMAL"
    assert modes.throttle_note.startswith("throttle off: the bandwidth figure is modelled")


class ScriptedHost:
    """Cumulative /proc counters advanced by hand, one second at a time, on two CPUs."""

    def __init__(self) -> None:
        self.now = 0.0
        self.counters = HostCounters(0.0, 0.0, 0.0, 0.0, cpus=2)

    def second(self, others: float, own: float, steal: float = 0.0) -> None:
        c = self.counters
        self.now += 1.0
        self.counters = HostCounters(c.busy_s + others + own, c.total_s + 2.0,
                                     c.steal_s + 2.0 * steal, c.own_s + own, 2)


def test_the_host_sensor_marks_contention_only_when_others_take_the_cpus() -> None:
    host = ScriptedHost()
    sensor = HostSensor(lambda: host.now, read=lambda: host.counters, interval_s=0.5)
    assert not sensor.mark(0.0).measured  # no reading yet
    host.second(others=0.1, own=1.8)
    assert not sensor.mark(host.now).contended
    host.second(others=0.6, own=1.3)  # the CPUs full, others holding 0.6 of them
    mark = sensor.mark(host.now)
    assert mark.contended and mark.others_cpus == pytest.approx(0.6)
    assert mark.own_cpus == pytest.approx(1.3)
    host.second(others=0.6, own=0.3)  # others on cores this process left idle
    assert not sensor.mark(host.now).contended
    host.second(others=0.0, own=1.0, steal=0.05)
    assert sensor.mark(host.now).contended  # the hypervisor stole 5%
    host.counters = host.counters._replace(busy_s=host.counters.busy_s + 1.0)
    assert sensor.mark(host.now + 0.1).contended  # within its interval: the last reading
    host.now += 600.0  # a gap far longer than the interval: one reading over all of it
    host.counters = host.counters._replace(total_s=host.counters.total_s + 1200.0)
    assert not sensor.mark(host.now).contended


def test_a_recalibration_due_under_contention_waits_and_says_why() -> None:
    host = ScriptedHost()
    sensor = HostSensor(lambda: host.now, read=lambda: host.counters, interval_s=0.5)
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"),
                    host=sensor, clock=lambda: host.now)
    engine.scheduler.controller.calibrated = True  # a plan in force: the one to protect
    progress: list[CalibrationProgress] = []
    engine.bus.subscribe(lambda e: progress.append(e) if isinstance(e, CalibrationProgress)
                         else None)
    jobs: list[Job] = []
    monitor = DriftMonitor(engine, jobs.append, clock=lambda: host.now)
    host.second(others=1.2, own=0.8)
    assert monitor.request("test")
    jobs.pop(0)(engine)
    engine.bus.drain()
    assert not jobs and monitor.recalibrations == 0
    assert monitor.waiting == "recalibration waits: other processes use 1.2 CPUs, steal 0%"
    assert progress[-1].note == monitor.waiting
    step = StepComplete(step=1, prefill_tokens=0, decode_seqs=1, duration_s=0.01,
                        predicted_s=0.01, mode="NORMAL")
    host.second(others=1.2, own=0.8)
    sensor.mark(host.now)
    monitor.observe(step)
    assert not jobs  # still busy: it goes on waiting
    host.second(others=0.0, own=1.0)
    sensor.mark(host.now)  # a step's mark: the host is quiet again
    monitor.observe(step)
    assert len(jobs) == 1 and monitor.waiting is None and monitor.pending_reason == "test"


def test_what_an_engine_keeps_per_request_is_bounded_by_count_not_by_requests_served() -> None:
    """Every request past its SLO (a 1 ms one): what the engine keeps after 320 requests is
    what it kept after 80, as far as anything grows with finished requests."""
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 slo_ttft_ms=1e-3, slo_itl_ms=1e-3))
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def serve(n: int) -> dict[str, int]:
        for i in range(n):
            engine.add_request([3 + i % 50] * (8 + i % 24), params)
            if i % 3 == 0:
                engine.step()
        while engine.has_unfinished():
            engine.step()
        watch, s = engine.scheduler.watch, engine.scheduler
        return {"live": len(s.requests), "recent": len(s.recent),
                "flagged": len(watch.flagged), "sampled_out": len(watch.sampled_out),
                # the runner hears of the last step's ends with the next batch
                "runner": len(engine.runner.requests.held) + len(engine.runner.requests.parked)
                - len(s.unheard.ended),
                "metrics": len(engine.metrics._last_token_ts)
                + len(engine.metrics._prompt_counted)}

    after_80 = serve(80)
    after_320 = serve(240)
    assert after_320 == after_80 == {"live": 0, "recent": RECENT_FINISHED, "flagged": 0,
                                     "sampled_out": 0, "runner": 0, "metrics": 0}
    watch = engine.scheduler.watch
    assert watch.step_log.maxlen == STEP_LOG and watch.arrivals.maxlen == RATE_LOG
    assert watch.finishes.maxlen == RATE_LOG and watch.mode_log.maxlen is not None
