"""The host's load: what else used the machine during a bench run, and around each step."""

from __future__ import annotations

from collections import namedtuple

import psutil
import pytest

from engine.ops.host import HostLoad, HostLoadMeter

CpuTimes = namedtuple("CpuTimes", "user nice system idle iowait irq softirq steal guest "
                                  "guest_nice")
ProcessTimes = namedtuple("ProcessTimes", "user system children_user children_system")


def test_a_quiet_reading_and_a_busy_one() -> None:
    assert HostLoad(wall_s=1.0, others_cpus=0.1, steal=0.01, load_1m=0.5).quiet
    assert not HostLoad(wall_s=1.0, others_cpus=0.5, steal=0.0, load_1m=1.5).quiet
    assert not HostLoad(wall_s=1.0, others_cpus=0.0, steal=0.05, load_1m=0.2).quiet
    assert HostLoad(1.0, 0.12345, 0.001234, 0.456).to_dict() == {
        "others_cpus": 0.123, "steal": 0.0012, "load_1m": 0.46, "own_cpus": 0.0,
        "quiet": True}


def test_others_are_the_hosts_busy_time_less_this_process_and_guests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # two CPUs over 10 s: 20 s of CPU time. This process used 9 s; the host was busy 12 s
    # (user counts the 1 s of guest time again), idle 6, stolen 2.
    host = iter([CpuTimes(0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                 CpuTimes(user=9.0, nice=0.0, system=3.0, idle=5.0, iowait=1.0, irq=0.0,
                          softirq=0.0, steal=2.0, guest=1.0, guest_nice=0.0)])
    own = iter([ProcessTimes(1.0, 0.0, 0.0, 0.0), ProcessTimes(8.0, 2.0, 0.0, 0.0)])
    clock = iter([100.0, 110.0])
    monkeypatch.setattr(psutil, "cpu_times", lambda: next(host))
    monkeypatch.setattr(psutil.Process, "cpu_times", lambda self: next(own))
    reading = HostLoadMeter(clock=lambda: next(clock)).reading()
    assert reading.wall_s == 10.0
    assert reading.others_cpus == pytest.approx((12.0 - 9.0) / 10.0)  # 0.3 CPUs elsewhere
    assert reading.steal == pytest.approx(2.0 / 20.0)
    assert reading.own_cpus == pytest.approx(9.0 / 10.0)
    assert not reading.quiet


def test_a_real_reading_is_in_bounds() -> None:
    meter = HostLoadMeter()
    assert sum(range(1_000_000)) > 0
    reading = meter.reading()
    assert reading.wall_s > 0 and 0.0 <= reading.steal <= 1.0 and reading.load_1m >= 0.0
    assert reading.others_cpus >= 0.0  # an upper bound would race the kernel's 10 ms ticks
