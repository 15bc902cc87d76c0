"""The paged KV cache's bookkeeping under random add / step / abort sequences, and the prefix
cache's reference counts under random admit / compute / release / compact sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig, SamplingParams
from engine.core.block_manager import BlockError, BlockManager, block_hash
from engine.core.request import Request

# A pool of 24 blocks of 4 tokens is small enough that random traffic preempts.
ENGINE = None


def _engine() -> Engine:
    global ENGINE
    if ENGINE is None:
        ENGINE = Engine(EngineConfig(model="synthetic:tiny", device="cpu", block_size=4,
                                     kv_cache_bytes=24 * 4 * 2 * 2 * 2 * 16 * 4,
                                     max_num_batched_tokens=32, chunk_tile=4))
    return ENGINE


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 2), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
)


@pytest.mark.slow  # 1,000 examples
@pytest.mark.soak
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, min_size=1, max_size=20))
def test_no_block_leaks_or_double_frees(ops: list[tuple[str, int, int]]) -> None:
    engine = _engine()
    assert engine.blocks.num_blocks == 24
    ids: list[str] = []
    for kind, a, b in ops:
        if kind == "add":
            ids.append(engine.add_request(list(range(3, 3 + a)),
                                          SamplingParams(max_tokens=b, ignore_eos=True)))
        elif kind == "step":
            for _ in range(a):
                engine.step()
        elif ids:
            engine.abort(ids[a % len(ids)])
        live = list(engine.scheduler.requests.values())
        engine.blocks.check_consistent(live)
        # the prompts share prefixes, so requests share blocks: each counts once
        assert engine.blocks.num_used == len({b for r in live for b in r.block_table})
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    engine.step()
    assert engine.blocks.num_used == 0
    assert engine.blocks.usage == 0.0
    engine.blocks.check_consistent([])


def test_blocks_are_zeroed_when_reallocated() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", block_size=4,
                                 kv_cache_bytes=8 * 4 * 2 * 2 * 2 * 16 * 4))
    engine.generate([list(range(3, 20))], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.runner.kv_cache.abs().sum() > 0  # the finished request left KV behind
    request = Request("r", [5] * 4, SamplingParams(max_tokens=1), arrival=0.0)
    engine.blocks.allocate(request, 4)
    engine.runner.zero_blocks(engine.blocks.take_newly_allocated())
    block = request.block_table[0]
    assert engine.runner.kv_cache[:, :, :, block].abs().sum() == 0
    assert engine.runner.kv_cache.dtype.is_floating_point


def test_zeroing_blocks_zeroes_those_blocks_alone_in_any_order() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", block_size=4,
                                 kv_cache_bytes=12 * 4 * 2 * 2 * 2 * 16 * 4))
    cache = engine.runner.kv_cache
    cache.fill_(1.0)
    zeroed = [9, 2, 3, 7, 4, 11]  # runs 2-4, 7, 9 and 11, given out of order
    engine.runner.zero_blocks(zeroed)
    for block in range(engine.runner.num_blocks + 1):
        expected = 0.0 if block in zeroed else float(cache[:, :, :, block].numel())
        assert float(cache[:, :, :, block].sum()) == expected


def test_allocate_returns_none_and_changes_nothing_when_the_pool_is_short() -> None:
    blocks = BlockManager(4, 4)
    first = Request("a", [5] * 9, SamplingParams(max_tokens=1), arrival=0.0)
    assert blocks.allocate(first, 9) == [0, 1, 2]
    assert blocks.allocate(first, 4) == []  # its last block still has room
    other = Request("b", [5] * 8, SamplingParams(max_tokens=1), arrival=0.0)
    assert blocks.allocate(other, 8) is None
    assert other.block_table == [] and blocks.num_free == 1
    assert blocks.take_newly_allocated() == [0, 1, 2]
    blocks.check_consistent([first])


def test_double_free_is_detected() -> None:
    blocks = BlockManager(4, 4)
    request = Request("r", [5] * 6, SamplingParams(max_tokens=1), arrival=0.0)
    blocks.allocate(request, 6)
    table = list(request.block_table)
    blocks.release(request)
    request.block_table = table
    with pytest.raises(BlockError):
        blocks.release(request)


def test_fragmentation_counts_partly_filled_blocks() -> None:
    blocks = BlockManager(8, 4)
    request = Request("r", [5] * 6, SamplingParams(max_tokens=1), arrival=0.0)
    blocks.allocate(request, 6)
    request.num_computed_tokens = 6
    assert blocks.fragmentation([request]) == pytest.approx(2 / 8)
    assert blocks.usage == pytest.approx(2 / 8)


# --- the prefix cache ---------------------------------------------------------------------

BLOCK = 4
POOL = 12
# prompts from two "system prompts" and a tiny alphabet, so that prefixes repeat often
prefix_ops = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 1), st.lists(st.integers(3, 5), max_size=10)),
    st.tuples(st.just("compute"), st.integers(0, 30), st.integers(1, 9)),
    st.tuples(st.just("release"), st.integers(0, 30), st.just([])),
    st.tuples(st.just("compact"), st.just(0), st.just([])),
    st.tuples(st.just("toggle"), st.just(0), st.just([])),
)


class _Pool:
    """The KV pool as token contents per block: what `move` copies and `grow` clears, so the
    test can check that a cached block a request takes holds exactly its tokens."""

    def __init__(self) -> None:
        self.content: list[tuple[int, ...] | None] = [None] * POOL

    def move(self, source: list[int], target: list[int]) -> None:
        rows = [self.content[b] for b in source]
        for block, row in zip(target, rows, strict=True):
            self.content[block] = row


@settings(max_examples=400, deadline=None)
@given(st.lists(prefix_ops, min_size=1, max_size=40))
def test_shared_blocks_are_never_freed_or_moved_under_a_reader(ops) -> None:
    blocks = BlockManager(POOL, BLOCK)
    pool = _Pool()
    live: list[Request] = []
    systems = ([7] * 9, [8, 9] * 5)
    for n, (kind, a, tokens) in enumerate(ops):
        if kind == "admit":
            request = Request(f"r{n}", systems[a] + tokens, SamplingParams(max_tokens=1), 0.0)
            cached = blocks.take_cached(request)
            assert cached % BLOCK == 0 and cached < request.num_tokens  # last token computed
            for index, block in enumerate(request.block_table):  # hits hold its very tokens
                assert pool.content[block] == tuple(request.prompt_token_ids[
                    index * BLOCK:(index + 1) * BLOCK])
            live.append(request)
        elif kind == "compute" and live:
            request = live[a % len(live)]
            step = min(tokens, request.num_pending)
            if step and blocks.allocate(request, step) is not None:
                for block in blocks.take_newly_allocated():
                    pool.content[block] = None  # the runner zeroes it
                end = request.num_computed_tokens + step
                for index in range(request.num_computed_tokens // BLOCK, -(-end // BLOCK)):
                    block = request.block_table[index]
                    # a request writes only blocks it holds alone: shared ones are full
                    assert blocks._ref_counts.get(block) == 1
                    pool.content[block] = tuple(request.prompt_token_ids[
                        index * BLOCK:min(end, (index + 1) * BLOCK)])
                request.num_computed_tokens = end
                blocks.cache_full_blocks(request)
        elif kind == "release" and live:
            request = live.pop(a % len(live))
            held = list(request.block_table)
            blocks.release(request)
            for block in held:  # a block another request still reads stays out of the pool
                still_read = any(block in r.block_table for r in live)
                assert still_read == (not blocks.is_free(block))
        elif kind == "compact":
            before = {r.id: [pool.content[b] for b in r.block_table] for r in live}
            blocks.compact(live, pool.move)
            assert before == {r.id: [pool.content[b] for b in r.block_table] for r in live}
        elif kind == "toggle":
            blocks.set_caching(not blocks.enable_caching)
            if not blocks.enable_caching:
                assert blocks.num_cached == 0
        assert all(count >= 1 for count in blocks._ref_counts.values())
        blocks.check_consistent(live)
    for request in live:
        blocks.release(request)
    assert blocks.num_free == POOL
    blocks.check_consistent([])


def test_freed_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    blocks = BlockManager(4, BLOCK)
    first = Request("a", list(range(3, 12)), SamplingParams(max_tokens=1), 0.0)  # 2 full + 1
    blocks.allocate(first, 9)
    first.num_computed_tokens = 9
    blocks.cache_full_blocks(first)
    assert blocks.num_cached == 2
    blocks.release(first)
    assert blocks.num_free == 4
    # the two uncached blocks are reused first, then the cached tail before the cached head
    other = Request("b", [20] * 12, SamplingParams(max_tokens=1), 0.0)
    blocks.allocate(other, 12)
    assert blocks.num_cached == 1 and blocks.evictions == 1
    again = Request("c", list(range(3, 12)), SamplingParams(max_tokens=1), 0.0)
    assert blocks.take_cached(again) == BLOCK  # the head block survived
    assert block_hash(None, list(range(3, 7))) in blocks._cached


def test_turning_caching_off_drops_every_hash() -> None:
    blocks = BlockManager(4, BLOCK)
    first = Request("a", list(range(3, 12)), SamplingParams(max_tokens=1), 0.0)
    blocks.allocate(first, 9)
    first.num_computed_tokens = 9
    blocks.cache_full_blocks(first)
    blocks.set_caching(False)
    again = Request("b", list(range(3, 12)), SamplingParams(max_tokens=1), 0.0)
    assert blocks.take_cached(again) == 0 and blocks.num_cached == 0
    blocks.check_consistent([first])


@settings(max_examples=300, deadline=None)
@given(st.lists(prefix_ops.filter(lambda op: op[0] != "compact"), min_size=1, max_size=40))
def test_blocks_are_handed_out_in_free_list_order(ops) -> None:
    """The free list kept in parts (a stack, an untouched range, an LRU) hands out exactly
    the blocks that one list of every block would: unhashed releases in front, hashed ones
    at the back, cached hits taken out wherever they are."""
    blocks = BlockManager(POOL, BLOCK)
    reference = list(range(POOL))  # the free list, next to allocate first
    live: list[Request] = []
    systems = ([7] * 9, [8, 9] * 5)
    for n, (kind, a, tokens) in enumerate(ops):
        if kind == "admit":
            request = Request(f"r{n}", systems[a] + tokens, SamplingParams(max_tokens=1), 0.0)
            blocks.take_cached(request)
            for block in request.block_table:
                if block in reference:
                    reference.remove(block)
            live.append(request)
        elif kind == "compute" and live:
            request = live[a % len(live)]
            step = min(tokens, request.num_pending)
            if step and (handed := blocks.allocate(request, step)) is not None:
                assert handed == reference[:len(handed)]
                del reference[:len(handed)]
                request.num_computed_tokens += step
                blocks.cache_full_blocks(request)
        elif kind == "release" and live:
            request = live.pop(a % len(live))
            table = list(request.block_table)
            hashed = {b: b in blocks._hash_of for b in table}
            blocks.release(request)
            for block in reversed(table):
                if blocks.is_free(block) and block not in reference:
                    if hashed[block]:
                        reference.append(block)
                    else:
                        reference.insert(0, block)
        elif kind == "toggle":
            blocks.set_caching(not blocks.enable_caching)
        assert blocks.num_free == len(reference)
        blocks.check_consistent(live)


def test_a_pool_of_millions_of_blocks_costs_only_the_blocks_it_hands_out() -> None:
    """A tiny model's twin on an H100 has 17.7M blocks: per-block lists made each replica
    0.3 GB and 0.45 s before its first step (8 replicas: 2.7 GB). Its bookkeeping now
    grows with the blocks in use."""
    import tracemalloc

    tracemalloc.start()
    try:
        pool = BlockManager(20_000_000, 16)
        request = Request("r", list(range(3, 3 + 64)), SamplingParams(max_tokens=1),
                          arrival=0.0)
        assert pool.allocate(request, 64) == [0, 1, 2, 3]
        request.num_computed_tokens = 64
        pool.cache_full_blocks(request)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000
    assert pool.num_free == 20_000_000 - 4 and pool.num_cached == 4
    assert pool.release(request) == 4 and pool.num_free == 20_000_000
