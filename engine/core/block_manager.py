"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, per-request tables.

The blocks themselves live in the model runner's KV tensor; this class only hands out block
ids. Newly allocated ids are remembered so the runner zeroes them before use (pitfall 2:
a reused block must never leak a previous request's KV).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engine.core.request import Request

# Copies KV rows: the blocks in the first list to the ids in the second (the runner's cache).
MoveBlocks = Callable[[list[int], list[int]], None]


class BlockError(RuntimeError):
    """A block was freed twice or the pool is inconsistent: a bug, never user input."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._reserved = 0  # blocks held back (chaos: KV exhaustion)
        self.newly_allocated: list[int] = []
        self.compactions = 0
        self.blocks_moved = 0

    @property
    def num_free(self) -> int:
        return len(self._free) - self._reserved

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) + self._reserved

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Extra blocks `request` needs to hold `num_new_tokens` more computed tokens."""
        total = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, total - len(request.block_table))

    def can_grow(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= self.num_free

    def grow(self, request: Request, num_new_tokens: int) -> None:
        """Give `request` blocks for `num_new_tokens` more tokens (caller checked can_grow)."""
        for _ in range(self.blocks_needed(request, num_new_tokens)):
            if self.num_free <= 0:
                raise BlockError("grow() without can_grow(): the pool is empty")
            block = self._free.popleft()
            self._ref_counts[block] = 1
            self.newly_allocated.append(block)
            request.block_table.append(block)

    def release(self, request: Request) -> int:
        """Drop the request's references; returns how many blocks went back to the pool."""
        freed = 0
        for block in request.block_table:
            if self._ref_counts[block] <= 0:
                raise BlockError(f"block {block} freed twice")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
                freed += 1
        request.block_table = []
        return freed

    @property
    def num_allocated(self) -> int:
        """Blocks held by requests (reserved ones not counted)."""
        return self.num_blocks - len(self._free)

    def compact(self, requests: list[Request], move: MoveBlocks) -> int:
        """Renumber the blocks `requests` hold to 0..U-1 (in order of first use): `move`
        copies their KV rows, block tables are rewritten; returns how many blocks moved.

        Generation is unchanged: attention reads KV through block tables only. Nothing moves
        unless `requests` hold every block in use (a holder outside them would be left
        dangling)."""
        self.compactions += 1  # a run that finds the pool contiguous still counts
        mapping: dict[int, int] = {}
        for request in requests:
            for block in request.block_table:
                mapping.setdefault(block, len(mapping))
        moved = {old: new for old, new in mapping.items() if old != new}
        if len(mapping) != self.num_allocated or not moved:
            return 0
        move(list(moved), list(moved.values()))
        for request in requests:
            request.block_table = [mapping[b] for b in request.block_table]
        ref_counts = [0] * self.num_blocks
        for old, new in mapping.items():
            ref_counts[new] = self._ref_counts[old]
        self._ref_counts = ref_counts
        self._free = deque(b for b in range(self.num_blocks) if ref_counts[b] == 0)
        self.newly_allocated = [mapping[b] for b in self.newly_allocated if b in mapping]
        self.blocks_moved += len(moved)
        return len(moved)

    def take_newly_allocated(self) -> list[int]:
        blocks, self.newly_allocated = self.newly_allocated, []
        return blocks

    def reserve(self, num_blocks: int) -> int:
        """Hold back free blocks from allocation (fault injection); returns how many."""
        self._reserved = max(0, min(num_blocks, len(self._free)))
        return self._reserved

    def fragmentation(self, requests: list[Request]) -> float:
        """Share of allocated slots that hold no token: the tails of partly filled blocks."""
        allocated = sum(len(r.block_table) for r in requests) * self.block_size
        if allocated == 0:
            return 0.0
        filled = sum(min(r.num_computed_tokens, len(r.block_table) * self.block_size)
                     for r in requests)
        return 1.0 - filled / allocated

    def check_consistent(self, live: list[Request]) -> None:
        """Every block is either free or referenced by exactly its holders (used by tests)."""
        counts = [0] * self.num_blocks
        for request in live:
            for block in request.block_table:
                counts[block] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockError("a block is on the free list twice")
        for block, count in enumerate(counts):
            if count != self._ref_counts[block] or (count == 0) != (block in free):
                raise BlockError(f"block {block}: {count} holders, ref {self._ref_counts[block]}")
