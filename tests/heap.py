"""glibc's heap as memory soaks read it: the bytes allocated and the freed bytes it holds.

A process's RSS rises both when something keeps more memory and when glibc keeps what was
freed (the CPU runner asks it to); only the allocated bytes tell a
leak or a filling cache from a heap that has not shrunk. They count what C and C++ code
allocates too (torch, oneDNN), which tracemalloc does not see.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@dataclass(frozen=True)
class Heap:
    allocated: int  # bytes in use, from the heaps and in their own mappings
    free: int  # freed bytes the heaps hold for reuse


def heap() -> Heap | None:
    """This process's heap now; None without glibc's mallinfo2 (glibc 2.33 and later)."""
    path = ctypes.util.find_library("c")
    mallinfo2 = getattr(ctypes.CDLL(path), "mallinfo2", None) if path else None
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return Heap(allocated=info.uordblks + info.hblkhd, free=info.fordblks)
