"""The engine as users get it: the step loop with guards, metrics, telemetry, slow-query watch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.clock import Clock
from engine.config import EngineConfig
from engine.core import engine_core as core
from engine.core.equipment import BandwidthSource, HostSense
from engine.core.executor import Executor
from engine.events import Event
from engine.ops.guards import Guards
from engine.ops.host import HostSensor, NvmlProcesses, QuietHost
from engine.ops.metrics import Metrics
from engine.ops.slow_query_watch import SlowQueryWatch
from engine.ops.telemetry import ModelBandwidth, NvmlBandwidth, cuda_uuid, nvml_available

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class DefaultEquipment:
    """`bandwidth` and `host`, when given, replace the device's own sources (tests, chaos)."""

    def __init__(self, bandwidth: BandwidthSource | None = None,
                 host: HostSense | None = None) -> None:
        self._bandwidth = bandwidth
        self._host = host

    def bandwidth(self, device: torch.device, peak_bytes_per_s: float,
                  clock: Clock) -> BandwidthSource:
        """NVML's 5 s average on a GPU it can see (GPM's, else the estimate), else the model
        estimate."""
        if self._bandwidth is not None:
            return self._bandwidth
        estimate = ModelBandwidth(peak_bytes_per_s, clock=clock)
        if device.type == "cuda" and nvml_available():
            source = NvmlBandwidth(torch_device=str(device), uuid=cuda_uuid(str(device)),
                                   estimate=estimate)
            source.start()
            return source
        return estimate

    def guards(self, device: torch.device) -> Guards:
        return Guards(device)

    def metrics(self, config: EngineConfig) -> Metrics:
        return Metrics(config.stats_window_s)

    def prefill_watch(self, publish: Callable[[Event], None]) -> SlowQueryWatch:
        return SlowQueryWatch(publish)

    def host(self, clock: Clock, device: torch.device, simulated: bool) -> HostSense:
        """/proc's readings; on a GPU NVML sees, also the other processes computing on it."""
        if self._host is not None:
            return self._host
        if simulated:
            return QuietHost()
        gpu = None
        if device.type == "cuda" and nvml_available():
            import pynvml

            try:
                gpu = NvmlProcesses.open(cuda_uuid(str(device)))
            except pynvml.NVMLError as exc:  # a GPU NVML cannot name (a MIG instance)
                log.warning("other processes on the GPU unknown: NVML cannot open %s (%s)",
                            device, exc)
        return HostSensor(clock, gpu=gpu)


class Engine(core.EngineCore):
    def __init__(self, config: EngineConfig | None = None, *,
                 bandwidth: BandwidthSource | None = None, host: HostSense | None = None,
                 clock: Clock = time.monotonic, runner: Executor | None = None) -> None:
        """A simulated `runner` brings its device's peaks; `clock` is then the simulation's."""
        super().__init__(config, DefaultEquipment(bandwidth, host), clock=clock, runner=runner)
