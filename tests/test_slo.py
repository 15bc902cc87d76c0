"""SLO checks: one stall fails Sarathi-Serve's time between tokens but not a request's TPOT."""

from __future__ import annotations

from engine.harness.driver import RequestRecord, RunResult
from engine.harness.slo import SLO, CapacityProbe, capacity

SLO_100MS = SLO(decode_step_s=0.02, tpot_s=0.1, delay_s=0.5)


def _result(gaps: list[float], state: str = "FINISHED") -> RunResult:
    times = [1.0]
    for gap in gaps:
        times.append(times[-1] + gap)
    record = RequestRecord("r", "default", arrival=0.9, prompt_tokens=8, token_times=times,
                           state=state, first_scheduled=0.95)
    return RunResult({"r": record}, steps=[], wall_s=times[-1])


def test_a_single_stall_breaks_tbt_but_is_averaged_away_in_tpot() -> None:
    result = _result([0.05] * 99 + [0.5])  # mean 54.5 ms, one 500 ms gap
    assert CapacityProbe.of(1.0, result, SLO_100MS, "tpot").ok
    probe = CapacityProbe.of(1.0, result, SLO_100MS, "tbt")
    assert not probe.ok
    assert probe.tbt_p99_ms == 500.0 and round(probe.tpot_p99_ms, 1) == 54.5


def test_an_unfinished_request_or_a_late_start_fails_either_metric() -> None:
    assert not CapacityProbe.of(1.0, _result([0.05], state="FAILED"), SLO_100MS, "tpot").ok
    late = _result([0.05])
    late.records["r"].first_scheduled = 2.0  # 1.1 s after arrival, SLO 0.5 s
    assert not CapacityProbe.of(1.0, late, SLO_100MS, "tbt").ok


def test_capacity_finds_the_highest_rate_that_holds() -> None:
    def run_at(rate: float) -> RunResult:  # gaps grow with load; the SLO breaks above 4/s
        return _result([0.02 * rate] * 10)

    best, probes = capacity(run_at, SLO_100MS, low=0.5, high=32.0, iterations=8, metric="tbt")
    assert 4.5 < best <= 5.0
    assert all(p.ok == (p.rate <= 5.0) for p in probes)
