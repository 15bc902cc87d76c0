import threading
from types import SimpleNamespace

import pytest

from engine import Engine, EngineConfig
from engine.ops.telemetry import (
    MAX_UTILIZATION,
    BandwidthReading,
    BandwidthSource,
    DramActive,
    InjectedBandwidth,
    ModelBandwidth,
    NvmlBandwidth,
    TelemetryError,
    cuda_uuid,
    nvml_available,
    visible_gpu_handle,
)

GB = 1e9


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_model_bandwidth_busy_window():
    clock = FakeClock()
    source = ModelBandwidth(peak_bytes_per_s=10 * GB, window_s=5.0, clock=clock)
    assert source.reading() == BandwidthReading(0.0, "model")
    for _ in range(10):  # 10 back-to-back 0.5 s steps at 8 GB/s
        clock.t += 0.5
        source.record(4 * GB, 0.5)
    assert source.reading().util_5s == pytest.approx(0.8)


def test_model_bandwidth_idle_time_lowers_utilisation():
    clock = FakeClock()
    source = ModelBandwidth(peak_bytes_per_s=10 * GB, window_s=5.0, clock=clock)
    clock.t += 10.0
    source.record(5 * GB, 1.0)  # one busy second at 5 GB/s
    assert source.reading().util_5s == pytest.approx(0.1)  # 5 GB over the 5 s window
    clock.t += 3.0
    assert source.reading().util_5s == pytest.approx(0.1)
    clock.t += 1.5  # the step ended 4.5 s ago: half of it is still inside the window
    assert source.reading().util_5s == pytest.approx(0.05)
    clock.t += 1.0
    assert source.reading().util_5s == 0.0


def test_model_bandwidth_before_a_full_window_uses_elapsed_time():
    clock = FakeClock()
    source = ModelBandwidth(peak_bytes_per_s=10 * GB, clock=clock)
    clock.t += 1.0
    source.record(3 * GB, 0.5)
    assert source.reading().util_5s == pytest.approx(0.3)  # 3 GB over 1 s of existence
    # A step reported longer than the source has existed divides by its own duration.
    late = ModelBandwidth(peak_bytes_per_s=10 * GB, clock=clock)
    late.record(4 * GB, 2.0)
    assert late.reading().util_5s == pytest.approx(0.2)


def test_model_bandwidth_clips_and_rejects_bad_input():
    clock = FakeClock()
    source = ModelBandwidth(peak_bytes_per_s=1 * GB, clock=clock)
    clock.t += 1.0
    source.record(100 * GB, 1.0)
    assert source.reading().util_5s == MAX_UTILIZATION
    with pytest.raises(TelemetryError, match="bytes_moved >= 0"):
        source.record(-1, 1.0)
    with pytest.raises(TelemetryError, match="peak_bytes_per_s"):
        ModelBandwidth(peak_bytes_per_s=0)


class FakeNvmlError(Exception):
    pass


def fake_pynvml(memory_percents: list[int], *, library: bool = True, devices: int = 1):
    """A stand-in for pynvml on this GPU-less machine: same names, scripted readings."""
    state = {"calls": 0, "init": 0, "shutdown": 0, "fail_next": False}

    def init():
        if not library:
            raise FakeNvmlError("NVML Shared Library Not Found")
        state["init"] += 1

    def shutdown():
        state["shutdown"] += 1

    def utilization(handle):
        if state["fail_next"]:
            state["fail_next"] = False
            raise FakeNvmlError("GPU is lost")
        percent = memory_percents[min(state["calls"], len(memory_percents) - 1)]
        state["calls"] += 1
        return SimpleNamespace(gpu=50, memory=percent)

    return SimpleNamespace(
        NVMLError=FakeNvmlError, NVML_CLOCK_SM=0, NVML_CLOCK_MEM=2, state=state,
        nvmlInit=init, nvmlShutdown=shutdown, nvmlDeviceGetCount=lambda: devices,
        nvmlDeviceGetHandleByIndex=lambda index: f"gpu{index}",
        nvmlDeviceGetUtilizationRates=utilization,
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(used=30 * GB, total=141 * GB,
                                                               free=111 * GB),
        nvmlDeviceGetClockInfo=lambda handle, kind: 2619 if kind == 2 else 1980,
    )


def test_nvml_on_this_machine_samples_or_names_the_fallback():
    """The real NVML path, on whatever machine runs it: with an NVIDIA GPU it samples the
    memory controller; without one, start() says to use the model-estimated bandwidth."""
    source = NvmlBandwidth(interval_s=60.0)
    if not nvml_available():
        with pytest.raises(TelemetryError, match="model-estimated bandwidth"):
            source.start()
        return
    source.start()
    source.stop()  # the thread samples before its first wait, so one sample is certain
    latest = source.latest()
    assert latest is not None and latest.total_bytes > 0
    assert source.reading().source in ("nvml-gpm", "model")
    assert 0.0 <= source.reading().util_5s <= 1.0


