"""How busy the host was during a benchmark: other processes' CPU time and hypervisor steal."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import psutil

# A run is quiet below both: a quarter of a CPU of other work, 2% of CPU time stolen.
BUSY_OTHERS_CPUS = 0.25
BUSY_STEAL = 0.02

# /proc/stat counts guest time inside user and nice; steal and idle are not work done here
_NOT_BUSY = ("idle", "iowait", "steal", "guest", "guest_nice")


@dataclass(frozen=True)
class HostLoad:
    wall_s: float
    others_cpus: float
    steal: float
    load_1m: float

    @property
    def quiet(self) -> bool:
        return self.others_cpus < BUSY_OTHERS_CPUS and self.steal < BUSY_STEAL

    def to_dict(self) -> dict[str, Any]:
        return {"others_cpus": round(self.others_cpus, 3), "steal": round(self.steal, 4),
                "load_1m": round(self.load_1m, 2), "quiet": self.quiet}


class HostLoadMeter:
    """Started before a run; `reading()` after it gives the host's load in between."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._start = (time.monotonic(), psutil.cpu_times(), self._own_cpu_s())

    def reading(self) -> HostLoad:
        wall0, cpu0, own0 = self._start
        wall, cpu, own = time.monotonic() - wall0, psutil.cpu_times(), self._own_cpu_s()
        delta = {name: getattr(cpu, name) - getattr(cpu0, name) for name in cpu._fields}
        busy = sum(v for name, v in delta.items() if name not in _NOT_BUSY)
        total = sum(v for name, v in delta.items() if name not in ("guest", "guest_nice"))
        return HostLoad(wall_s=wall,
                        others_cpus=max(0.0, busy - (own - own0)) / max(wall, 1e-9),
                        steal=delta.get("steal", 0.0) / total if total > 0 else 0.0,
                        load_1m=os.getloadavg()[0])

    def _own_cpu_s(self) -> float:
        times = self._process.cpu_times()
        return times.user + times.system
