"""How busy the host is: this process's CPU time against wall time, others' CPU, and steal."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import psutil

from engine.batch import HostMark

# A reading is quiet below both: a quarter of a CPU of other work, 2% of CPU time stolen.
BUSY_OTHERS_CPUS = 0.25
BUSY_STEAL = 0.02
# Contended: others took at least that quarter CPU while the CPUs were this full (others'
# work and ours), so theirs was taken from ours; or the hypervisor stole that much.
SATURATED = 0.9
# The engine samples /proc at most this often (on its clock); a step carries the latest mark.
SAMPLE_INTERVAL_S = 0.5

# /proc/stat counts guest time inside user and nice; steal and idle are not work done here
_NOT_BUSY = ("idle", "iowait", "steal", "guest", "guest_nice")


class HostCounters(NamedTuple):
    """Cumulative CPU seconds since boot: the host's busy and total time, its steal, ours."""

    busy_s: float
    total_s: float
    steal_s: float
    own_s: float
    cpus: int = 1  # the host's logical CPUs, those /proc/stat's totals cover


def read_host(process: psutil.Process | None = None) -> HostCounters:
    """The counters now, from /proc (psutil)."""
    cpu = psutil.cpu_times()
    fields = cpu._asdict()
    own = (process or psutil.Process()).cpu_times()
    return HostCounters(
        busy_s=sum(v for name, v in fields.items() if name not in _NOT_BUSY),
        total_s=sum(v for name, v in fields.items() if name not in ("guest", "guest_nice")),
        steal_s=fields.get("steal", 0.0), own_s=own.user + own.system,
        cpus=psutil.cpu_count() or 1)


@dataclass(frozen=True)
class HostLoad:
    """The host between two readings of its counters, `wall_s` apart."""

    wall_s: float
    others_cpus: float
    steal: float
    load_1m: float
    own_cpus: float = 0.0  # this process's CPU time over wall time
    cpus: int = 0  # the host's CPUs (0: not known)

    @classmethod
    def between(cls, before: HostCounters, after: HostCounters, wall_s: float,
                load_1m: float) -> HostLoad:
        wall = max(wall_s, 1e-9)
        own = max(0.0, after.own_s - before.own_s)
        total = after.total_s - before.total_s
        return cls(wall_s=wall_s,
                   others_cpus=max(0.0, after.busy_s - before.busy_s - own) / wall,
                   steal=(after.steal_s - before.steal_s) / total if total > 0 else 0.0,
                   load_1m=load_1m, own_cpus=own / wall, cpus=after.cpus)

    @property
    def quiet(self) -> bool:
        """Nothing else ran to speak of: a benchmark's figures are this machine's alone."""
        return self.others_cpus < BUSY_OTHERS_CPUS and self.steal < BUSY_STEAL

    @property
    def contended(self) -> bool:
        """Other work took CPU time this process wanted: the CPUs were full, others held a
        share of them, or the hypervisor stole time. Others on idle cores take nothing."""
        full = self.cpus <= 0 or self.others_cpus + self.own_cpus >= SATURATED * self.cpus
        return self.steal >= BUSY_STEAL or (self.others_cpus >= BUSY_OTHERS_CPUS and full)

    def mark(self) -> HostMark:
        return HostMark(contended=self.contended, others_cpus=self.others_cpus,
                        steal=self.steal, own_cpus=self.own_cpus, measured=True)

    def words(self) -> str:
        """The load in the words every view uses."""
        return (f"other processes used {self.others_cpus:.2f} CPUs, steal {self.steal:.0%}, "
                f"load average {self.load_1m:.2f}")

    def to_dict(self) -> dict[str, Any]:
        return {"others_cpus": round(self.others_cpus, 3), "steal": round(self.steal, 4),
                "load_1m": round(self.load_1m, 2), "own_cpus": round(self.own_cpus, 3),
                "quiet": self.quiet}


class HostLoadMeter:
    """Started before a run; `reading()` after it gives the host's load in between."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 read: Callable[[], HostCounters] = read_host) -> None:
        self._clock, self._read = clock, read
        self._start = (clock(), read())

    def reading(self) -> HostLoad:
        wall0, counters0 = self._start
        return HostLoad.between(counters0, self._read(), self._clock() - wall0,
                                os.getloadavg()[0])


class HostSensor:
    """The engine's host sense: re-read at most every `interval_s` on the engine's clock; each
    step is marked with the reading that covers its end."""

    def __init__(self, clock: Callable[[], float],
                 read: Callable[[], HostCounters] | None = None,
                 interval_s: float = SAMPLE_INTERVAL_S) -> None:
        if read is None:
            process = psutil.Process()
            read = lambda: read_host(process)  # noqa: E731 - one Process, its handle kept
        self._read = read
        self._clock = clock
        self.interval_s = interval_s
        self._last = (clock(), read())
        self.latest = HostMark()

    def mark(self, now: float) -> HostMark:
        then, before = self._last
        if now - then >= self.interval_s:
            after = self._read()
            self.latest = HostLoad.between(before, after, now - then, 0.0).mark()
            self._last = (now, after)
        return self.latest


class QuietHost:
    """A simulated device's host: the machine running the twin is not the one simulated."""

    latest = HostMark(measured=False)

    def mark(self, now: float) -> HostMark:
        return self.latest
