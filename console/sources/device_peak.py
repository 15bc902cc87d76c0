"""The peaks of the GPU an attached server runs on: a `--gpu NAME` datasheet, or NVML when
the server runs on the same host. Without either, the reason is kept so panes can say it."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import torch

from engine.budget.peaks import GPU_PRESETS, DevicePeaks, measure_peaks
from engine.config import ConfigError
from engine.ops.telemetry import nvml_available, visible_gpu_handle

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


@dataclass(frozen=True)
class PeakLookup:
    peaks: DevicePeaks | None
    reason: str  # where the peaks come from, or why there are none


def gpu_preset(name: str) -> DevicePeaks:
    """The datasheet peaks of `name` (case-insensitive); ConfigError names the known GPUs."""
    peaks = GPU_PRESETS.get(name.strip().lower())
    if peaks is None:
        raise ConfigError("gpu", f"unknown GPU {name!r}; choose cpu or one of "
                                 f"{', '.join(GPU_PRESETS)}")
    return peaks


def preset_for_device(device_name: str) -> DevicePeaks | None:
    """The preset whose key the device name contains, longest first ("a100" before "a10")."""
    flat = device_name.lower().replace(" ", "").replace("-", "")
    for key in sorted(GPU_PRESETS, key=len, reverse=True):
        if key in flat:
            return GPU_PRESETS[key]
    return None


def lookup_peaks(gpu: str | None, url: str) -> PeakLookup:
    """`--gpu cpu` measures this machine (a vLLM-CPU next to the console); a preset name reads
    its datasheet; otherwise NVML names the local GPU."""
    if gpu and gpu.strip().lower() == "cpu":
        peaks = measure_peaks("cpu", torch.bfloat16)
        return PeakLookup(peaks, "this CPU's measured peak (bf16)")
    if gpu:
        peaks = gpu_preset(gpu)
        return PeakLookup(peaks, f"{peaks.name} datasheet peak")
    if urlsplit(url).hostname not in LOCAL_HOSTS:
        return PeakLookup(None, "device peak unknown: pass --gpu NAME for a remote server")
    if not nvml_available():
        return PeakLookup(None, "device peak unknown: no NVIDIA GPU here; pass --gpu NAME")
    import pynvml

    pynvml.nvmlInit()
    try:
        name = pynvml.nvmlDeviceGetName(visible_gpu_handle(pynvml))
    finally:
        pynvml.nvmlShutdown()
    name = name.decode() if isinstance(name, bytes) else str(name)
    peaks = preset_for_device(name)
    if peaks is None:
        return PeakLookup(None, f"no datasheet for local {name}; pass --gpu NAME")
    return PeakLookup(peaks, f"{peaks.name} datasheet peak (NVML: {name})")
