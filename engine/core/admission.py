"""Admission into the running set: FCFS by priority, a plan's one allocation, preemption
(core/planning.py plans the chunks, with tenant shares of budget and KV)."""

from __future__ import annotations

from bisect import insort_left
from collections.abc import Callable

from engine.batch import Batch
from engine.config import EngineConfig
from engine.core.block_manager import BlockError, BlockManager
from engine.core.planning import PrefillPlan, rank
from engine.core.request import Request, RequestState
from engine.events import Event, Preempted, PrefixCacheLookup


class Admission:
    """The waiting queue (sorted by `queue_key`) and the running set (admission order)."""

    def __init__(self, config: EngineConfig, blocks: BlockManager,
                 publish: Callable[[Event], None], clock: Callable[[], float]) -> None:
        self.config = config
        self.blocks = blocks
        self.publish = publish
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def queue_key(self, request: Request) -> tuple[int, float]:
        return (-self.priority(request), request.arrival)

    def priority(self, request: Request) -> int:
        return rank(request, self.config)

    def admissible(self) -> list[Request]:
        # every running request must fit one decode token in the budget (stall-free)
        limit = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        room = limit - len(self.running)
        return self.waiting[:max(0, room)]

    def admit(self, request: Request, now: float, step: int) -> bool:
        """Move a waiting request to running; True at its first admission."""
        self.waiting.remove(request)
        self.running.append(request)
        request.admissions.append(now)
        request.cached_tokens = request.num_computed_tokens
        if self.config.enable_prefix_caching:
            self.publish(PrefixCacheLookup(request_id=request.id, queried_tokens=request.num_tokens,
                                           cached_tokens=request.cached_tokens))
        request.set_state(RequestState.PREFILL_CHUNKING,
                          "recompute after preemption" if request.num_preemptions else "admitted")
        if request.prefill_started is not None:
            return False
        request.prefill_started = now
        request.last_chunk_step = step
        return True

    def allocate(self, plan: PrefillPlan, batch: Batch, step: int) -> list[Request]:
        """The plan's blocks, once, into `batch`: the cached prefixes first (so no allocation
        evicts one), then each prefill's new blocks, admitting those that enter; returns the
        requests admitted for the first time."""
        for prefill in plan.prefills:
            if prefill.cached and self.blocks.take_cached(prefill.request) != prefill.start:
                raise BlockError("a prefill plan's cached prefix changed before allocation")
        now = self.clock()
        fresh = []
        for prefill in plan.prefills:
            request, tokens = prefill.request, prefill.tokens
            entering = request.state is not RequestState.PREFILL_CHUNKING
            if entering and self.admit(request, now, step):
                fresh.append(request)
            new = self.blocks.allocate(request, tokens)
            if new is None:
                raise BlockError("a prefill plan outgrew the free KV blocks")
            if entering:  # the runner gets its whole block table with its tokens
                batch.new_requests.append(request.entering())
            batch.prefills.append(request.chunk(prefill.start, tokens,
                                                () if entering else tuple(new)))
        return fresh

    def pick_victim(self) -> Request:
        """Lowest priority, latest arrival; requests preempted often are protected."""
        protect = self.config.preempt_protect_after
        candidates = [r for r in self.running if r.num_preemptions < protect] or self.running
        # equal arrivals: the latest admitted goes, as the waiting queue orders ties
        return min(reversed(candidates), key=lambda r: (self.priority(r), -r.arrival))

    def preempt(self, victim: Request, batch: Batch) -> None:
        discarded = victim.num_computed_tokens
        self.running.remove(victim)
        self.blocks.release(victim)
        victim.num_computed_tokens = 0
        victim.preempted_at.append(self.clock())
        victim.num_preemptions += 1
        victim.set_state(RequestState.PREEMPTED, "KV blocks exhausted; will recompute")
        # ahead of waiting requests that tie with it, as V1 prepends: behind them, equal
        # arrivals would evict each other's cached prefix and preempt each other in turn
        insort_left(self.waiting, victim, key=self.queue_key)
        batch.preempted.append(victim.id)
        self.publish(Preempted(request_id=victim.id, reason=victim.reason,
                               tokens_discarded=discarded))
