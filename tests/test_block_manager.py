"""The paged KV cache's bookkeeping under random add / step / abort sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig, SamplingParams
from engine.core.block_manager import BlockError, BlockManager
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
        assert engine.blocks.num_used == sum(len(r.block_table) for r in live)
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
    engine.blocks.grow(request, 4)
    engine.runner.zero_blocks(engine.blocks.take_newly_allocated())
    block = request.block_table[0]
    assert engine.runner.kv_cache[:, :, :, block].abs().sum() == 0
    assert engine.runner.kv_cache.dtype.is_floating_point


def test_double_free_is_detected() -> None:
    blocks = BlockManager(4, 4)
    request = Request("r", [5] * 6, SamplingParams(max_tokens=1), arrival=0.0)
    blocks.grow(request, 6)
    table = list(request.block_table)
    blocks.release(request)
    request.block_table = table
    with pytest.raises(BlockError):
        blocks.release(request)


def test_fragmentation_counts_partly_filled_blocks() -> None:
    blocks = BlockManager(8, 4)
    request = Request("r", [5] * 6, SamplingParams(max_tokens=1), arrival=0.0)
    blocks.grow(request, 6)
    request.num_computed_tokens = 6
    assert blocks.fragmentation([request]) == pytest.approx(2 / 8)
    assert blocks.usage == pytest.approx(2 / 8)
