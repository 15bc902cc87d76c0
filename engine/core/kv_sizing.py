"""How many bytes a GPU's KV pool gets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class MemoryReading:
    """A device's memory in bytes after the warm-up step (free: once its scratch went back)."""

    total: int
    free: int
    activations: int  # the warm-up's peak over what stayed allocated


@dataclass(frozen=True)
class KvBudget:
    bytes: int
    line: str  # the arithmetic, for the start-up log


def kv_budget(reading: MemoryReading, utilization: float, block_bytes: int) -> KvBudget:
    """`utilization` of the device's memory, less what is in use."""
    used = reading.total - reading.free
    budget = max(0, int(reading.total * utilization) - used - reading.activations)
    line = (f"KV cache: {utilization:g} x {reading.total / GIB:.2f} GiB - "
            f"{used / GIB:.2f} GiB in use - {reading.activations / GIB:.2f} GiB activation "
            f"peak = {budget / GIB:.2f} GiB, {budget // block_bytes} blocks of "
            f"{block_bytes / 2**20:.2f} MiB")
    return KvBudget(budget, line)


def read_cuda_memory(device: torch.device, warm_up: Callable[[], Callable[[], None]]
                     ) -> MemoryReading:
    """The device's memory around `warm_up`, which returns what frees its scratch memory."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    release = warm_up()
    torch.cuda.synchronize(device)
    activations = (torch.cuda.max_memory_allocated(device)
                   - torch.cuda.memory_allocated(device))
    release()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryReading(total=total, free=free, activations=activations)
