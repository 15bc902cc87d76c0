"""Admission into the running set: FCFS by priority, tenant shares of budget and KV, preemption."""

from __future__ import annotations

import math
from bisect import insort
from collections import defaultdict
from collections.abc import Callable, Iterable

from engine.batch import Batch
from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestState
from engine.events import Event, Preempted, PrefixCacheLookup

QUEUED = (RequestState.WAITING, RequestState.PREEMPTED)


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
        return request.priority + self.config.tenant_priorities.get(request.tenant, 0)

    def admissible(self) -> list[Request]:
        # every running request must fit one decode token in the budget (stall-free)
        limit = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        room = limit - len(self.running)
        return self.waiting[:max(0, room)]

    def plan_chunks(self, candidates: list[Request], budget: int, slots: int,
                     chunk_cap: float, isolate: bool = True) -> dict[Request, int]:
        """Token counts per request: shares first, then leftovers, FCFS; `isolate` tenants."""
        if not candidates:
            return {}
        cfg = self.config
        tile = cfg.chunk_tile
        free_blocks = self.blocks.num_free
        tenants = {r.tenant for r in candidates}
        shared = isolate and len(tenants) > 1 and any(t in cfg.tenant_shares for t in tenants)
        tenant_left = self._tenant_budgets(tenants, budget) if shared else None
        kv_left = self._tenant_kv_room(tenants) if isolate else {}
        plan: dict[Request, int] = {}
        for use_shares in ((True, False) if shared else (False,)):
            for request in candidates:
                if budget < 1:
                    break
                if request not in plan and len(plan) >= slots:
                    continue
                took = 0
                if not request.block_table and request.state in QUEUED:
                    # its cached prefix costs no budget: the plan covers only the rest
                    before = self.blocks.num_free
                    self.blocks.take_cached(request)
                    took = before - self.blocks.num_free
                    free_blocks -= took
                have = plan.get(request, 0)
                want = min(request.num_pending - have, budget, chunk_cap - have)
                if use_shares and tenant_left is not None:
                    want = min(want, tenant_left[request.tenant])
                by_kv = ((len(request.block_table) + free_blocks) * self.blocks.block_size
                         - request.num_computed_tokens - have)
                want = min(want, by_kv, kv_left.get(request.tenant, math.inf))
                total = have + int(max(0, want))
                if total < request.num_pending:
                    # partial chunks are whole tiles; without chunking, whole prompts only
                    total = total // tile * tile if cfg.chunked_prefill else 0
                added = total - have
                if (added <= 0 and request not in plan and request.block_table
                        and request.state in QUEUED):
                    # left out: its cached blocks may be the very ones the others need
                    self.blocks.release(request)
                    request.num_computed_tokens = 0
                    free_blocks += took
                if added <= 0:
                    queued = request.state in QUEUED
                    if queued and by_kv < min(request.num_pending - have, tile):
                        break  # FCFS: the head waits for blocks; later ones do not jump it
                    continue
                plan[request] = total
                budget -= added
                blocks_before = self.blocks.blocks_for(request.num_computed_tokens + have)
                blocks_after = self.blocks.blocks_for(request.num_computed_tokens + total)
                free_blocks -= max(0, blocks_after - max(blocks_before, len(request.block_table)))
                if tenant_left is not None:
                    tenant_left[request.tenant] -= added
                if request.tenant in kv_left:
                    kv_left[request.tenant] -= added
        return plan

    def _tenant_budgets(self, tenants: Iterable[str], budget: int) -> dict[str, float]:
        shares = self.config.tenant_shares
        tenants = list(tenants)
        unassigned = [t for t in tenants if t not in shares]
        rest = max(0.0, 1.0 - sum(shares.get(t, 0.0) for t in tenants))
        default = rest / len(unassigned) if unassigned else 0.0
        return {t: math.floor(shares.get(t, default) * budget) for t in tenants}

    def _tenant_kv_room(self, tenants: Iterable[str]) -> dict[str, float]:
        """Tokens each tenant with a share may still place in the KV pool."""
        shares = self.config.tenant_shares
        if not any(t in shares for t in tenants):
            return {}
        held: dict[str, int] = defaultdict(int)
        for request in self.running:
            held[request.tenant] += len(request.block_table)
        room = {}
        for tenant in tenants:
            if tenant in shares:
                blocks = shares[tenant] * self.blocks.num_blocks - held[tenant]
                room[tenant] = max(0.0, blocks * self.blocks.block_size)
        return room

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
        insort(self.waiting, victim, key=self.queue_key)
        batch.preempted.append(victim.id)
        self.publish(Preempted(request_id=victim.id, reason=victim.reason,
                               tokens_discarded=discarded))
