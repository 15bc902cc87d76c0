"""What a device can do: dense matmul FLOP/s and memory bandwidth, from datasheets or measured."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DevicePeaks:
    name: str
    flops: float
    bandwidth: float
    source: str


GPU_PRESETS: dict[str, DevicePeaks] = {
    "a100": DevicePeaks("a100", 312e12, 2.039e12, "NVIDIA A100 80GB SXM datasheet"),
    "a100-pcie": DevicePeaks("a100-pcie", 312e12, 1.935e12, "NVIDIA A100 80GB PCIe datasheet"),
    "h100": DevicePeaks("h100", 989e12, 3.35e12, "NVIDIA H100 SXM datasheet"),
    "h100-pcie": DevicePeaks("h100-pcie", 756e12, 2.0e12, "NVIDIA H100 PCIe datasheet"),
    "h200": DevicePeaks("h200", 989e12, 4.8e12, "NVIDIA H200 SXM datasheet"),
    "l40s": DevicePeaks("l40s", 362e12, 0.864e12, "NVIDIA L40S datasheet"),
    "b200": DevicePeaks("b200", 2250e12, 7.7e12, "NVIDIA HGX B200 datasheet"),
    "a10": DevicePeaks("a10", 125e12, 0.6e12, "NVIDIA A10 datasheet"),
    "rtx4090": DevicePeaks("rtx4090", 165.2e12, 1.008e12, "NVIDIA Ada GPU whitepaper"),
    "mi300x": DevicePeaks("mi300x", 1307e12, 5.3e12, "AMD Instinct MI300X datasheet"),
}

_MATMUL_SIZE = {"cpu": 1024, "cuda": 8192}
_CPU_LOW_PRECISION_SIZE = 256
_COPY_BYTES = {"cpu": 128 << 20, "cuda": 2 << 30}
_REPEATS = {"cpu": 5, "cuda": 10}


@functools.cache
def measure_peaks(device: str, dtype: torch.dtype) -> DevicePeaks:
    """Median matmul FLOP/s and copy bandwidth on `device`, once per process."""
    import torch
    dev = torch.device(device)
    if dev.type not in _MATMUL_SIZE:
        raise ConfigError("device", f"cannot measure peaks on {device!r}; use cpu or cuda")
    if dev.type == "cpu" and dtype == torch.float16:
        raise ConfigError("dtype", "float16 matmuls are not supported on CPU; use float32")
    n, repeats = _MATMUL_SIZE[dev.type], _REPEATS[dev.type]
    if dev.type == "cpu" and dtype != torch.float32:
        n = _CPU_LOW_PRECISION_SIZE
    with torch.inference_mode():
        generator = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(n, n, device=dev, dtype=dtype, generator=generator)
        b = torch.randn(n, n, device=dev, dtype=dtype, generator=generator)
        matmul_s = _median_seconds(dev, lambda: torch.mm(a, b), repeats)
        elements = _COPY_BYTES[dev.type] // dtype.itemsize
        src = torch.empty(elements, device=dev, dtype=dtype).fill_(1.0)
        dst = torch.empty_like(src)
        copy_s = _median_seconds(dev, lambda: dst.copy_(src), repeats)
        moved = 2 * src.numel() * src.element_size()
    return DevicePeaks(
        name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        flops=2 * n**3 / matmul_s,
        bandwidth=moved / copy_s,
        source=f"measured: {n}x{n} {str(dtype).removeprefix('torch.')} matmul, "
        f"copy moving {moved >> 20} MiB, median of {repeats}",
    )


def _median_seconds(device: torch.device, op: Callable[[], object], repeats: int) -> float:
    """Median wall time of `op` after two warm-up runs; CUDA events time the GPU, not the launch."""
    import torch
    for _ in range(2):
        op()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            start_s = time.perf_counter()
            op()
            times.append(time.perf_counter() - start_s)
    return statistics.median(times)
