"""The host's load: what else used the machine during a bench run, and around each step;
on a GPU, the other processes NVML sees on it (NVML stood in for: this machine has none)."""

from __future__ import annotations

import os
from collections import namedtuple
from types import SimpleNamespace

import psutil
import pytest

from engine.ops.host import HostCounters, HostLoad, HostLoadMeter, HostSensor, NvmlProcesses

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


class FakeNvmlError(Exception):
    pass


class ScriptedGpu:
    """A stand-in for pynvml on this GPU-less machine: the compute processes and the
    utilisation samples NVML would give, each call's `last_seen` kept."""

    NVMLError = FakeNvmlError

    def __init__(self) -> None:
        self.running: list[SimpleNamespace] = []
        self.samples: list[SimpleNamespace] = []
        self.asked_since: list[int] = []
        self.reads = 0
        self.inits = self.shutdowns = 0

    def process(self, pid: int, gib: float | None) -> None:
        self.running.append(SimpleNamespace(pid=pid, usedGpuMemory=None if gib is None
                                            else int(gib * 2**30)))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[SimpleNamespace]:
        assert handle == "gpu0"
        self.reads += 1
        return list(self.running)

    def nvmlDeviceGetProcessUtilization(self, handle: str,
                                        last_seen: int) -> list[SimpleNamespace]:
        self.asked_since.append(last_seen)
        fresh = [s for s in self.samples if s.timeStamp > last_seen]
        if not fresh:
            raise FakeNvmlError("Not Found")  # NVML's answer when nothing is newer
        return fresh

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        assert uuid == "GPU-6f1c"
        return "gpu0"


def sample(pid: int, at_us: int, sm: int) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, timeStamp=at_us, smUtil=sm, memUtil=0, encUtil=0,
                           decUtil=0)


def quiet_cpus() -> HostCounters:
    return HostCounters(busy_s=0.0, total_s=0.0, steal_s=0.0, own_s=0.0, cpus=2)


def test_other_processes_on_the_gpu_are_named_with_their_share_and_mark_the_step() -> None:
    nvml = ScriptedGpu()
    nvml.process(100, 30.0)  # this engine
    nvml.process(4242, 2.0)
    nvml.samples = [sample(100, 1_000, 60), sample(4242, 1_000, 30), sample(4242, 2_000, 50)]
    now = [0.0]
    gpu = NvmlProcesses(nvml, "gpu0", own_pid=100, name=lambda pid: "python")
    sensor = HostSensor(lambda: now[0], read=quiet_cpus, interval_s=0.5, gpu=gpu)
    now[0] = 0.2
    assert not sensor.mark(now[0]).measured and nvml.reads == 0  # within the interval
    now[0] = 0.6
    mark = sensor.mark(now[0])
    assert mark.contended and mark.others_gpu == pytest.approx(0.4)  # its two samples' mean
    assert mark.others_cpus == 0.0  # the CPUs were quiet: the GPU alone marks it
    assert mark.gpu_others == "python[4242] 40% SM 2.0 GiB"
    # nothing new since NVML's last sample: the other process holds memory, takes no SM time
    now[0] = 600.0  # a gap far past the interval: one reading covers it
    mark = sensor.mark(now[0])
    assert nvml.asked_since == [0, 2_000]
    assert not mark.contended and mark.others_gpu == 0.0
    assert mark.gpu_others == "python[4242] 2.0 GiB"
    nvml.running = nvml.running[:1]
    nvml.samples.append(sample(100, 3_000, 90))
    now[0] = 601.0
    assert sensor.mark(now[0]).gpu_others == "no other processes"
    # a light neighbour (5% of the SM time) is named, and contends with nothing
    nvml.samples.append(sample(5151, 4_000, 5))
    now[0] = 602.0
    mark = sensor.mark(now[0])
    assert not mark.contended and mark.gpu_others == "python[5151] 5% SM"


def test_nvml_process_ids_of_another_pid_namespace_are_not_taken_for_others() -> None:
    """In a container NVML names the host's PIDs: this engine is not among them, so no
    process can be told from it, and the reading says so rather than mark contention."""
    nvml = ScriptedGpu()
    nvml.process(880001, 30.0)
    nvml.process(880002, 2.0)
    nvml.samples = [sample(880002, 1_000, 90)]
    load = NvmlProcesses(nvml, "gpu0", own_pid=100).read()
    assert not load.measured and not load.contended
    assert load.words() == ("GPU processes unknown: NVML's 2 process ids are not this PID "
                            "namespace's")


def test_an_nvml_error_leaves_the_gpu_unread_and_the_cpu_reading_standing() -> None:
    nvml = ScriptedGpu()

    def lost(handle: str) -> list[SimpleNamespace]:
        raise FakeNvmlError("GPU is lost")

    nvml.nvmlDeviceGetComputeRunningProcesses = lost  # type: ignore[method-assign]
    now = [0.0]
    sensor = HostSensor(lambda: now[0], read=quiet_cpus, interval_s=0.5,
                        gpu=NvmlProcesses(nvml, "gpu0", own_pid=100))
    now[0] = 1.0
    mark = sensor.mark(now[0])
    assert mark.measured and not mark.contended
    assert mark.gpu_others == "GPU processes unknown: NVML GPU is lost"


def test_an_engine_on_a_gpu_reads_its_neighbours_through_nvml_and_closes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real wiring on a CUDA device, NVML and the device's UUID stood in for."""
    import sys

    import torch

    from engine.ops import equipped

    nvml = ScriptedGpu()
    nvml.process(os.getpid(), 1.0)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(equipped, "nvml_available", lambda: True)
    monkeypatch.setattr(equipped, "cuda_uuid", lambda device: "GPU-6f1c")
    sensor = equipped.DefaultEquipment().host(lambda: 0.0, torch.device("cuda", 0),
                                              simulated=False)
    assert isinstance(sensor, HostSensor) and nvml.inits == 1
    sensor.mark(1.0)
    assert nvml.reads == 1 and sensor.latest.gpu_others == "no other processes"
    sensor.close()
    assert nvml.shutdowns == 1
    on_cpu = equipped.DefaultEquipment().host(lambda: 0.0, torch.device("cpu"),
                                              simulated=False)
    on_cpu.mark(1.0)
    assert nvml.inits == 1 and on_cpu.latest.gpu_others == ""  # /proc alone


def test_an_engine_of_a_real_model_senses_its_host_and_a_simulated_one_does_not() -> None:
    from engine import Engine, EngineConfig
    from engine.ops.host import QuietHost
    from engine.sim.executor import simulated_engine
    from engine.sim.target import resolve_target

    config = EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32")
    engine = Engine(config)
    try:
        assert isinstance(engine.host, HostSensor)
    finally:
        engine.close()
    twin = simulated_engine(config, resolve_target("h100", config), lambda: 0.0)
    assert isinstance(twin.host, QuietHost)
