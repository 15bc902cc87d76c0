"""Host tensors on transparent huge pages, for the memory the CPU kernels stream (issue 18).

The paged KV cache is read block by block, each block in a different 4 KiB page: every block
costs a TLB miss and a page walk before its first row arrives. On 2 MiB pages one TLB entry
covers 128 blocks. Where `/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` (the
usual default) Linux grants them only to a mapping that asks, and torch's allocator asks
only when `THP_MEM_ALLOC_ENABLE` is set; so the mapping here asks. Where THP is `never`, or
the platform has no madvise, the tensor is ordinary memory.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in a fresh anonymous mapping advised to use huge pages.

    Every page is touched here, as torch.zeros would: the kernel's first-touch fault and
    page clearing are then paid at start, not by the steps that first use a block (on this
    VM, where fresh guest memory also faults in the host, clearing took 6% of a 58 s run
    under perf). The tensor keeps the mapping alive.
    """
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel built without THP: ordinary pages
            region.madvise(advice)
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape).zero_()
