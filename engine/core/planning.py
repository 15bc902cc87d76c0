"""A step's prefill plan: a pure function of the queues, the configuration and the KV pool as it
stands. It takes no block; the scheduler allocates once, after the plan (as vLLM V1's
`allocate_slots`, which says None when it cannot)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.budget.plan import chunk_tokens, short_prefills
from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestState

QUEUED = (RequestState.WAITING, RequestState.PREEMPTED)


@dataclass(frozen=True)
class PlannedPrefill:
    """One prefill's share of the step: `tokens` from `start`; a request entering the running
    set first takes the `cached` prefix blocks (its first `start` tokens)."""

    request: Request
    start: int
    tokens: int
    cached: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefillPlan:
    """The step's prefills in plan order, and the cached prefixes looked up for requests it
    left out (`warmed`, in the order they were let go): they count as used, so a waiting
    request's prefix is the last to be evicted."""

    prefills: tuple[PlannedPrefill, ...] = ()
    warmed: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.prefills)


def plan_chunks(candidates: Sequence[Request], budget: int, slots: int, chunk_cap: float,
                config: EngineConfig, running: Sequence[Request], pool: BlockManager,
                isolate: bool = True) -> PrefillPlan:
    """Token counts per request: tenant shares first, then leftovers, FCFS but short prompts
    first (short_prefills), within the budget, the chunk slots and the free KV blocks;
    `isolate` keeps tenants to their shares.
    Reads the pool (its free count and cached prefixes) and changes nothing."""
    if not candidates:
        return PrefillPlan()
    candidates = _short_first(candidates, budget, slots, config, pool)
    tile, block_size = config.chunk_tile, pool.block_size
    free_blocks = pool.num_free
    tenants = {r.tenant for r in candidates}
    shared = isolate and len(tenants) > 1 and any(t in config.tenant_shares for t in tenants)
    tenant_left = _tenant_budgets(config, tenants, budget) if shared else None
    kv_left = _tenant_kv_room(config, tenants, running, pool) if isolate else {}
    totals: dict[Request, int] = {}  # planned tokens, in plan order
    starts: dict[Request, int] = {}
    prefixes: dict[Request, tuple[int, ...]] = {}
    claimed: set[int] = set()  # free cached blocks the plan's prefixes hold
    warmed: list[int] = []
    for use_shares in ((True, False) if shared else (False,)):
        for request in candidates:
            if budget < 1:
                break
            if request not in totals and len(totals) >= slots:
                continue
            prefix: tuple[int, ...] = prefixes.get(request, ())
            took: list[int] = []
            if request not in totals and not request.block_table and request.state in QUEUED:
                # its cached prefix costs no budget: the plan covers only the rest
                prefix = pool.cached_prefix(request)
                took = [b for b in prefix if pool.is_free(b) and b not in claimed]
                claimed.update(took)
                free_blocks -= len(took)
            start = len(prefix) * block_size if prefix else request.num_computed_tokens
            table = len(request.block_table) + len(prefix)
            pending = request.num_tokens - start
            have = totals.get(request, 0)
            room = min(budget, chunk_cap - have)
            if use_shares and tenant_left is not None:
                room = min(room, tenant_left[request.tenant])
            by_kv = (table + free_blocks) * block_size - start - have
            room = min(room, by_kv, kv_left.get(request.tenant, math.inf))
            total = have + chunk_tokens(pending - have, room, tile, config.chunked_prefill)
            added = total - have
            if added <= 0:
                if took:  # left out: its cached blocks may be the very ones the others need
                    claimed.difference_update(took)
                    free_blocks += len(took)
                    warmed.extend(reversed(took))
                if request.state in QUEUED and by_kv < min(pending - have, tile):
                    break  # FCFS: the head waits for blocks; later ones do not jump it
                continue
            totals[request] = total
            starts[request] = start
            prefixes[request] = prefix
            budget -= added
            blocks_before = pool.blocks_for(start + have)
            blocks_after = pool.blocks_for(start + total)
            free_blocks -= max(0, blocks_after - max(blocks_before, table))
            if tenant_left is not None:
                tenant_left[request.tenant] -= added
            if request.tenant in kv_left:
                kv_left[request.tenant] -= added
    return PrefillPlan(tuple(PlannedPrefill(r, starts[r], n, prefixes[r])
                             for r, n in totals.items()), tuple(warmed))


def rank(request: Request, config: EngineConfig) -> int:
    """A request's priority with its tenant's added: the order admission and preemption
    follow, and which no short prompt may jump."""
    return request.priority + config.tenant_priorities.get(request.tenant, 0)


def _short_first(candidates: Sequence[Request], budget: int, slots: int, config: EngineConfig,
                 pool: BlockManager) -> list[Request]:
    """The candidates with those short_prefills picks first. A queued one jumps only while
    the free KV blocks hold it (a queued head waiting for blocks keeps its place), and no one
    jumps a request of a higher priority."""
    if slots < 2 or len(candidates) < 2:
        return list(candidates)
    free = pool.num_free
    folded = [0, -math.inf]  # candidates folded into the highest rank so far, and that rank

    def may_jump(index: int) -> bool:
        nonlocal free
        while folded[0] < index:  # ranks are read only as far as a short one is asked about
            folded[1] = max(folded[1], rank(candidates[folded[0]], config))
            folded[0] += 1
        request = candidates[index]
        if rank(request, config) < folded[1]:
            return False
        if request.state not in QUEUED:
            return True
        need = pool.blocks_for(request.num_pending)
        if need > free:
            return False
        free -= need
        return True

    short = short_prefills((r.num_pending for r in candidates), budget, slots,
                           config.chunk_tile, may_jump)
    if not short:
        return list(candidates)
    picked = set(short)
    return [*(candidates[i] for i in short),
            *(r for i, r in enumerate(candidates) if i not in picked)]


def _tenant_budgets(config: EngineConfig, tenants: Iterable[str], budget: int
                    ) -> dict[str, float]:
    shares = config.tenant_shares
    tenants = list(tenants)
    unassigned = [t for t in tenants if t not in shares]
    rest = max(0.0, 1.0 - sum(shares.get(t, 0.0) for t in tenants))
    default = rest / len(unassigned) if unassigned else 0.0
    return {t: math.floor(shares.get(t, default) * budget) for t in tenants}


def _tenant_kv_room(config: EngineConfig, tenants: Iterable[str], running: Sequence[Request],
                    pool: BlockManager) -> dict[str, float]:
    """Tokens each tenant with a share may still place in the KV pool."""
    shares = config.tenant_shares
    if not any(t in shares for t in tenants):
        return {}
    held: dict[str, int] = defaultdict(int)
    for request in running:
        held[request.tenant] += len(request.block_table)
    room = {}
    for tenant in tenants:
        if tenant in shares:
            blocks = shares[tenant] * pool.num_blocks - held[tenant]
            room[tenant] = max(0.0, blocks * pool.block_size)
    return room
