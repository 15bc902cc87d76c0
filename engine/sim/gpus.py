"""GPUs the twin can simulate: datasheet peaks, memory, and the link tensor parallelism uses.

Peaks come from engine.budget.peaks (one table of datasheet FLOP/s and bandwidth); this adds
what sizing a deployment needs: how much memory a GPU has and how fast an all-reduce between
GPUs of one server runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.budget.peaks import GPU_PRESETS, DevicePeaks
from engine.config import ConfigError

GB = 10**9


@dataclass(frozen=True)
class Interconnect:
    """A GPU-to-GPU link: bytes/s one GPU sends one way, and the latency of one hop."""

    name: str
    bandwidth: float
    hop_latency_s: float
    source: str

    def allreduce_seconds(self, message_bytes: float, gpus: int) -> float:
        """A ring all-reduce of `message_bytes` over `gpus` GPUs (NCCL's large-message
        algorithm): 2(N-1) hops, each sending 1/N of the message."""
        if gpus < 2:
            return 0.0
        hops = 2 * (gpus - 1)
        return hops * (message_bytes / gpus / self.bandwidth + self.hop_latency_s)


# One direction of a GPU's links; hop latencies are typical NCCL figures for one ring step, not
# datasheet numbers (the datasheets give bandwidth only).
NVLINK3 = Interconnect("NVLink 3 (300 GB/s per direction)", 300 * GB, 3e-6,
                       "A100 datasheet: 600 GB/s bidirectional")
NVLINK4 = Interconnect("NVLink 4 (450 GB/s per direction)", 450 * GB, 3e-6,
                       "H100/H200 datasheet: 900 GB/s bidirectional")
NVLINK5 = Interconnect("NVLink 5 (900 GB/s per direction)", 900 * GB, 3e-6,
                       "HGX B200 datasheet: 1.8 TB/s bidirectional")
PCIE4 = Interconnect("PCIe 4.0 x16 (32 GB/s per direction)", 32 * GB, 10e-6,
                     "PCIe 4.0 x16: 64 GB/s bidirectional (L40S has no NVLink)")


# What a serving step sustains of the datasheet peaks: large BF16 GEMMs reach about three
# quarters of the tensor-core peak and streaming reads about 85% of the memory bandwidth on
# these parts (typical published figures, not measured here). Without them a memory-bound
# roofline step would use 100% of the datasheet bandwidth, which no GPU reaches, and the
# engine's bandwidth throttles (seed 000, at 90/95/98%) would engage on every decode.
SUSTAINED_FLOPS = 0.75
SUSTAINED_BANDWIDTH = 0.85


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peaks: DevicePeaks
    memory_bytes: int
    interconnect: Interconnect


GPUS: dict[str, GpuSpec] = {
    "a100": GpuSpec("A100 80GB SXM", GPU_PRESETS["a100"], 80 * 2**30, NVLINK3),
    "h100": GpuSpec("H100 SXM", GPU_PRESETS["h100"], 80 * 2**30, NVLINK4),
    "h200": GpuSpec("H200 SXM", GPU_PRESETS["h200"], 141 * GB, NVLINK4),
    "l40s": GpuSpec("L40S", GPU_PRESETS["l40s"], 48 * 2**30, PCIE4),
    "b200": GpuSpec("B200 (HGX)", GPU_PRESETS["b200"], 180 * GB, NVLINK5),
}


def gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ConfigError("simulate", f"unknown GPU {name!r}; choose one of {', '.join(GPUS)}, "
                          "'this' (this device's stored calibration) or calibration:ID"
                          ) from None


def spec_for_device_name(device_name: str) -> GpuSpec | None:
    """The GPU whose datasheet matches a name torch reports ("NVIDIA H200"), if any."""
    lowered = device_name.lower()
    return next((spec for key, spec in GPUS.items() if key in lowered), None)
