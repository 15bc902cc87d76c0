"""How busy the host is: this process's CPU time against wall time, others' CPU, and steal
(from /proc); on a GPU, the other processes NVML sees computing on it and their share of its
SM time."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import psutil

from engine.batch import HostMark

# A reading is quiet below both: a quarter of a CPU of other work, 2% of CPU time stolen.
BUSY_OTHERS_CPUS = 0.25
BUSY_STEAL = 0.02
# Contended: others took at least that quarter CPU while the CPUs were this full (others'
# work and ours), so theirs was taken from ours; or the hypervisor stole that much.
SATURATED = 0.9
# Others' share of the GPU's SM time from which a step counts as contended: the GPU
# time-slices between processes, so their kernels delay ours.
BUSY_GPU = 0.1
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


class GpuProcess(NamedTuple):
    """Another process on the GPU, as NVML reports it."""

    pid: int
    name: str
    sm: float | None  # its share of SM time since the last reading (None: NVML has none)
    memory_bytes: int | None  # GPU memory it holds (None: NVML does not say)

    def words(self) -> str:
        parts = [f"{self.name}[{self.pid}]"]
        if self.sm is not None:
            parts.append(f"{self.sm:.0%} SM")
        if self.memory_bytes is not None:
            parts.append(f"{self.memory_bytes / 2**30:.1f} GiB")
        return " ".join(parts)


class GpuLoad(NamedTuple):
    """Other processes on the GPU: their summed share of its SM time, and who they are.
    `measured` False with a `note` where NVML cannot tell them from this process."""

    others_gpu: float = 0.0
    others: tuple[GpuProcess, ...] = ()
    measured: bool = True
    note: str = ""

    @property
    def contended(self) -> bool:
        return self.measured and self.others_gpu >= BUSY_GPU

    def words(self) -> str:
        """Who else computes on the GPU, or why that is unknown."""
        if not self.measured:
            return self.note
        return ", ".join(p.words() for p in self.others) or "no other processes"


def process_name(pid: int) -> str:
    """A process's name as this machine's /proc gives it, or why it cannot."""
    try:
        return psutil.Process(pid).name()
    except psutil.NoSuchProcess:
        return "not in this PID namespace"
    except psutil.AccessDenied:
        return "another user's"


class NvmlProcesses:
    """Other processes computing on one GPU, from NVML: the compute processes
    (nvmlDeviceGetComputeRunningProcesses) and each one's SM share since the last reading
    (nvmlDeviceGetProcessUtilization). `nvml` is pynvml, already initialised; `handle` the
    device's."""

    def __init__(self, nvml: ModuleType, handle: object, own_pid: int | None = None,
                 name: Callable[[int], str] = process_name) -> None:
        self.nvml = nvml
        self.handle = handle
        self.own_pid = os.getpid() if own_pid is None else own_pid
        self.name = name
        self._seen_us = 0  # NVML's timestamp of the last utilisation sample read
        self._opened = False

    @classmethod
    def open(cls, uuid: str, nvml: ModuleType | None = None) -> NvmlProcesses:
        """On the GPU NVML names `uuid`, with NVML initialised until close()."""
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
        try:
            sense = cls(nvml, nvml.nvmlDeviceGetHandleByUUID(uuid))
        except nvml.NVMLError:
            nvml.nvmlShutdown()
            raise
        sense._opened = True
        return sense

    def close(self) -> None:
        if self._opened:
            self._opened = False
            self.nvml.nvmlShutdown()

    def read(self) -> GpuLoad:
        nvml = self.nvml
        try:
            running = nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except nvml.NVMLError as exc:
            return GpuLoad(measured=False, note=f"GPU processes unknown: NVML {exc}")
        pids = {p.pid for p in running}
        if running and self.own_pid not in pids:
            # NVML names processes by the host's PIDs: inside a container ours is not among
            # them, so theirs cannot be told from ours
            return GpuLoad(measured=False, note=(
                f"GPU processes unknown: NVML's {len(pids)} process ids are not this "
                "PID namespace's"))
        sm = self._sm_shares()
        memory = {p.pid: p.usedGpuMemory for p in running}
        others = tuple(GpuProcess(pid, self.name(pid), sm.get(pid), memory.get(pid))
                       for pid in sorted(pids | set(sm)) if pid != self.own_pid)
        return GpuLoad(others_gpu=sum(p.sm or 0.0 for p in others), others=others)

    def _sm_shares(self) -> dict[int, float]:
        """Each process's mean SM share over the samples NVML took since the last read."""
        nvml = self.nvml
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(self.handle, self._seen_us)
        except nvml.NVMLError:  # none since the last read (NotFound), or not supported
            return {}
        shares: dict[int, list[float]] = {}
        for sample in samples:
            shares.setdefault(sample.pid, []).append(sample.smUtil / 100.0)
            self._seen_us = max(self._seen_us, sample.timeStamp)
        return {pid: sum(v) / len(v) for pid, v in shares.items()}


class HostSensor:
    """The engine's host sense: re-read at most every `interval_s` on the engine's clock; each
    step is marked with the reading that covers its end. `gpu`, on a GPU, reads the other
    processes on it."""

    def __init__(self, clock: Callable[[], float],
                 read: Callable[[], HostCounters] | None = None,
                 interval_s: float = SAMPLE_INTERVAL_S,
                 gpu: NvmlProcesses | None = None) -> None:
        if read is None:
            process = psutil.Process()
            read = lambda: read_host(process)  # noqa: E731 - one Process, its handle kept
        self._read = read
        self._gpu = gpu
        self._clock = clock
        self.interval_s = interval_s
        self._last = (clock(), read())
        self.latest = HostMark()

    def mark(self, now: float) -> HostMark:
        then, before = self._last
        if now - then >= self.interval_s:
            after = self._read()
            mark = HostLoad.between(before, after, now - then, 0.0).mark()
            if self._gpu is not None:
                gpu = self._gpu.read()
                mark = mark._replace(contended=mark.contended or gpu.contended,
                                     others_gpu=gpu.others_gpu, gpu_others=gpu.words())
            self.latest = mark
            self._last = (now, after)
        return self.latest

    def close(self) -> None:
        if self._gpu is not None:
            self._gpu.close()


class QuietHost:
    """A simulated device's host: the machine running the twin is not the one simulated."""

    latest = HostMark(measured=False)

    def mark(self, now: float) -> HostMark:
        return self.latest

    def close(self) -> None:
        """Nothing to release."""
