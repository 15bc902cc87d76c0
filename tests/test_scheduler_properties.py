"""Scheduler invariants over random workloads and configurations (hypothesis), on the
model-free rig of tests/test_scheduler.py (the real schedule and update) and, fewer times, on
the real engine."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig, SamplingParams
from engine.batch import Batch
from engine.config import ConfigError
from engine.core.request import Request, RequestState
from engine.core.scheduler import THROTTLE_CONCURRENCY
from engine.events import ModeChanged
from tests.test_scheduler import SchedulerRig

FAST = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TENANTS = ("a", "b", "c")


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: int
    max_tokens: int
    priority: int
    tenant: str
    abort_after: int | None  # steps after arrival, or never


@st.composite
def configs(draw: st.DrawFn) -> EngineConfig:
    tile = draw(st.sampled_from([1, 2, 4, 8, 16]))
    low = draw(st.floats(0.3, 0.9))
    pause = draw(st.floats(0.96, 1.0))
    config = EngineConfig(
        model="synthetic:tiny", device="cpu", block_size=draw(st.sampled_from([1, 2, 4, 8])),
        max_num_seqs=draw(st.integers(1, 16)),
        max_num_batched_tokens=draw(st.integers(tile, 160)), chunk_tile=tile,
        chunked_prefill=draw(st.booleans()), max_prefill_chunks=draw(st.integers(1, 5)),
        long_prefill_threshold=draw(st.sampled_from([0, 0, 3, 16, 40])),
        cache_low_watermark=low, cache_high_watermark=draw(st.floats(low + 0.05, 0.99)),
        bandwidth_throttle_2=0.90, bandwidth_throttle_1=0.95, bandwidth_pause=pause,
        bandwidth_pause_s=draw(st.sampled_from([0.0, 0.02, 0.05])),
        preempt_protect_after=draw(st.integers(1, 4)),
        tenant_shares=draw(st.sampled_from([{}, {"a": 0.5}, {"a": 0.7, "b": 0.3},
                                            {"a": 0.2, "b": 0.2, "c": 0.2}])),
    )
    config.validate()
    return config


def arrivals(max_prompt: int) -> st.SearchStrategy[list[Arrival]]:
    return st.lists(st.builds(
        Arrival, step=st.integers(0, 30), prompt=st.integers(1, max_prompt),
        max_tokens=st.integers(1, 12), priority=st.integers(0, 2),
        tenant=st.sampled_from(TENANTS),
        abort_after=st.one_of(st.none(), st.none(), st.integers(0, 20))), min_size=1, max_size=14)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[EngineConfig, int, list[Arrival], list[float]]:
    config = draw(configs())
    # Without chunked prefill a prompt must fit the budget beside a full decode batch, or
    # it can never run (the engine does not reject it: see the report to the lead).
    room = config.max_num_batched_tokens - min(config.max_num_seqs,
                                               config.max_num_batched_tokens)
    max_prompt = 90 if config.chunked_prefill else max(1, room)
    num_blocks = draw(st.integers(4, 96))
    bandwidth = draw(st.lists(st.sampled_from([0.0, 0.5, 0.91, 0.96, 0.99, 1.2]), max_size=40))
    return config, num_blocks, draw(arrivals(max_prompt)), bandwidth


def _snapshot_running(sim: SchedulerRig) -> tuple[list[Request], set[Request]]:
    scheduler = sim.scheduler
    decoding = [r for r in scheduler.running if r.is_decoding]
    queued = set(scheduler.waiting)
    return decoding, queued


@FAST
@given(scenarios())
def test_invariants_hold_for_random_workloads(scenario) -> None:
    config, num_blocks, workload, bandwidth = scenario
    sim = SchedulerRig(config, num_blocks)
    scheduler, blocks, tile = sim.scheduler, sim.blocks, config.chunk_tile
    by_step: dict[int, list[Arrival]] = {}
    for arrival in workload:
        by_step.setdefault(arrival.step, []).append(arrival)
    aborts: dict[int, list[Request]] = {}
    step = 0
    while step <= max(by_step) or scheduler.has_work():
        assert step < 5000, "a request never finished"
        for arrival in by_step.get(step, []):
            request = sim.add(arrival.prompt, arrival.max_tokens, priority=arrival.priority,
                              tenant=arrival.tenant, arrival=sim.now + len(sim.requests) * 1e-6)
            if arrival.abort_after is not None:
                aborts.setdefault(step + arrival.abort_after, []).append(request)
        for request in aborts.pop(step, []):
            if not request.state.is_final:
                sim.finish(request, "aborted")
        util = bandwidth[step] if step < len(bandwidth) else 0.0
        sim.bandwidth.inject(util, until_s=sim.now + 1.0)
        decoding, queued = _snapshot_running(sim)
        mode, level, changes = scheduler.mode, scheduler.throttle_level, len(sim.of(ModeChanged))

        batch = sim.step()

        budget = config.max_num_batched_tokens
        assert batch.num_tokens <= budget
        # every runnable decode runs unless it was preempted
        decoded = {sim.by_id[c.request_id] for c in batch.decodes}
        assert all(r in decoded or r.id in batch.preempted for r in decoding)
        assert all(c.num_tokens == 1 for c in batch.decodes)
        # chunks: whole tiles except a prompt's final remainder, capped, few per step
        cap = THROTTLE_CONCURRENCY[scheduler.throttle_level] or config.max_prefill_chunks
        assert len(batch.prefills) <= min(config.max_prefill_chunks, cap)
        for chunk in batch.prefills:
            assert chunk.num_tokens >= 1
            if sim.by_id[chunk.request_id] not in sim.sampled:
                assert chunk.num_tokens % tile == 0
                assert config.chunked_prefill
            if config.long_prefill_threshold and config.chunked_prefill:
                assert chunk.num_tokens <= max(config.long_prefill_threshold, tile)
        admitted = [r for c in batch.prefills if (r := sim.by_id[c.request_id]) in queued]
        if batch.preempted:
            assert not admitted, "a request was admitted in a step that preempted"
        if not config.tenant_shares and config.chunked_prefill:
            _check_fcfs(batch, admitted, queued, tile,
                        max(tile, budget // config.max_prefill_chunks))
        # every mode change is published
        new = len(sim.of(ModeChanged)) - changes
        changed = (scheduler.mode, scheduler.throttle_level) != (mode, level)
        assert new == (1 if changed else 0)
        # no block leaks: the pool holds exactly the live requests' tables, and enough of them
        live = scheduler.running + scheduler.waiting
        blocks.check_consistent(live)
        assert blocks.num_used == sum(len(r.block_table) for r in live)
        for request in scheduler.running:
            assert len(request.block_table) * blocks.block_size >= request.num_computed_tokens
        assert all(not r.block_table and r.num_computed_tokens == 0 for r in scheduler.waiting)
        step += 1

    assert blocks.num_used == 0
    for request in sim.requests:
        assert request.state in (RequestState.FINISHED, RequestState.REJECTED), request
        assert request.reason
        if request.reason == "length":
            assert len(request.output_token_ids) == request.params.max_tokens


def _check_fcfs(batch: Batch, admitted: list[Request], queued: set[Request], tile: int,
                short: int) -> None:
    """A later request is admitted ahead of a queued earlier one (same or lower priority)
    only as a whole prompt: shorter than a tile, in budget the earlier one could not use, or
    a short one (at most a slot's share of the step, `short`), which goes ahead of long ones."""
    left_behind = [r for r in queued if r.state in (RequestState.WAITING,
                                                    RequestState.PREEMPTED)]
    for request in admitted:
        key = (-request.priority, request.arrival)
        if any((-r.priority, r.arrival) < key for r in left_behind):
            chunk = next(c for c in batch.prefills if c.request_id == request.id)
            assert chunk.start == 0 and (chunk.num_tokens < tile
                                         or (chunk.samples and chunk.num_tokens <= short))


@st.composite
def fcfs_scenarios(draw: st.DrawFn) -> tuple[EngineConfig, list[tuple[int, int, int]]]:
    requests = draw(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 20),
                                       st.integers(0, 2)), min_size=1, max_size=16))
    tile = draw(st.sampled_from([1, 4, 16]))
    n = len(requests)
    config = EngineConfig(model="synthetic:tiny", device="cpu", block_size=4,
                          max_num_seqs=n + draw(st.integers(0, 4)),
                          max_num_batched_tokens=draw(st.integers(n + tile, 300)),
                          chunk_tile=tile, max_prefill_chunks=draw(st.integers(1, 5)))
    config.validate()
    return config, requests


