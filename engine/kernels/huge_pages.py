"""Host tensors on transparent huge pages for the memory the CPU kernels stream."""

from __future__ import annotations

import contextlib
import math
import mmap

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel built without THP: ordinary pages
            region.madvise(advice)
    # An anonymous mapping reads as zeros; one write a page faults it in (the kernel zeroes
    # it then), so serving never pays the faults and the pool is not written a second time.
    torch.frombuffer(region, dtype=torch.uint8)[::mmap.PAGESIZE].zero_()
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape)
