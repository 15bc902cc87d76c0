"""The step's prefill plan (engine/core/planning.py) is pure: planning changes neither the KV
pool nor a request, whatever the state; and it cuts the same chunks as the plans budget_score
is measured against (engine/budget/plan.py), where no tenant share or KV limit applies."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.budget.plan import PlanRules, _step_chunks
from engine.config import EngineConfig, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.planning import plan_chunks
from engine.core.request import Request, RequestState
from tests.test_scheduler import SchedulerRig

FAST = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def pool_state(pool: BlockManager) -> tuple[object, ...]:
    return (list(pool._front), pool._untouched, list(pool._back), dict(pool._ref_counts),
            dict(pool._hash_of), dict(pool._cached), pool._reserved, list(pool.newly_allocated),
            pool.evictions)


def request_state(request: Request) -> tuple[object, ...]:
    """Everything a plan could change (block_hashes is a memo of the tokens' hashes)."""
    return (request.state, request.reason, request.num_computed_tokens,
            list(request.block_table), request.num_hashed_blocks, request.cached_tokens,
            list(request.output_token_ids), request.num_preemptions)


@st.composite
def rig_states(draw: st.DrawFn) -> tuple[SchedulerRig, int, int, float, bool]:
    tile = draw(st.sampled_from([1, 4, 8]))
    config = EngineConfig(
        model="synthetic:tiny", device="cpu", block_size=draw(st.sampled_from([2, 4])),
        max_num_batched_tokens=draw(st.integers(tile + 8, 96)), chunk_tile=tile,
        chunked_prefill=draw(st.booleans()), max_prefill_chunks=draw(st.integers(1, 4)),
        max_num_seqs=draw(st.integers(2, 8)),
        tenant_shares=draw(st.sampled_from([{}, {"a": 0.5}, {"a": 0.6, "b": 0.3}])))
    rig = SchedulerRig(config, num_blocks=draw(st.integers(6, 48)))
    shared = [11 + i for i in range(draw(st.integers(1, 24)))]  # a prefix several prompts share
    for step in range(draw(st.integers(0, 12))):
        for _ in range(draw(st.integers(0, 3))):
            tail = draw(st.integers(1, 40))
            request = rig.add(1, max_tokens=draw(st.integers(1, 6)),
                              tenant=draw(st.sampled_from("abc")))
            request.prompt_token_ids = (shared if draw(st.booleans()) else [step]) + [7] * tail
            if rig.blocks.num_blocks * config.block_size <= \
                    request.num_tokens + request.params.max_tokens:
                rig.finish(request, "aborted")  # it could never fit the pool
        rig.step()
    budget = draw(st.integers(0, config.max_num_batched_tokens))
    return (rig, budget, draw(st.integers(1, 4)), draw(st.sampled_from([float("inf"), 8.0])),
            draw(st.booleans()))


@FAST
@given(rig_states())
def test_planning_changes_neither_the_pool_nor_the_requests(state) -> None:
    rig, budget, slots, cap, isolate = state
    scheduler = rig.scheduler
    in_progress = [r for r in scheduler.running if r.state is RequestState.PREFILL_CHUNKING]
    candidates = in_progress + scheduler.admission.admissible()
    pool, live = pool_state(rig.blocks), [request_state(r) for r in rig.requests]
    plan = plan_chunks(candidates, budget, slots, cap, rig.config, scheduler.running,
                       rig.blocks, isolate)
    assert pool_state(rig.blocks) == pool
    assert [request_state(r) for r in rig.requests] == live
    assert len(plan.prefills) <= slots and sum(p.tokens for p in plan.prefills) <= budget
    # and what it planned can be allocated: the scheduler's one allocation never fails
    for prefill in plan.prefills:
        if prefill.cached:
            assert rig.blocks.take_cached(prefill.request) == prefill.start
    for prefill in plan.prefills:
        assert rig.blocks.allocate(prefill.request, prefill.tokens) is not None


@st.composite
def prefill_states(draw: st.DrawFn) -> tuple[list[Request], int, PlanRules]:
    tile = draw(st.sampled_from([1, 2, 4, 16]))
    rules = PlanRules(budget=draw(st.integers(1, 300)), tile=tile,
                      slots=draw(st.integers(1, 5)),
                      chunk_cap=draw(st.sampled_from([float("inf"), max(tile, 12), 64])),
                      chunked=draw(st.booleans()))
    requests = []
    for i in range(draw(st.integers(1, 8))):
        prompt = draw(st.integers(1, 400))
        request = Request(id=f"r{i}", prompt_token_ids=[7] * prompt,
                          params=SamplingParams(max_tokens=4), arrival=float(i))
        if draw(st.booleans()) and prompt > tile:  # already chunking: whole tiles done
            request.state = RequestState.PREFILL_CHUNKING
            request.num_computed_tokens = draw(st.integers(1, (prompt - 1) // tile)) * tile
        requests.append(request)
    requests.sort(key=lambda r: r.state is not RequestState.PREFILL_CHUNKING)  # in flight first
    return requests, draw(st.integers(0, rules.budget)), rules


@FAST
@given(prefill_states())
def test_the_scheduler_and_the_budget_plan_cut_the_same_chunks(state) -> None:
    requests, decodes, rules = state
    config = EngineConfig(model="synthetic:tiny", device="cpu", chunk_tile=rules.tile,
                          chunked_prefill=rules.chunked)
    pool = BlockManager(100_000, 4, enable_caching=False)  # no KV limit
    running = [r for r in requests if r.state is RequestState.PREFILL_CHUNKING]
    plan = plan_chunks(requests, rules.budget - decodes, rules.slots, rules.chunk_cap, config,
                       running, pool)
    scheduled = {p.request.id: p.tokens for p in plan.prefills}
    assert all(p.start == p.request.num_computed_tokens for p in plan.prefills)
    position = {r.id: r.num_computed_tokens for r in requests}
    end = {r.id: r.num_tokens for r in requests}
    planned = _step_chunks([r.id for r in requests], position, end, decodes, rules)
    if scheduled:
        assert planned == scheduled
    else:  # the scheduler waits; the plan moves its head on by a tile, as time will
        assert list(planned) == [requests[0].id]
