"""Counts the reads of tensor values by Python during engine steps: each is a host sync on a
GPU (the host waits for the device). The same count runs on CPU, where every read counts."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# the Tensor methods that hand a tensor's values to Python
READS = frozenset({"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu",
                   "numpy"})


class HostReads(TorchFunctionMode):
    """While active, counts reads of tensors on `device` by method name (`counts`)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        name = getattr(func, "__name__", "")
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is not None and tensor.device.type == self.device.type and (
                name in READS or (name == "to" and _to_host(args, kwargs))):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    target = (kwargs or {}).get("device", args[1] if len(args) > 1 else None)
    return str(target).startswith("cpu") and args[0].device.type != "cpu"