def test_nvml_without_its_library_names_the_fallback():
    with pytest.raises(TelemetryError, match="model-estimated bandwidth"):
        NvmlBandwidth(nvml=fake_pynvml([0], library=False)).start()


def test_nvml_available_with_fake_module():
    assert nvml_available(fake_pynvml([0])) is True
    assert nvml_available(fake_pynvml([0], devices=0)) is False
    assert nvml_available(fake_pynvml([0], library=False)) is False


def test_nvml_samples_keep_the_busy_share_and_clocks_as_figures():
    clock = FakeClock()
    nvml = fake_pynvml([90, 90, 90, 30, 30, 30, 30, 30])
    source = NvmlBandwidth(interval_s=1.0, window_s=5.0, nvml=nvml, clock=clock)
    for _ in range(8):
        source.sample()
        clock.t += 1.0
    latest = source.latest()
    assert latest is not None and latest.memory_busy == pytest.approx(0.3)
    assert (latest.used_bytes, latest.total_bytes) == (30 * GB, 141 * GB)
    assert (latest.memory_clock_mhz, latest.sm_clock_mhz) == (2619, 1980)
    assert latest.torch_allocated_bytes is None
    # the busy share is time, not bandwidth: without GPM nothing is measured
    assert source.reading() == BandwidthReading(0.0, "model")


def test_the_measured_reading_is_gpm_dram_bandwidth_over_the_window():
    clock = FakeClock()
    nvml = fake_gpm(fake_pynvml([99] * 9), [90, 90, 90, 30, 30, 30, 30, 30])
    source = NvmlBandwidth(interval_s=1.0, window_s=5.0, nvml=nvml, clock=clock)
    source._dram = DramActive(nvml, "gpu0")  # what start() sets up, without its thread
    for _ in range(4):  # the first read opens GPM's first interval
        source.sample()
        clock.t += 1.0
    assert source.reading() == BandwidthReading(pytest.approx(0.9), "nvml-gpm", True)
    for _ in range(5):
        source.sample()
        clock.t += 1.0
    clock.t -= 1.0  # the window holds the last five samples: 30 % each
    assert source.reading() == BandwidthReading(pytest.approx(0.3), "nvml-gpm", True)


def test_without_gpm_the_reading_is_the_engines_bytes_over_the_peak():
    clock = FakeClock()
    nvml = fake_gpm(fake_pynvml([95] * 3), [50.0], supported=False)
    estimate = ModelBandwidth(peak_bytes_per_s=10 * GB, clock=clock)
    source = NvmlBandwidth(interval_s=1.0, nvml=nvml, clock=clock, estimate=estimate)
    source._dram = DramActive(nvml, "gpu0")
    clock.t += 1.0
    source.record(4 * GB, 1.0)
    source.sample()
    assert source.reading() == BandwidthReading(pytest.approx(0.4), "model", False)


def test_not_supported_everywhere_reads_unknown_with_the_reason():
    clock = FakeClock()
    nvml = fake_pynvml([50])

    def not_supported(handle):
        raise FakeNvmlError("Not Supported")

    nvml.nvmlDeviceGetUtilizationRates = not_supported
    source = NvmlBandwidth(nvml=nvml, clock=clock)
    for _ in range(3):
        assert source.sample() is None
    reading = source.reading()
    assert not reading.measured and reading.util_5s == 0.0
    assert reading.note == "bandwidth unknown: NVML Not Supported"


