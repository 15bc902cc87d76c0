"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, per-request tables."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable

from engine.core.request import Request

# Copies KV rows: the blocks in the first list to the ids in the second (the runner's cache).
MoveBlocks = Callable[[list[int], list[int]], None]

BlockHash = bytes


def block_hash(parent: BlockHash | None, tokens: list[int]) -> BlockHash:
    return _block_hash(parent, array("q", tokens).tobytes())


def _block_hash(parent: BlockHash | None, token_bytes: bytes) -> BlockHash:
    digest = hashlib.sha256(parent or b"")
    digest.update(token_bytes)
    return digest.digest()


class BlockError(RuntimeError):
    """A block was freed twice or the pool is inconsistent: a bug, never user input."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # the free list: front stack (next on top), untouched range, back
        self._front: list[int] = []
        self._untouched = 0  # blocks from here to num_blocks were never handed out
        self._back: OrderedDict[int, None] = OrderedDict()
        # held blocks' reference counts and cached blocks' hashes, by block: a pool's size
        # costs nothing until it is used (a tiny model's twin on an H100 has 17.7M blocks)
        self._ref_counts: dict[int, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._cached: dict[BlockHash, int] = {}  # registered blocks, in use or free
        self._reserved = 0  # blocks held back (chaos: KV exhaustion)
        self.newly_allocated: list[int] = []
        self.compactions = 0
        self.blocks_moved = 0
        self.evictions = 0  # cached blocks reallocated to new content

    @property
    def _num_unheld(self) -> int:
        return len(self._front) + self.num_blocks - self._untouched + len(self._back)

    @property
    def num_free(self) -> int:
        return self._num_unheld - self._reserved

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_unheld + self._reserved

    def is_free(self, block: int) -> bool:
        return block not in self._ref_counts

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, total - len(request.block_table))

    def allocate(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """The blocks added for `num_new_tokens` more tokens, or None (no change) if none fit."""
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > self.num_free:
            return None
        new = []
        for _ in range(needed):
            block = self._pop_free()
            self._forget(block)  # evicted: its KV is about to be overwritten
            self._ref_counts[block] = 1
            new.append(block)
        self.newly_allocated += new
        request.block_table += new
        return new

    def release(self, request: Request) -> int:
        """Drop the request's references; returns how many blocks went back to the pool."""
        freed = 0
        counts = self._ref_counts
        for block in reversed(request.block_table):
            count = counts.get(block)
            if count is None:
                raise BlockError(f"block {block} freed twice")
            if count > 1:
                counts[block] = count - 1
            else:
                del counts[block]
                if block not in self._hash_of:
                    self._front.append(block)
                else:
                    self._back[block] = None
                freed += 1
        request.block_table = []
        request.num_hashed_blocks = 0
        return freed

    def _pop_free(self) -> int:
        if self._front:
            return self._front.pop()
        if self._untouched < self.num_blocks:
            self._untouched += 1
            return self._untouched - 1
        return self._back.popitem(last=False)[0]

    def cached_prefix(self, request: Request) -> tuple[int, ...]:
        """The blocks of a blockless request's longest cached prefix, never its last token's
        block; a lookup that changes no block (the request memoizes its block hashes)."""
        if (not self.enable_caching or request.block_table
                or request.params.prompt_logprobs is not None):
            return ()
        found = []
        for h in self._hashes(request, (request.num_tokens - 1) // self.block_size):
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return tuple(found)

    def take_cached(self, request: Request) -> int:
        """Give a blockless request its longest cached prefix; returns its tokens."""
        prefix = self.cached_prefix(request)
        if not prefix:
            return 0
        counts = self._ref_counts
        for block in prefix:
            if block not in counts:
                del self._back[block]  # a free block with a hash was released to the back
            counts[block] = counts.get(block, 0) + 1
            request.block_table.append(block)
        request.num_hashed_blocks = len(request.block_table)
        request.num_computed_tokens = len(request.block_table) * self.block_size
        return request.num_computed_tokens

    def touch(self, blocks: Iterable[int]) -> None:
        """Count free cached blocks as just used: they go to the back of the eviction order."""
        for block in blocks:
            if block in self._back:
                self._back.move_to_end(block)

    def cache_full_blocks(self, request: Request) -> None:
        full = request.num_computed_tokens // self.block_size
        if not self.enable_caching or full <= request.num_hashed_blocks:
            return
        hashes = self._hashes(request, full)
        for index in range(request.num_hashed_blocks, full):
            block = request.block_table[index]
            if block not in self._hash_of and hashes[index] not in self._cached:
                self._hash_of[block] = hashes[index]
                self._cached[hashes[index]] = block
        request.num_hashed_blocks = full

    def set_caching(self, enabled: bool) -> None:
        """Turn the prefix cache on or off; off drops every hash, so nothing is hit again."""
        self.enable_caching = enabled
        if not enabled:
            self._hash_of.clear()
            self._cached.clear()

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        hashes = request.block_hashes
        done = len(hashes)
        if done >= num_blocks:
            return hashes
        # one int64 conversion, sliced per block: long prompts are hashed at admission
        bs = self.block_size
        tokens = array("q", request.tokens_between(done * bs, num_blocks * bs))
        raw, width = tokens.tobytes(), bs * tokens.itemsize
        for offset in range(0, len(raw), width):
            hashes.append(_block_hash(hashes[-1] if hashes else None,
                                      raw[offset:offset + width]))
        return hashes

    def _forget(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._cached[h]
            self.evictions += 1

    @property
    def num_allocated(self) -> int:
        return self.num_blocks - self._num_unheld

    def compact(self, requests: list[Request], move: MoveBlocks) -> int:
        """Renumber the blocks `requests` hold to 0..U-1 (in order of first use)."""
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
        for new in moved.values():
            if new not in self._ref_counts:
                self._forget(new)
        # vacated ids stay unhashed: their KV moved
        hash_of = {b: h for b, h in self._hash_of.items() if b not in self._ref_counts}
        ref_counts: dict[int, int] = {}
        for old, new in mapping.items():
            ref_counts[new] = self._ref_counts[old]
            if (h := self._hash_of.get(old)) is not None:
                hash_of[new] = h
                self._cached[h] = new
        self._ref_counts, self._hash_of = ref_counts, hash_of
        # unhashed free blocks first, then the cached ones in their old LRU order
        free = [b for b in range(self.num_blocks) if b not in ref_counts]
        survivors = [b for b in self._back if b not in ref_counts and b in hash_of]
        self._front = [b for b in reversed(free) if b not in hash_of]
        self._untouched = self.num_blocks
        self._back = OrderedDict.fromkeys(survivors)
        self.newly_allocated = [mapping[b] for b in self.newly_allocated if b in mapping]
        self.blocks_moved += len(moved)
        return len(moved)

    def take_newly_allocated(self) -> list[int]:
        blocks, self.newly_allocated = self.newly_allocated, []
        return blocks

    def reserve(self, num_blocks: int) -> int:
        """Hold back free blocks from allocation (fault injection); returns how many."""
        self._reserved = max(0, min(num_blocks, self._num_unheld))
        return self._reserved

    def fragmentation(self, requests: Iterable[Request]) -> float:
        """Share of allocated slots that hold no token: the tails of partly filled blocks."""
        size = self.block_size
        allocated = filled = 0
        for r in requests:  # one pass: the engine measures this after every step
            slots = len(r.block_table) * size
            allocated += slots
            filled += min(r.num_computed_tokens, slots)
        if allocated == 0:
            return 0.0
        return 1.0 - filled / allocated

    def check_consistent(self, live: list[Request]) -> None:
        counts = [0] * self.num_blocks
        for request in live:
            for block in request.block_table:
                counts[block] += 1
        listed = [*self._front, *range(self._untouched, self.num_blocks), *self._back]
        if len(set(listed)) != len(listed):
            raise BlockError("a block is on the free list twice")
        unheld = set(listed)
        for block, count in enumerate(counts):
            held = self._ref_counts.get(block, 0)
            if count != held or (count == 0) != (block in unheld):
                raise BlockError(f"block {block}: {count} holders, ref {held}")
        for h, block in self._cached.items():
            if self._hash_of.get(block) != h:
                raise BlockError(f"cache entry names block {block}, which holds another hash")
        if len(self._hash_of) != len(self._cached):
            raise BlockError("a block holds a hash the cache does not name")
