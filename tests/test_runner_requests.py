"""The scheduler's batch is a message: no live request reaches the runner, and what the
runner keeps of a request goes when the request ends, is aborted or is preempted."""

from __future__ import annotations

import dataclasses
import pickle
import random
from typing import Any

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.batch import Batch, NewRequest, ScheduledChunk, StepShape
from engine.core.model_runner import ModelRunner
from engine.core.request import Request
from engine.events import Preempted


def _engine(**changes: Any) -> Engine:
    config = dict(model="synthetic:tiny", device="cpu", dtype="float32",
                  max_num_batched_tokens=64, block_size=16, chunk_tile=16)
    return Engine(EngineConfig(**(config | changes)))


def _reachable(value: object, seen: set[int]) -> list[object]:
    """Every object reachable from `value` through dataclass fields and containers."""
    if id(value) in seen:
        return []
    seen.add(id(value))
    found = [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        children: list[object] = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        children = [*value.keys(), *value.values()]
    elif isinstance(value, list | tuple | set | frozenset):
        children = list(value)
    else:
        children = []
    for child in children:
        found += _reachable(child, seen)
    return found


def test_a_batch_carries_ids_tokens_and_blocks_never_a_request() -> None:
    engine = _engine(kv_cache_bytes=160 * 1024)
    rng = random.Random(3)
    shared = [rng.randrange(3, 300) for _ in range(40)]  # prefix-cache hits after the first
    for i in range(12):
        engine.add_request(shared + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 50))],
                           SamplingParams(max_tokens=20, ignore_eos=True, seed=i,
                                          temperature=1.0, prompt_logprobs=i % 2 or None))
    batches: list[Batch] = []
    run = engine.runner.run

    def kept(batch: Batch) -> Any:
        batches.append(batch)
        return run(batch)

    engine.runner.run = kept  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
    assert any(b.new_requests for b in batches) and any(b.preempted for b in batches)
    assert any(b.finished for b in batches)
    assert any(c.new_block_ids for b in batches for c in b.decodes)
    for batch in batches:
        parts = _reachable(batch, set())
        assert not any(isinstance(p, Request) for p in parts)
        assert {type(p) for p in parts if dataclasses.is_dataclass(p)} <= {
            Batch, ScheduledChunk, NewRequest, SamplingParams, StepShape}
        # nothing of the scheduler's side is named in the message's pickle
        assert b"engine.core" not in pickle.dumps(batch)


def _held(runner: ModelRunner) -> set[str]:
    return set(runner.requests.held) | set(runner.requests.parked)


@pytest.mark.slow  # a soak: 2,000 requests
def test_the_runner_forgets_every_request_that_ends_is_aborted_or_preempted() -> None:
    """Thousands of requests through a pool small enough to preempt, some aborted: after
    every step the runner holds only running requests and those whose end it has yet to
    hear (told with the next batch that runs)."""
    engine = _engine(kv_cache_bytes=160 * 1024, max_num_seqs=32)
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    scheduler = engine.scheduler
    preempted: list[Preempted] = []
    engine.bus.subscribe(preempted.append, (Preempted,))
    rng = random.Random(11)
    added = aborted = finished = most = 0
    while added < 2000 or engine.has_unfinished():
        for _ in range(rng.randrange(0, 40) if added < 2000 else 0):
            params = SamplingParams(max_tokens=rng.randrange(1, 16), ignore_eos=True,
                                    temperature=1.0, seed=added if added % 2 else None)
            engine.add_request([rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))],
                               params, request_id=f"r{added}")
            added += 1
        live = list(scheduler.requests)
        if live and rng.random() < 0.3:
            aborted += engine.abort(rng.choice(live))
        finished += sum(o.finish_reason == "length" for o in engine.step())
        running = {r.id for r in scheduler.running}
        unheard = set(scheduler.unheard.ended) | set(scheduler.unheard.preempted)
        assert set(runner.requests.held) <= running | unheard
        # a preempted seeded request's generator waits while it waits to run again
        assert set(runner.requests.parked) <= set(scheduler.requests) | unheard
        engine.bus.drain()
        most = max(most, len(_held(runner)))
    assert finished > 1000 and aborted > 100 and len(preempted) > 10 and most <= 64
    # the last step's ends ride on the next batch that runs, which then holds only its own
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="last")
    engine.step()
    assert _held(runner) == {"last"}


def test_a_preempted_request_enters_the_runner_again_with_every_token() -> None:
    """Recompute after a preemption: the runner drops the request's blocks and tokens, and
    its NewRequest brings the prompt and the tokens generated so far; greedy output is the
    one an unpreempted run makes."""
    prompts = [[3 + (7 * i + j) % 290 for j in range(30 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = _engine().generate(prompts, params)
    tight = _engine(kv_cache_bytes=96 * 1024)
    entered: list[NewRequest] = []
    run = tight.runner.run

    def watched(batch: Batch) -> Any:
        entered.extend(n for n in batch.new_requests if n.output_token_ids)
        return run(batch)

    tight.runner.run = watched  # type: ignore[method-assign]
    assert tight.generate(prompts, params) == roomy
    assert entered, "the pool was meant to preempt a decoding request"
