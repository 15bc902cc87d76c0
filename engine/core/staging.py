"""A step's host-built tensors sent to the device in one copy from pinned memory.

Every tensor reachable through dataclass fields, tuples and lists is packed into one byte
buffer, copied with one non-blocking upload, and the structure rebuilt around views of the
device copy, so the host goes on building while the copy runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
ALIGN = 16  # every view starts aligned for any dtype


def moved(value: T, move: Callable[[torch.Tensor], torch.Tensor]) -> T:
    """`value` rebuilt with `move` applied to each tensor in it (dataclasses, tuples, lists)."""
    if isinstance(value, torch.Tensor):
        return move(value)  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{  # type: ignore[return-value]
            f.name: moved(getattr(value, f.name), move) for f in dataclasses.fields(value)
            if f.init})
    if isinstance(value, tuple | list):
        return type(value)(moved(v, move) for v in value)  # type: ignore[return-value]
    return value


def tensors(value: object) -> list[torch.Tensor]:
    """The tensors in `value`, in the order `moved` visits them."""
    found: list[torch.Tensor] = []
    moved(value, lambda t: found.append(t) or t)
    return found


@dataclasses.dataclass(frozen=True)
class Packed:
    """Where each tensor lies in the byte buffer: (offset, dtype, shape), in `tensors` order."""

    places: tuple[tuple[int, torch.dtype, torch.Size], ...]
    nbytes: int


def pack(found: list[torch.Tensor], buffer: torch.Tensor | None) -> tuple[torch.Tensor, Packed]:
    """`found`'s bytes in `buffer` (uint8; a new one where it is missing or too small)."""
    places, offset = [], 0
    for t in found:
        places.append((offset, t.dtype, t.shape))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if buffer is None or buffer.numel() < offset:
        buffer = torch.empty(max(offset, 1), dtype=torch.uint8)
    for t, (start, _, _) in zip(found, places, strict=True):
        size = t.numel() * t.element_size()
        buffer[start:start + size] = t.contiguous().view(-1).view(torch.uint8)
    return buffer, Packed(tuple(places), offset)


def unpack(buffer: torch.Tensor, packed: Packed) -> list[torch.Tensor]:
    out = []
    for start, dtype, shape in packed.places:
        size = shape.numel() * torch.empty((), dtype=dtype).element_size()
        out.append(buffer[start:start + size].view(dtype).view(shape))
    return out


class Staging:
    """One pinned buffer per runner, reused step after step: packing waits for the last copy
    out of it to end (a step's read back has mostly seen to that already)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self.uploads = 0  # copies made so far (one a step)

    def upload(self, value: T) -> T:
        """`value` with its tensors on the device, in one copy; unchanged on the CPU."""
        if self.device.type == "cpu":
            return value
        if self._copied is not None:
            self._copied.synchronize()
        found = tensors(value)
        buffer, packed = pack(found, self._pinned(found))
        device_copy = buffer[:packed.nbytes].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.uploads += 1
        views = iter(unpack(device_copy, packed))
        return moved(value, lambda _: next(views))

    def _pinned(self, found: list[torch.Tensor]) -> torch.Tensor:
        need = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in found)
        if self._buffer is None or self._buffer.numel() < need:
            # doubled so a growing batch does not pin afresh every step
            self._buffer = torch.empty(max(need * 2, 1 << 20), dtype=torch.uint8,
                                       pin_memory=True)
        return self._buffer