@FAST
@given(fcfs_scenarios())
def test_no_request_waits_longer_than_the_fcfs_bound(scenario) -> None:
    """The waiting bound.

    Setting: N requests all queued before the first step (distinct arrivals, any
    priorities), one tenant and no tenant shares, chunked prefill with no long-prefill cap,
    a KV pool that holds every request whole with usage under the high watermark (so no
    preemption and no CACHE_PRESSURE_WAIT), no bandwidth throttle, max_num_seqs >= N and a
    budget B >= N + chunk_tile.

    Order requests by the queue key (higher priority first, then arrival). For request i,
    let a_i be the number of requests ahead of it and A_i their prompt tokens, and J_i the
    number of other short prompts (at most max(chunk_tile, B // S) tokens). Then the number
    of steps that run before i's first prefill chunk is at most

        floor(A_i / c) + floor(a_i / S) + J_i,   c = B - (N - 1) - (chunk_tile - 1),
                                                  S = max_prefill_chunks.

    Why: decodes take at most N - 1 tokens of a step. A step in which short prompts go
    ahead (short_prefills) finishes at least one of them whole: there are at most J_i such
    steps. In any other step where i gets no chunk, the planner walked the requests ahead
    of it first (partial prefills are always ahead of i: a later request can only jump it
    as a short prompt, which finishes its prefill in that step, or as a whole prompt shorter
    than a tile), and either all S chunk slots went to requests ahead of i and each
    completed its prompt (a chunk cut short by the budget leaves under one tile, so it is
    the other case), or less than one tile of budget was left: at least c prompt tokens
    ahead of i were computed. Each such step therefore removes c tokens from A_i or S
    requests from a_i.
    """
    config, specs = scenario
    n = len(specs)
    needed = sum(-(-(prompt + out) // 4) for prompt, out, _ in specs)
    sim = SchedulerRig(config, num_blocks=math.ceil(needed / 0.8) + 1)
    requests = [sim.add(prompt, out, priority=priority, arrival=index * 1e-3)
                for index, (prompt, out, priority) in enumerate(specs)]
    first_chunk: dict[Request, int] = {}
    for step, batch in enumerate(sim.run()):
        assert not batch.preempted and batch.mode == "NORMAL"
        for chunk in batch.prefills:
            first_chunk.setdefault(sim.by_id[chunk.request_id], step)
    order = sorted(requests, key=lambda r: (-r.priority, r.arrival))
    c = config.max_num_batched_tokens - (n - 1) - (config.chunk_tile - 1)
    short = max(config.chunk_tile,
                config.max_num_batched_tokens // config.max_prefill_chunks)
    shorts = sum(r.num_prompt_tokens <= short for r in requests)
    for position, request in enumerate(order):
        tokens_ahead = sum(r.num_prompt_tokens for r in order[:position])
        jumps = shorts - (request.num_prompt_tokens <= short)
        bound = tokens_ahead // c + position // config.max_prefill_chunks + jumps
        assert first_chunk[request] <= bound, (position, tokens_ahead, c)
        assert request.state is RequestState.FINISHED


# --- the real engine ------------------------------------------------------------------------
ENGINE: Engine | None = None
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # synthetic:tiny: layers × (K, V) × heads × dim × fp32


def _engine() -> Engine:
    global ENGINE
    if ENGINE is None:
        ENGINE = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                     block_size=4, kv_cache_bytes=32 * 4 * KV_BYTES_PER_TOKEN,
                                     max_prefill_tokens=100))
    return ENGINE


engine_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 150), st.integers(1, 10), st.sampled_from(TENANTS)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just("")),
    st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just("")),
    st.tuples(st.just("config"), st.integers(0, 5), st.integers(0, 3), st.just("")),
), min_size=1, max_size=16)

