"""CPU graphs: a decode step's kernel calls recorded per batch size, then replayed."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.kernels import cpu_kernels, huge_pages
from engine.kernels.attention import AttentionMetadata, TorchMetadata
from engine.kernels.cpu_kernels import PANEL_MAX_ROWS, Rotation

log = logging.getLogger(__name__)

ARENA_ALIGN = 64
ARENA_START_BYTES = 8 << 20  # doubled (and the graphs captured again) when a capture needs more
_LIKE = {torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}


Decoder = Callable[[torch.Tensor, list[Rotation], torch.Tensor, AttentionMetadata],
                   torch.Tensor]


class NotGraphable(RuntimeError):
    """The step runs a torch op that computes, which a replay of kernel calls would skip."""


class _ArenaFull(RuntimeError):
    pass


class Arena:
    """Memory that a capture's allocations are carved from, front to back."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = huge_pages.zeros((nbytes,), torch.uint8)
        self.used = 0

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        start = -(-self.used // ARENA_ALIGN) * ARENA_ALIGN
        end = start + math.prod(shape) * dtype.itemsize
        if end > self.buffer.numel():
            raise _ArenaFull(f"{end} bytes")
        self.used = end
        return self.buffer[start:end].view(dtype).view(tuple(shape))


class _Capture(TorchDispatchMode):
    """Allocations from the arena; any op but a view or an allocation refused."""

    def __init__(self, arena: Arena) -> None:
        super().__init__()
        self.arena = arena

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # a capture never runs under torch.compile; wrapping for dynamo would import it
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.empty.memory_format:
            return self.arena.take(args[0], kwargs.get("dtype") or torch.get_default_dtype())
        if func in _LIKE:
            like = args[0]
            shape = like.shape if func is torch.ops.aten.empty_like.default else args[1]
            return self.arena.take(shape, kwargs.get("dtype") or like.dtype)
        if func.namespace == "tokenflow":  # a CPU kernel: cpu_kernels.recording() sees it
            return func(*args, **kwargs)
        if func._schema.is_mutable:
            raise NotGraphable(f"{func} writes a tensor outside the CPU kernels")
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        if not all(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in inputs
                   for t in tree_leaves(out)):
            raise NotGraphable(f"{func} computes outside the CPU kernels")
        return out


class CpuGraph:
    """`run`'s kernel calls, recorded while it runs once over the static `inputs`."""

    def __init__(self, run: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor],
                 arena: Arena) -> None:
        self.inputs = tuple(inputs)
        arena.used = 0  # the graphs share the arena: each starts at its front
        with cpu_kernels.recording() as calls, _Capture(arena):
            self.output = run()
        self.calls = tuple(calls)

    def replay(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """The output of a run over `values` (copied into the static inputs)."""
        for static, value in zip(self.inputs, values, strict=True):
            _fill(static, value)
        for entry, args in self.calls:
            entry(*args)
        return self.output


class DecodeGraphs:
    """A model's decode-only steps as CPU graphs, one per batch size up to PANEL_MAX_ROWS."""

    def __init__(self, decoder: Decoder, kv_cache: torch.Tensor, max_blocks: int) -> None:
        self.decoder = decoder
        self.kv_cache = kv_cache
        self.max_blocks = max_blocks
        self.arena = Arena(ARENA_START_BYTES)
        self.graphs: dict[tuple[int, int], CpuGraph] = {}
        self.refused: str | None = None  # why this model's steps stay eager
        self.statics: _Statics | None = None

    def covers(self, meta: AttentionMetadata, rows: int) -> bool:
        return (self.refused is None and isinstance(meta, TorchMetadata) and not meta.prefills
                and meta.decode_start == 0
                and meta.decode_tables is not None and rows <= PANEL_MAX_ROWS
                and meta.decode_tables.shape[1] <= self.max_blocks)

    def run(self, x: torch.Tensor, rotations: list[Rotation],
            meta: AttentionMetadata) -> torch.Tensor:
        assert isinstance(meta, TorchMetadata)
        assert meta.decode_tables is not None and meta.decode_lengths is not None
        if self.statics is None:
            self.statics = _Statics(x, rotations, self.max_blocks)
        tables = self.statics.distinct(rotations)
        values = [x, *(t for rotation in tables for t in rotation),
                  meta.slot_mapping, meta.decode_tables, meta.decode_lengths]
        key = (x.shape[0], torch.get_num_threads())
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(key[0], values)
            except NotGraphable as exc:
                self.refused = str(exc)
                log.info("decode steps stay eager: %s", exc)
                return self.decoder(x, rotations, self.kv_cache, meta)
            self.graphs[key] = graph
            return graph.output
        return graph.replay(values)

    def _capture(self, rows: int, values: list[torch.Tensor]) -> CpuGraph:
        assert self.statics is not None
        statics = self.statics.rows(rows)
        meta = TorchMetadata(slot_mapping=statics[-3], prefills=(), decode_start=0,
                             decode_groups=(), decode_tables=statics[-2],
                             decode_lengths=statics[-1])
        meta = replace(meta, windowed=meta)  # the kernel windows each decode itself
        rotations = self.statics.rotations(rows)

        def run() -> torch.Tensor:
            return self.decoder(statics[0], rotations, self.kv_cache, meta)

        while True:
            # afresh each try: a capture cut short has updated x in place
            for static, value in zip(statics, values, strict=True):
                _fill(static, value)
            try:
                return CpuGraph(run, statics, self.arena)
            except _ArenaFull:
                # a larger arena moves every graph's buffers: capture them afresh
                self.arena = Arena(2 * self.arena.buffer.numel())
                self.graphs.clear()


class _Statics:

    def __init__(self, x: torch.Tensor, rotations: list[Rotation], max_blocks: int) -> None:
        rows = PANEL_MAX_ROWS
        first = {id(rotation): layer for layer, rotation in reversed(list(enumerate(rotations)))}
        self.first_layers = sorted(first.values())
        self.table_of = [self.first_layers.index(first[id(r)]) for r in rotations]
        self.x = x.new_zeros(rows, x.shape[1])
        self.tables = [tuple(t.new_zeros(rows, *t.shape[1:]) for t in rotations[layer])
                       for layer in self.first_layers]
        self.slots = torch.zeros(rows, dtype=torch.int64)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int64)
        self.lengths = torch.ones(rows, dtype=torch.int64)

    def distinct(self, rotations: list[Rotation]) -> list[Rotation]:
        return [rotations[layer] for layer in self.first_layers]

    def rows(self, rows: int) -> list[torch.Tensor]:
        return [self.x[:rows], *(t[:rows] for table in self.tables for t in table),
                self.slots[:rows], self.block_tables[:rows], self.lengths[:rows]]

    def rotations(self, rows: int) -> list[Rotation]:
        tables: list[Rotation] = [(cos[:rows], sin[:rows]) for cos, sin in self.tables]
        return [tables[table] for table in self.table_of]


def _fill(static: torch.Tensor, value: torch.Tensor) -> None:
    static[tuple(slice(0, size) for size in value.shape)].copy_(value)