def test_the_gpu_is_found_by_uuid_not_by_the_cuda_ordinal(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=3 torch's cuda:0 is NVML's GPU 3: the UUID names it."""
    import torch

    nvml = fake_pynvml([40])
    asked = []
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: asked.append(uuid) or "gpu3"
    nvml.nvmlDeviceGetHandleByIndex = lambda index: pytest.fail("looked up by index")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(uuid="6f1c-b3"))
    source = NvmlBandwidth(interval_s=60.0, nvml=nvml, uuid=cuda_uuid("cuda:0"))
    source.start()
    source.stop()
    assert asked == ["GPU-6f1c-b3"]


def test_closing_an_engine_stops_its_sampler_thread():
    nvml = fake_pynvml([40])
    source = NvmlBandwidth(interval_s=60.0, nvml=nvml)
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 kv_cache_bytes=1 << 20), bandwidth=source)
    source.start()
    assert any(t.name == "nvml-bandwidth" for t in threading.enumerate())
    engine.close()
    assert not any(t.name == "nvml-bandwidth" for t in threading.enumerate())
    assert nvml.state["shutdown"] == 1


def test_nvml_error_is_kept_and_handle_refetched():
    nvml = fake_pynvml([50])
    source = NvmlBandwidth(nvml=nvml, clock=FakeClock())
    nvml.state["fail_next"] = True
    assert source.sample() is None
    assert source.last_error == "GPU is lost"
    assert source.sample() is not None and source.last_error is None


def test_nvml_torch_allocator_figures(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 7)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 9)
    source = NvmlBandwidth(nvml=fake_pynvml([50]), torch_device="cuda:0", clock=FakeClock())
    sample = source.sample()
    assert sample is not None
    assert (sample.torch_allocated_bytes, sample.torch_reserved_bytes) == (7, 9)


def test_nvml_thread_start_stop():
    nvml = fake_pynvml([40])
    source = NvmlBandwidth(interval_s=60.0, nvml=nvml)
    source.start()
    source.stop()  # the thread samples before its first wait, so one sample is certain
    assert nvml.state["init"] == 1 and nvml.state["shutdown"] == 1
    assert source.latest() is not None
    assert source.reading() == BandwidthReading(0.0, "model")  # no GPM here


def test_injected_override_expires():
    clock = FakeClock()
    inner = ModelBandwidth(peak_bytes_per_s=10 * GB, clock=clock)
    source = InjectedBandwidth(inner, clock=clock)
    as_protocol: BandwidthSource = source  # the scheduler sees only the protocol
    clock.t += 1.0
    as_protocol.record(2 * GB, 1.0)  # forwarded to the wrapped source
    assert as_protocol.reading() == BandwidthReading(pytest.approx(0.2), "model")
    source.inject(0.99, until_s=clock.t + 12.0)
    assert source.reading() == BandwidthReading(0.99, "injected", measured=True)
    clock.t += 11.9
    assert source.reading().source == "injected"
    clock.t += 0.1
    assert source.reading().source == "model"
    source.inject(0.95, until_s=clock.t + 5)
    source.clear()
    assert source.reading().source == "model"
    with pytest.raises(TelemetryError, match="injected utilisation"):
        source.inject(2.0, until_s=clock.t + 1)


def fake_gpm(nvml: SimpleNamespace, dram_percents: list[float], *, supported: bool = True):
    """GPM on top of fake_pynvml: dram_percents[k] is DRAM-active over the k-th interval."""
    live: set[int] = set()
    serial = iter(range(1_000_000))

    class Metric(SimpleNamespace):
        pass

    def alloc():
        sample = next(serial)
        live.add(sample)
        return sample

    def metrics_get(request):
        assert request.numMetrics == 1 and request.sample2 > request.sample1
        assert request.metrics[0].metricId == nvml.NVML_GPM_METRIC_DRAM_BW_UTIL
        request.metrics[0].value = dram_percents[min(request.sample2 - 1, len(dram_percents) - 1)]
        request.metrics[0].nvmlReturn = 0
        return request

    nvml.NVML_GPM_METRIC_DRAM_BW_UTIL = 2
    nvml.NVML_GPM_METRICS_GET_VERSION = 1
    nvml.nvmlGpmQueryDeviceSupport = lambda handle: SimpleNamespace(isSupportedDevice=supported)
    nvml.nvmlGpmSampleAlloc = alloc
    nvml.nvmlGpmSampleGet = lambda handle, sample: sample
    nvml.nvmlGpmSampleFree = live.discard
    nvml.nvmlGpmMetricsGet = metrics_get
    nvml.c_nvmlGpmMetricsGet_t = lambda: SimpleNamespace(metrics=[Metric()])
    nvml.live_samples = live
    return nvml


def test_dram_active_from_gpm_between_two_samples():
    nvml = fake_gpm(fake_pynvml([40]), [55.0, 72.5, 10.0])
    dram = DramActive(nvml, "gpu0")
    readings = [dram.read("gpu0") for _ in range(3)]
    assert readings == [None, pytest.approx(0.55), pytest.approx(0.725)]
    assert len(nvml.live_samples) == 1  # only the interval's open end is held
    dram.close()
    assert not nvml.live_samples


def test_nvml_samples_carry_dram_active_beside_the_busy_share():
    clock = FakeClock()
    nvml = fake_gpm(fake_pynvml([40] * 3), [66.0])
    source = NvmlBandwidth(interval_s=1.0, nvml=nvml, clock=clock)
    source._dram = DramActive(nvml, "gpu0")  # what start() sets up, without its thread
    first, second = source.sample(), source.sample()
    assert first is not None and second is not None
    assert (first.dram_active, second.dram_active) == (None, pytest.approx(0.66))
    assert second.memory_busy == pytest.approx(0.4)


def test_no_gpm_means_no_dram_active_and_nothing_else_changes():
    nvml = fake_gpm(fake_pynvml([40]), [50.0], supported=False)
    dram = DramActive(nvml, "gpu0")
    assert not dram.supported and dram.read("gpu0") is None
    old_library = fake_pynvml([40])  # a pynvml without the GPM functions at all
    assert not DramActive(old_library, "gpu0").supported


def test_a_gpu_nvml_cannot_name_reads_unknown_and_the_start_goes_on():
    """A MIG instance or a lost card: its UUID names no NVML device. start() does not raise
    (the engine starts), the reading says why, and a later sample that finds it measures."""
    clock = FakeClock()
    nvml = fake_gpm(fake_pynvml([40] * 4), [70.0])
    found = {"now": False}

    def by_uuid(uuid):
        if not found["now"]:
            raise FakeNvmlError("Not Found")
        return "gpu0"

    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    source = NvmlBandwidth(interval_s=60.0, nvml=nvml, uuid="GPU-0c", clock=clock)
    source.start()
    source.stop()
    assert source.reading().note == "bandwidth unknown: NVML Not Found"
    found["now"] = True
    source.sample()
    source.sample()
    assert source.reading() == BandwidthReading(pytest.approx(0.7), "nvml-gpm", True)


def test_a_failed_gpm_read_frees_its_sample():
    nvml = fake_gpm(fake_pynvml([40]), [50.0])

    def lost(handle, sample):
        raise FakeNvmlError("GPU is lost")

    nvml.nvmlGpmSampleGet = lost
    dram = DramActive(nvml, "gpu0")
    assert dram.read("gpu0") is None and dram.read("gpu0") is None
    assert not nvml.live_samples


def test_a_lost_handle_starts_gpm_afresh_on_the_next():
    nvml = fake_gpm(fake_pynvml([40] * 5), [60.0])
    source = NvmlBandwidth(nvml=nvml, clock=FakeClock())
    assert source.sample() is not None and source._dram is not None
    nvml.state["fail_next"] = True
    assert source.sample() is None
    assert source._dram is None and not nvml.live_samples  # the old interval is freed
    first, second = source.sample(), source.sample()
    assert (first.dram_active, second.dram_active) == (None, pytest.approx(0.6))


@pytest.mark.parametrize(("visible", "expected"), [
    ("", "gpu0"), ("2,3", "gpu2"), ("GPU-bbbb-2222,GPU-aaaa-1111", "gpu1"), ("GPU-bbbb", "gpu1"),
])
def test_an_attached_servers_gpu_is_the_first_cuda_may_see(visible: str, expected: str):
    """With no CUDA device of our own to ask its UUID, CUDA_VISIBLE_DEVICES says which GPU
    CUDA's first is (NVML numbers every GPU and ignores the variable)."""
    nvml = fake_pynvml([40], devices=3)
    uuids = {"gpu0": b"GPU-cccc-3333", "gpu1": b"GPU-bbbb-2222", "gpu2": b"GPU-aaaa-1111"}
    nvml.nvmlDeviceGetUUID = uuids.__getitem__
    assert visible_gpu_handle(nvml, {"CUDA_VISIBLE_DEVICES": visible}) == expected


def test_a_gpu_nvml_cannot_open_leaves_the_engine_starting_without_its_processes(
        monkeypatch, caplog):
    """The host sense's NVML side, on a GPU NVML cannot name (a MIG instance): the engine
    starts, says once that the GPU's other processes are unknown, and senses the host."""
    import logging

    import pynvml
    import torch

    from engine.ops import equipped
    from engine.ops.host import HostSensor

    def refuse(cls, uuid, nvml=None):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    monkeypatch.setattr(equipped, "nvml_available", lambda: True)
    monkeypatch.setattr(equipped, "cuda_uuid", lambda device: "MIG-0c")
    monkeypatch.setattr(equipped.NvmlProcesses, "open", classmethod(refuse))
    with caplog.at_level(logging.WARNING, logger=equipped.__name__):
        sense = equipped.DefaultEquipment().host(FakeClock(), torch.device("cuda:0"), False)
    assert isinstance(sense, HostSensor) and sense._gpu is None
    assert [r.getMessage() for r in caplog.records] == [
        "other processes on the GPU unknown: NVML cannot open cuda:0 (Not Found)"]