CONFIG_CHANGES = [
    {"max_num_batched_tokens": 16, "chunk_tile": 4}, {"max_num_batched_tokens": 64},
    {"chunk_tile": 1, "long_prefill_threshold": 8}, {"tenant_shares": {"a": 0.6, "b": 0.4}},
    {"max_prefill_chunks": 1, "cache_high_watermark": 0.5, "cache_low_watermark": 0.3},
    {"chunk_tile": 0},  # bad: rejected, nothing changes
]


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(engine_ops)
def test_every_engine_request_ends_with_a_reason(ops) -> None:
    engine = _engine()
    engine.config = engine.config.replace(
        max_num_batched_tokens=32, chunk_tile=4, long_prefill_threshold=0, max_prefill_chunks=4,
        tenant_shares={}, cache_high_watermark=0.85, cache_low_watermark=0.7)
    engine.scheduler.set_config(engine.config)
    ids: list[str] = []
    ended: dict[str, str] = {}

    def collect(outputs) -> None:
        for out in outputs:
            if out.finished:
                assert out.finish_reason and out.state in ("FINISHED", "FAILED", "REJECTED")
                ended[out.request_id] = out.state

    for kind, a, b, tenant in ops:
        if kind == "add":
            ids.append(engine.add_request(list(range(3, 3 + a)), SamplingParams(
                max_tokens=b, ignore_eos=True), tenant=tenant, priority=a % 3))
        elif kind == "step":
            for _ in range(a):
                collect(engine.step())
        elif kind == "abort" and ids:
            engine.abort(ids[a % len(ids)])
        elif kind == "config":
            before = engine.config
            try:
                engine.update_config(**CONFIG_CHANGES[a])
            except ConfigError as error:
                assert error.field == "chunk_tile"
                assert engine.config is before
    for _ in range(3000):
        collect(engine.step())  # also applies a configuration still pending
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert set(ended) == set(ids)
    assert engine.blocks.num_used == 0
