"""A long generation's per-step work stays flat: outputs carry new tokens only, and nothing
in a step copies the output generated so far. The work is counted, not timed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, SupportsIndex

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.budget.peaks import DevicePeaks
from engine.sim.executor import VirtualClock, simulated_engine
from engine.sim.target import SimTarget


class CountingList(list[int]):
    """A request's output tokens that count every element read out of them (iterated,
    sliced or concatenated); `len` and appends are free, as they are for a list."""

    read = 0

    def __iter__(self) -> Iterator[int]:
        CountingList.read += len(self)
        return super().__iter__()

    def __getitem__(self, index: SupportsIndex | slice) -> Any:  # type: ignore[override]
        item = super().__getitem__(index)
        CountingList.read += len(item) if isinstance(index, slice) else 1
        return item

    def __radd__(self, other: list[int]) -> list[int]:
        CountingList.read += len(self)
        return other + list.copy(self)


def per_step_reads(engine: Engine, max_tokens: int) -> list[int]:
    """Elements read from the request's output tokens and carried by its outputs, per step."""
    rid = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=max_tokens,
                                                          ignore_eos=True))
    request = engine.scheduler.requests[rid]
    request.output_token_ids = CountingList(request.output_token_ids)
    CountingList.read = 0
    counts, generated = [], 0
    while engine.has_unfinished():
        before = CountingList.read
        carried = 0
        for out in engine.step():
            carried += len(out.new_token_ids)
        generated += carried
        counts.append(CountingList.read - before + carried)
    assert generated == max_tokens
    return counts


def sim_engine() -> Engine:
    """A simulated runner over a shape with positions for 8,192 generated tokens."""
    config = EngineConfig(model="synthetic:1b", device="cpu", dtype="float32",
                          kv_cache_bytes=1 << 30, max_num_batched_tokens=256)
    target = SimTarget(spec="flat", device="sim:flat", dtype="float32",
                       peaks=DevicePeaks("flat", 1e12, 1e11, "a test"),
                       kv_cache_bytes=config.kv_cache_bytes, predict=lambda shape: 1e-3,
                       source="a flat step time")
    return simulated_engine(config, target, VirtualClock())


@pytest.mark.parametrize(("make", "max_tokens"), [
    (sim_engine, 8192),
    pytest.param(lambda: Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                                             dtype="float32", max_num_batched_tokens=256)),
                 1500, marks=pytest.mark.slow),  # 1,500 real decode steps
], ids=["simulated-8192", "tiny-model-1500"])
def test_a_long_generations_per_step_work_stays_flat(make: Any, max_tokens: int) -> None:
    engine = make()
    block_size = engine.blocks.block_size
    counts = per_step_reads(engine, max_tokens)
    # the first step prefills and samples; every step after it decodes one token, and reads
    # a block's tokens to hash it for the prefix cache when the token fills that block
    decode_steps = counts[1:]
    assert len(decode_steps) == max_tokens - 1
    first, last = decode_steps[:256], decode_steps[-256:]
    assert max(first) == max(last) <= 2 + block_size
    assert sum(decode_steps) < 3 * len(decode_steps)
