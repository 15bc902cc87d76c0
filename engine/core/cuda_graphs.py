"""Whole-model CUDA graphs of decode-only steps at padded batch sizes, as vLLM keeps them.

A decode-only step of B requests replays the graph of the smallest captured size >= B: its
inputs are copied into static buffers (one upload), the padding rows write to and read from a
spare KV block no request owns, and the first B rows of the output are the step's. Each size
is captured on first use, on the thread that runs the steps (the engine's), into one shared
memory pool. Attention inside a graph reads whole block tables of max_model_len's width, so
its shapes are fixed: flash-attn's paged call, or SDPA over the gathered table with a
length mask. Steps with a prefill chunk run eagerly by design: their shapes vary with every
chunk. A live change of the token budget needs no recapture: it changes which steps are
decode-only, never a captured size (those are bounded by max_num_seqs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.batch import ScheduledChunk
from engine.core.runner_requests import RunnerRequest
from engine.kernels.attention import AttentionMetadata
from engine.kernels.backends import AttentionBackend

# vLLM's capture sizes: 1, 2, 4, then every 8 up to the largest decode batch
SMALL_SIZES = (1, 2, 4)
SIZE_STEP = 8
MAX_GRAPH_BATCH = 256

Replay = Callable[[], None]
# (what to capture, the memory pool) -> (replay, the captured output tensor)
Capture = Callable[[Callable[[], torch.Tensor], object], tuple[Replay, torch.Tensor]]


# SDPA in a graph gathers whole tables: its sizes stop where one layer's gather passes this
GATHER_BYTES = 1 << 30


def capture_sizes(max_num_seqs: int, gather_bytes_per_row: int = 0) -> tuple[int, ...]:
    """vLLM's sizes up to the largest decode batch, and, where attention gathers whole
    tables (`gather_bytes_per_row` a layer), up to what GATHER_BYTES holds."""
    largest = min(max_num_seqs, MAX_GRAPH_BATCH)
    if gather_bytes_per_row:
        largest = max(1, min(largest, GATHER_BYTES // gather_bytes_per_row))
    sizes = [s for s in SMALL_SIZES if s <= largest]
    sizes += range(SIZE_STEP, largest + 1, SIZE_STEP)
    if sizes[-1] < largest:
        sizes.append(-(-largest // SIZE_STEP) * SIZE_STEP)
    return tuple(sizes)


def cuda_capture(run: Callable[[], torch.Tensor], pool: object) -> tuple[Replay, torch.Tensor]:
    """torch.cuda.CUDAGraph's capture, after a warm-up run on a side stream (as torch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph.replay, out


@dataclass(frozen=True)
class GraphInputs:
    """A decode step's host inputs, copied into the static buffers' first rows."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B]
    tables: torch.Tensor  # [B, width]
    lengths: torch.Tensor  # [B]


class CudaGraphs:
    """The captured decode graphs of one runner; `capture` is cuda_capture on a GPU."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, *, device: torch.device,
                 backend: AttentionBackend, max_model_len: int, pad_block: int,
                 sizes: Sequence[int], capture: Capture = cuda_capture,
                 new_pool: Callable[[], object] = torch.cuda.graph_pool_handle) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.backend, self.block_size = backend, backend.block_size
        self.max_model_len = max_model_len
        self.sizes = tuple(sorted(sizes))
        self.width = -(-max_model_len // self.block_size)
        self.pad_block = pad_block
        # one memory pool for every size, made at the first capture: without it each graph
        # would keep a private pool of its own temporaries, sizes times over
        self._capture, self._new_pool = capture, new_pool
        self._pool: object | None = None
        largest = self.sizes[-1]
        self.static = GraphInputs(
            input_ids=torch.zeros(largest, dtype=torch.int64, device=device),
            positions=torch.zeros(largest, dtype=torch.int64, device=device),
            slots=torch.zeros(largest, dtype=torch.int64, device=device),
            tables=torch.zeros(largest, self.width, dtype=torch.int64, device=device),
            lengths=torch.ones(largest, dtype=torch.int64, device=device))
        self.graphs: dict[int, tuple[Replay, torch.Tensor]] = {}

    def covers(self, chunks: Sequence[ScheduledChunk]) -> bool:
        return bool(chunks) and len(chunks) <= self.sizes[-1] and all(
            c.is_decode for c in chunks)

    def size_for(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def host_inputs(self, chunks: Sequence[ScheduledChunk],
                    rows: Sequence[RunnerRequest]) -> GraphInputs:
        """The step's rows padded to its graph's size: padding decodes one token in the spare
        block, which no request owns. Tables only as wide as the longest row's (a power of
        two): the static columns past it keep earlier block ids, which attention masks off
        by length, so a step uploads its own tables, not max_model_len's."""
        size = self.size_for(len(chunks))
        bs, pad = self.block_size, self.pad_block
        ids, positions, slots, lengths = [], [], [], []
        longest = max(c.start // bs + 1 for c in chunks)
        tables = torch.full((size, min(self.width, 1 << (longest - 1).bit_length())), pad,
                            dtype=torch.int64)
        for i, (chunk, request) in enumerate(zip(chunks, rows, strict=True)):
            position = chunk.start
            ids.append(request.token_ids[position])
            positions.append(position)
            slots.append(request.block_table[position // bs] * bs + position % bs)
            lengths.append(position + 1)
            table = request.block_table[:tables.shape[1]]
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.int64)
        padding = size - len(chunks)
        return GraphInputs(
            input_ids=torch.tensor(ids + [0] * padding, dtype=torch.int64),
            positions=torch.tensor(positions + [0] * padding, dtype=torch.int64),
            slots=torch.tensor(slots + [pad * bs] * padding, dtype=torch.int64),
            tables=tables, lengths=torch.tensor(lengths + [1] * padding, dtype=torch.int64))

    def run(self, inputs: GraphInputs) -> torch.Tensor:
        """The hidden states of the step's rows (padding included), by replaying its graph."""
        size = inputs.input_ids.shape[0]
        for name in ("input_ids", "positions", "slots", "lengths"):
            getattr(self.static, name)[:size].copy_(getattr(inputs, name), non_blocking=True)
        self.static.tables[:size, :inputs.tables.shape[1]].copy_(inputs.tables,
                                                                 non_blocking=True)
        if size not in self.graphs:
            if self._pool is None:
                self._pool = self._new_pool()
            self.graphs[size] = self._capture(lambda: self._forward(size), self._pool)
        replay, out = self.graphs[size]
        replay()
        return out

    def _forward(self, size: int) -> torch.Tensor:
        s = self.static
        meta = self._metadata(size)
        return self.model(s.input_ids[:size], s.positions[:size], self.kv_cache, meta)

    def _metadata(self, size: int) -> AttentionMetadata:
        """Attention's metadata from the static buffers, built inside the graph."""
        s = self.static
        return self.backend.graph_metadata(s.slots[:size], s.tables[:size], s.lengths[:size],
                                           self.max_model_len)
