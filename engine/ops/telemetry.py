"""Memory bandwidth utilisation over a 5-second window, behind the BANDWIDTH_THROTTLE mode.

Measured only from GPM's DRAM bandwidth utilisation (Hopper and newer); NVML's "memory
utilization" is the share of time the memory was busy, not a share of bandwidth, and is kept
as a figure beside it. Without GPM the share is the engine's achieved bytes over the
profile's peak, labelled as that estimate."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

from engine.core.equipment import BandwidthReading, BandwidthSource
from engine.errors import EngineError

MAX_UTILIZATION = 1.5


class TelemetryError(EngineError):
    """A bandwidth source cannot be built or started."""


class _Step(NamedTuple):
    end: float
    bytes_moved: float
    duration_s: float


class ModelBandwidth:
    """Utilisation from the engine's own byte estimates: record() once per step."""

    def __init__(self, peak_bytes_per_s: float, window_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not peak_bytes_per_s > 0:
            raise TelemetryError(f"peak_bytes_per_s must be > 0, got {peak_bytes_per_s}")
        if not window_s > 0:
            raise TelemetryError(f"window_s must be > 0, got {window_s}")
        self.peak_bytes_per_s = peak_bytes_per_s
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._steps: deque[_Step] = deque()
        self._moved = 0.0
        self._busy = 0.0
        self._lock = threading.Lock()

    def record(self, bytes_moved: float, duration_s: float) -> None:
        """A step that just ended moved `bytes_moved` in `duration_s` seconds."""
        if bytes_moved < 0 or duration_s < 0:
            raise TelemetryError(
                f"record() needs bytes_moved >= 0 and duration_s >= 0, got {bytes_moved}, "
                f"{duration_s}"
            )
        with self._lock:
            self._steps.append(_Step(self._clock(), bytes_moved, duration_s))
            self._moved += bytes_moved
            self._busy += duration_s

    def reading(self) -> BandwidthReading:
        now = self._clock()
        window_start = now - self.window_s
        with self._lock:
            while self._steps and self._steps[0].end <= window_start:
                old = self._steps.popleft()
                self._moved -= old.bytes_moved
                self._busy -= old.duration_s
            if not self._steps:
                self._moved = self._busy = 0.0
            moved, busy = self._moved, self._busy
            if self._steps:
                first = self._steps[0]
                outside = first.duration_s - min(first.duration_s, first.end - window_start)
                if outside > 0:
                    moved -= first.bytes_moved * outside / first.duration_s
                    busy -= outside
        covered = max(min(self.window_s, now - self._started), busy)
        if covered <= 0:
            return BandwidthReading(0.0, "model")
        util = moved / covered / self.peak_bytes_per_s
        return BandwidthReading(min(max(util, 0.0), MAX_UTILIZATION), "model")

    def close(self) -> None:
        """Nothing runs beside it."""


@dataclass(frozen=True)
class NvmlSample:
    ts: float
    memory_busy: float
    used_bytes: int
    total_bytes: int
    memory_clock_mhz: int
    sm_clock_mhz: int
    torch_allocated_bytes: int | None
    torch_reserved_bytes: int | None
    dram_active: float | None = None


def _import_pynvml() -> ModuleType:
    import pynvml

    return pynvml


def nvml_available(nvml: ModuleType | None = None) -> bool:
    """True when NVML loads and sees at least one GPU."""
    try:
        nvml = nvml or _import_pynvml()
    except ImportError:
        return False
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return False
    try:
        return nvml.nvmlDeviceGetCount() > 0
    except nvml.NVMLError:
        return False
    finally:
        nvml.nvmlShutdown()


class DramActive:
    """DCGM's DRAM-active counter read through NVML's GPM interface, with no DCGM daemon."""

    def __init__(self, nvml: ModuleType, handle: object) -> None:
        self.nvml = nvml
        self._previous: object | None = None
        try:
            self.supported = bool(nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except (AttributeError, nvml.NVMLError):
            self.supported = False

    def read(self, handle: object) -> float | None:
        """DRAM-active since the last read (0..1); None on the first read or without GPM."""
        if not self.supported:
            return None
        nvml = self.nvml
        try:
            current = nvml.nvmlGpmSampleAlloc()
        except nvml.NVMLError:
            return None
        try:
            nvml.nvmlGpmSampleGet(handle, current)
        except nvml.NVMLError:
            nvml.nvmlGpmSampleFree(current)
            return None
        previous, self._previous = self._previous, current
        if previous is None:
            return None
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1, request.sample2 = previous, current
        request.metrics[0].metricId = nvml.NVML_GPM_METRIC_DRAM_BW_UTIL
        try:
            nvml.nvmlGpmMetricsGet(request)
        except nvml.NVMLError:
            return None
        finally:
            nvml.nvmlGpmSampleFree(previous)
        metric = request.metrics[0]
        return None if metric.nvmlReturn != 0 else metric.value / 100.0

    def close(self) -> None:
        if self._previous is not None:
            self.nvml.nvmlGpmSampleFree(self._previous)
            self._previous = None


def visible_gpu_handle(nvml: ModuleType, environ: Mapping[str, str] = os.environ) -> object:
    """NVML's handle of the first GPU CUDA_VISIBLE_DEVICES leaves CUDA (NVML ignores the
    variable): by UUID or a UUID's prefix where it names one, by index where it numbers one,
    else GPU 0. For when no CUDA device of ours can say its UUID (an attached server)."""
    first = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            if (uuid.decode() if isinstance(uuid, bytes) else str(uuid)).startswith(first):
                return handle
        return nvml.nvmlDeviceGetHandleByUUID(first)  # NVML's own error names what failed
    return nvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0)


def cuda_uuid(device: str) -> str:
    """NVML's name for a torch CUDA device: its UUID, which CUDA_VISIBLE_DEVICES cannot renumber
    (the CUDA ordinal is an index into the visible devices, NVML's into all of them)."""
    import torch

    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


class NvmlBandwidth:
    """Samples NVML on a daemon thread: GPM's DRAM bandwidth utilisation over the window is
    the measured reading; without it, `estimate` (the engine's bytes over the peak)."""

    def __init__(self, device_index: int = 0, interval_s: float = 0.2, window_s: float = 5.0,
                 *, nvml: ModuleType | None = None, torch_device: str | None = None,
                 uuid: str | None = None, estimate: ModelBandwidth | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0 or not window_s > 0:
            raise TelemetryError(f"interval_s and window_s must be > 0, got {interval_s}, "
                                 f"{window_s}")
        self.device_index = device_index
        self.uuid = uuid
        self.estimate = estimate
        self.interval_s = interval_s
        self.window_s = window_s
        self.torch_device = torch_device
        self.last_error: str | None = None
        self._nvml = nvml
        self._clock = clock
        self._handle: object | None = None
        self._dram: DramActive | None = None
        self._samples: deque[NvmlSample] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        if self._nvml is None:
            try:
                self._nvml = _import_pynvml()
            except ImportError:
                raise TelemetryError("pynvml is not installed; install nvidia-ml-py or use "
                                     "the model-estimated bandwidth") from None
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise TelemetryError(f"NVML cannot start ({exc}); use the model-estimated "
                                 "bandwidth on machines without NVIDIA GPUs") from None
        # a GPU NVML cannot name (a MIG instance, a lost card) reads unknown, with the reason,
        # and is looked up again each sample: the engine starts either way
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nvml-bandwidth", daemon=True)
        self._thread.start()

    def _get_handle(self) -> object:
        if self.uuid is None:
            return self._nvml.nvmlDeviceGetHandleByIndex(self.device_index)
        return self._nvml.nvmlDeviceGetHandleByUUID(self.uuid)

    def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._dram is not None:
            self._dram.close()
            self._dram = None
        self._nvml.nvmlShutdown()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def sample(self) -> NvmlSample | None:
        """Take one sample now (the thread calls this; tests may too)."""
        nvml = self._nvml
        try:
            if self._handle is None:
                self._handle = self._get_handle()
                if self._dram is None:
                    self._dram = DramActive(nvml, self._handle)
            rates = nvml.nvmlDeviceGetUtilizationRates(self._handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(self._handle)
            mem_clock = nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_MEM)
            sm_clock = nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM)
        except nvml.NVMLError as exc:
            self.last_error = str(exc)
            self._handle = None
            if self._dram is not None:  # its open interval belongs to the handle just lost
                self._dram.close()
                self._dram = None
            return None
        allocated, reserved = self._torch_memory()
        dram = self._dram.read(self._handle) if self._dram is not None else None
        sample = NvmlSample(self._clock(), rates.memory / 100.0, int(memory.used),
                            int(memory.total), int(mem_clock), int(sm_clock), allocated, reserved,
                            dram)
        with self._lock:
            self._samples.append(sample)
            while self._samples[0].ts <= sample.ts - self.window_s:
                self._samples.popleft()
        self.last_error = None
        return sample

    def _torch_memory(self) -> tuple[int | None, int | None]:
        if self.torch_device is None:
            return None, None
        import torch

        return (torch.cuda.memory_allocated(self.torch_device),
                torch.cuda.memory_reserved(self.torch_device))

    def latest(self) -> NvmlSample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def reading(self) -> BandwidthReading:
        cutoff = self._clock() - self.window_s
        with self._lock:
            recent = [s for s in self._samples if s.ts > cutoff]
        dram = [s.dram_active for s in recent if s.dram_active is not None]
        if dram:
            return BandwidthReading(sum(dram) / len(dram), "nvml-gpm", measured=True)
        estimate = (self.estimate.reading() if self.estimate is not None
                    else BandwidthReading(0.0, "model"))
        if not recent:  # every sample failed (NotSupported, MIG, a lost GPU) or none yet
            why = self.last_error or "no NVML sample yet"
            return estimate._replace(note=f"bandwidth unknown: NVML {why}")
        return estimate  # no GPM (before Hopper): the engine's bytes over the peak

    def record(self, bytes_moved: float, duration_s: float) -> None:
        """The engine's bytes feed the estimate shown where GPM cannot measure."""
        if self.estimate is not None:
            self.estimate.record(bytes_moved, duration_s)


class InjectedBandwidth:
    """Wraps a source; inject() overrides its reading until a deadline on the same clock."""

    def __init__(self, inner: BandwidthSource,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self._clock = clock
        self._override: tuple[float, float] | None = None
        self._lock = threading.Lock()

    def inject(self, util: float, until_s: float) -> None:
        """Report `util` until the clock reaches `until_s` (an absolute time on `clock`)."""
        if not 0 <= util <= MAX_UTILIZATION:
            raise TelemetryError(f"injected utilisation must be in [0, {MAX_UTILIZATION}], "
                                 f"got {util}")
        with self._lock:
            self._override = (util, until_s)

    def clear(self) -> None:
        with self._lock:
            self._override = None

    def reading(self) -> BandwidthReading:
        with self._lock:
            override = self._override
            if override is not None and self._clock() >= override[1]:
                self._override = override = None
        if override is not None:
            return BandwidthReading(override[0], "injected", measured=True)
        return self.inner.reading()

    def record(self, bytes_moved: float, duration_s: float) -> None:
        self.inner.record(bytes_moved, duration_s)

    def close(self) -> None:
        self.inner.close()
