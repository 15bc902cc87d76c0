"""The token-budget scheduler: one budget a step, decodes first, stall-free chunked prefill;
and, after the step, its bookkeeping (`update`: progress, tokens, stop conditions, freeing).

Each step spends `max_num_batched_tokens` (vLLM V1): every runnable decode takes one token,
then prefills in progress, then waiting requests, their chunks cut to what is left and
rounded to a multiple of `chunk_tile` (pitfall 4). Up to `max_prefill_chunks` prefills
share a step. Seed 000 §4's modes gate prefill: CACHE_PRESSURE_WAIT (KV usage at the high
watermark: decodes only until evictions bring usage under the low watermark) and
BANDWIDTH_THROTTLE (5 s bandwidth average: concurrency 2, then 1, then new prefills paused).
When blocks run out a decode preempts by RECOMPUTE the lowest-priority, latest arrival, and
nothing new is admitted in that step.

Waiting bound (tests/test_scheduler_properties.py): admission is FCFS by (priority,
arrival), a request's priority being its own plus its tenant's `tenant_priorities` entry; a
later request goes before a queued earlier one only through a higher priority, tenant shares,
or as a whole prompt shorter than a tile in budget the earlier one cannot use. With N requests
queued at once, one tenant, chunking on and a pool that holds them all, request i's first
chunk comes within floor(A_i / c) + floor(a_i / S) steps: A_i prompt tokens and a_i requests
ahead of it, c = budget - (N - 1) - (chunk_tile - 1), S = max_prefill_chunks.
"""

from __future__ import annotations

import math
from bisect import insort
from collections import defaultdict, deque
from collections.abc import Callable, Iterable

from engine.config import EngineConfig
from engine.core.batch import (
    Batch,
    ModelRunnerOutput,
    RequestOutput,
    ScheduledChunk,
    SchedulerMode,
    StepShape,
    StepTiming,
)
from engine.core.block_manager import BlockManager
from engine.core.request import ChunkTiming, Request, RequestState
from engine.events import (
    CacheEvict,
    ChunkComplete,
    Event,
    FailCause,
    Failed,
    Finished,
    ModeChanged,
    Preempted,
    SlowQuery,
    TokensGenerated,
)
from engine.ops.telemetry import BandwidthSource

RECENT_FINISHED = 64  # ended requests still shown in snapshots
# throttle level -> chunk concurrency cap (level 3 also pauses new prefills)
THROTTLE_CONCURRENCY = {0: None, 1: 2, 2: 1, 3: 1}


Cost = Callable[[StepShape], float]


class Scheduler:
    """Owns every live request: `schedule` picks a step's batch, `update` books its result.

    `predict` (seconds) and `bytes_moved` are the engine's cost model for a step shape; the
    end-of-sequence ids and `max_model_len` are the model's stop conditions."""

    def __init__(self, config: EngineConfig, blocks: BlockManager, bandwidth: BandwidthSource,
                 predict: Cost, publish: Callable[[Event], None], clock: Callable[[], float],
                 *, bytes_moved: Cost, eos_token_ids: Iterable[int],
                 max_model_len: int) -> None:
        self.config = config
        self.blocks = blocks
        self.bandwidth = bandwidth
        self.predict = predict
        self.bytes_moved = bytes_moved
        self.publish = publish
        self.clock = clock
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # live: waiting, running or preempted
        self.recent: deque[Request] = deque(maxlen=RECENT_FINISHED)  # ended, newest last
        self.waiting: list[Request] = []  # sorted by _queue_key
        self.running: list[Request] = []  # admission order
        self.mode = SchedulerMode.NORMAL
        self.throttle_level = 0
        self.cache_pressure = False
        self.prefill_paused = False  # degraded path (protection layer 6) when set by guards
        self.auto_budget: int | None = None  # set each step by the engine when auto_budget
        self._above_pause_since: float | None = None
        self.bandwidth_util = 0.0

    # --- queues -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.id] = request
        request.set_state(RequestState.WAITING, "queued")
        insort(self.waiting, request, key=self._queue_key)

    def finish(self, request: Request, state: RequestState, reason: str,
               cause: FailCause | None = None) -> None:
        """End a live request (FINISHED, or FAILED with its cause): its blocks go back to the
        pool and its end is published. A request that already ended is left alone."""
        if self.requests.pop(request.id, None) is None:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        freed = self.blocks.release(request)
        request.set_state(state, reason)
        request.finish_time = self.clock()
        self.recent.append(request)
        if state is RequestState.FAILED:
            self.publish(Failed(request_id=request.id, reason=reason,
                                cause=cause or FailCause.FAULT))
        else:
            self.publish(Finished(
                request_id=request.id, reason=reason, prompt_tokens=request.num_prompt_tokens,
                generated_tokens=len(request.output_token_ids), ttft_s=request.ttft_s,
                e2e_s=request.finish_time - request.arrival, budget_score=request.budget_score))
        self.publish(CacheEvict(request_id=request.id, blocks_freed=freed,
                                usage_after=self.blocks.usage))

    def set_config(self, config: EngineConfig) -> None:
        """Take a new configuration at a step boundary; tenant priorities reorder the queue."""
        reorder = config.tenant_priorities != self.config.tenant_priorities
        self.config = config
        if reorder:
            self.waiting.sort(key=self._queue_key)

    @property
    def token_budget(self) -> int:
        """This step's token budget: the configured one, or the engine's live C* choice."""
        if self.config.auto_budget and self.auto_budget is not None:
            return self.auto_budget
        return self.config.max_num_batched_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def decode_load(self) -> tuple[int, int]:
        """(D, S): running decodes and their mean context, the inputs of C*."""
        decodes = [r for r in self.running if r.is_decoding]
        if not decodes:
            return 0, 0
        return len(decodes), sum(r.num_tokens for r in decodes) // len(decodes)

    @property
    def chunk_queue_length(self) -> int:
        """Requests with prompt tokens still to prefill: in progress plus waiting."""
        return len(self.waiting) + sum(1 for r in self.running if not r.is_decoding)

    # --- the step -----------------------------------------------------------------------
    def schedule(self) -> Batch:
        self._update_mode()
        batch = Batch(mode=self.mode)
        budget = self._schedule_decodes(batch, self.token_budget)
        self._schedule_prefills(batch, budget)
        return batch

    def _schedule_decodes(self, batch: Batch, budget: int) -> int:
        block_size = self.blocks.block_size
        decoding = RequestState.DECODING
        for request in list(self.running):
            if budget <= 0:
                break
            if request.state is not decoding:
                continue
            # hot path (256 decodes under 1 ms): most decodes still fit their last block
            if request.num_computed_tokens >= len(request.block_table) * block_size:
                while not self.blocks.can_grow(request, 1):
                    victim = self._pick_victim()
                    self._preempt(victim, batch)
                    if victim in (c.request for c in batch.decodes):
                        batch.decodes = [c for c in batch.decodes if c.request is not victim]
                        budget += 1
                    if victim is request:
                        break
                if request.state is RequestState.PREEMPTED:
                    continue
                self.blocks.grow(request, 1)
            batch.decodes.append(ScheduledChunk(request, request.num_computed_tokens, 1))
            budget -= 1
        return budget

    def _schedule_prefills(self, batch: Batch, budget: int) -> None:
        cfg = self.config
        in_progress = sorted((r for r in self.running if r.state is RequestState.PREFILL_CHUNKING),
                             key=self._queue_key)
        slots = cfg.max_prefill_chunks
        cap = THROTTLE_CONCURRENCY[self.throttle_level]
        if cap is not None:
            slots = min(slots, cap)
        # a cap below one tile would round every partial chunk to nothing (pitfall 4), and
        # without chunking a capped prompt could never run whole
        chunk_cap = max(cfg.long_prefill_threshold, cfg.chunk_tile) \
            if cfg.long_prefill_threshold and cfg.chunked_prefill else math.inf
        if self.cache_pressure or self.prefill_paused:
            if batch.decodes and not self.prefill_paused:
                return  # decodes only, until evictions relieve the pressure
            # No decode to free blocks (or the degraded path): keep one prefill moving with
            # minimal chunks so the service never stops.
            slots, chunk_cap = 1, cfg.chunk_tile
        admit = not (batch.preempted or self.cache_pressure or self.throttle_level >= 3)
        candidates = in_progress + (self._admissible() if admit else [])
        plan = self._plan_chunks(candidates, budget, slots, chunk_cap)
        if not plan and not batch.decodes:
            # Nothing decodes, so no block will come back on its own: tenant limits yield
            # first, then the latest partial prefill gives its blocks to the others.
            plan = self._plan_chunks(candidates, budget, slots, chunk_cap, isolate=False)
            while not plan and len(in_progress) > 1:
                victim = self._pick_victim()
                self._preempt(victim, batch)
                in_progress.remove(victim)
                plan = self._plan_chunks(in_progress, budget, slots, chunk_cap, isolate=False)
        if not plan:
            return
        now = self.clock()
        decode_contexts = tuple(c.start + 1 for c in batch.decodes)
        for request, tokens in plan.items():
            if request.state is not RequestState.PREFILL_CHUNKING:
                self._admit(request, tokens, decode_contexts, now)
            chunk = ScheduledChunk(request, request.num_computed_tokens, tokens)
            self.blocks.grow(request, tokens)
            batch.prefills.append(chunk)

    def _admissible(self) -> list[Request]:
        # every running request must fit one decode token in the budget (stall-free)
        limit = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        room = limit - len(self.running)
        return self.waiting[:max(0, room)]

    def _plan_chunks(self, candidates: list[Request], budget: int, slots: int,
                     chunk_cap: float, isolate: bool = True) -> dict[Request, int]:
        """Token counts per request: shares first (pitfall 5), then leftovers, FCFS.

        `isolate=False` drops the tenant limits (budget shares and KV room)."""
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
                if added <= 0:
                    queued = request.state in (RequestState.WAITING, RequestState.PREEMPTED)
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

    def _admit(self, request: Request, first_chunk: int, decode_contexts: tuple[int, ...],
               now: float) -> None:
        self.waiting.remove(request)
        self.running.append(request)
        request.set_state(RequestState.PREFILL_CHUNKING,
                          "recompute after preemption" if request.num_preemptions else "admitted")
        if request.prefill_started is None:
            request.prefill_started = now
            request.budgeted_prefill_s = self._budget_prefill(request, first_chunk,
                                                              decode_contexts)

    def _budget_prefill(self, request: Request, chunk: int,
                        decode_contexts: tuple[int, ...]) -> float:
        """⌈T/C⌉ steps of C tokens beside today's decodes, as the budget model predicts them."""
        total, start = 0.0, 0
        while start < request.num_prompt_tokens:
            size = min(chunk, request.num_prompt_tokens - start)
            total += self.predict(StepShape(prefill=((size, start),),
                                            decode_contexts=decode_contexts))
            start += size
        return total

    # --- after the step -----------------------------------------------------------------
    def update(self, batch: Batch, output: ModelRunnerOutput,
               timing: StepTiming) -> list[RequestOutput]:
        """Book a step's result: prefill progress and chunk records, the sampled tokens
        appended, stop conditions, finished requests' blocks freed. An error in one request's
        sampling, stop check or output fails that request alone (FAILED, cause FAULT); the
        others go on."""
        for chunk in batch.prefills:
            self._record_chunk(chunk, timing)
        for chunk in batch.decodes:
            chunk.request.num_computed_tokens += 1
        outputs = []
        for chunk in batch.sampling:
            request = chunk.request
            error = output.errors.get(request.id)
            if error is None:
                try:
                    token = output.token_ids[request.id]
                    outputs.append(self._append_token(request, token, timing.end))
                    continue
                except Exception as exc:  # fault isolation: it fails this request only
                    error = f"handling its token failed: {type(exc).__name__}: {exc}"
            self.finish(request, RequestState.FAILED, error, FailCause.FAULT)
            outputs.append(request_output(request, ()))
        return outputs

    def stop_reason(self, request: Request, token: int) -> str | None:
        """Why `request` ends after emitting `token` ("stop", "length"), or None."""
        params = request.params
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _record_chunk(self, chunk: ScheduledChunk, timing: StepTiming) -> None:
        request = chunk.request
        request.num_computed_tokens += chunk.num_tokens
        index = len(request.chunks)
        request.chunks.append(ChunkTiming(index, chunk.start, chunk.num_tokens,
                                          timing.duration_s, timing.predicted_s))
        alone = StepShape(prefill=((chunk.num_tokens, chunk.start),))
        self.publish(ChunkComplete(
            request_id=request.id, chunk_index=index, tokens=chunk.num_tokens,
            start=chunk.start, duration_s=timing.duration_s,
            estimated_bytes=self.bytes_moved(alone), predicted_s=timing.predicted_s,
            prefill_done=chunk.samples))

    def _append_token(self, request: Request, token: int, now: float) -> RequestOutput:
        if request.state is RequestState.PREFILL_CHUNKING:
            request.set_state(RequestState.DECODING, "prefill complete")
            if request.prefill_finished is None:
                request.prefill_finished = now
                self._check_slow(request)
        if request.first_token_time is None:
            request.first_token_time = now
        request.output_token_ids.append(token)
        request.last_token_time = now
        self.publish(TokensGenerated(request_id=request.id, token_ids=(token,)))
        reason = self.stop_reason(request, token)
        if reason:
            self.finish(request, RequestState.FINISHED, reason)
        return request_output(request, (token,))

    def _check_slow(self, request: Request) -> None:
        score = request.budget_score
        if score is None or score <= self.config.slow_query_threshold:
            return
        chunks = tuple({"index": c.index, "start": c.start, "tokens": c.tokens,
                        "duration_s": c.duration_s, "predicted_s": c.predicted_s}
                       for c in request.chunks)
        self.publish(SlowQuery(
            request_id=request.id, tenant=request.tenant, budget_score=score,
            prompt_tokens=request.num_prompt_tokens,
            prefill_s=request.prefill_finished - request.prefill_started,
            budgeted_s=request.budgeted_prefill_s or 0.0, chunks=chunks,
            config=self.config.live_values(), tag=request.tag))

    # --- preemption ---------------------------------------------------------------------
    def _pick_victim(self) -> Request:
        """Lowest priority, latest arrival; requests preempted often are protected."""
        protect = self.config.preempt_protect_after
        candidates = [r for r in self.running if r.num_preemptions < protect] or self.running
        # equal arrivals: the latest admitted goes, as the waiting queue orders ties
        return min(reversed(candidates), key=lambda r: (self._priority(r), -r.arrival))

    def _preempt(self, victim: Request, batch: Batch) -> None:
        discarded = victim.num_computed_tokens
        self.running.remove(victim)
        self.blocks.release(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.set_state(RequestState.PREEMPTED, "KV blocks exhausted; will recompute")
        insort(self.waiting, victim, key=self._queue_key)
        batch.preempted.append(victim)
        self.publish(Preempted(request_id=victim.id, reason=victim.reason,
                               tokens_discarded=discarded))

    # --- modes --------------------------------------------------------------------------
    def _update_mode(self) -> None:
        cfg = self.config
        usage = self.blocks.usage
        if self.cache_pressure and usage < cfg.cache_low_watermark:
            self.cache_pressure = False
        elif not self.cache_pressure and usage >= cfg.cache_high_watermark:
            self.cache_pressure = True
        now = self.clock()
        util = self.bandwidth.reading().util_5s
        self.bandwidth_util = util
        if util > cfg.bandwidth_pause:
            self._above_pause_since = self._above_pause_since or now
        else:
            self._above_pause_since = None
        level = 0
        if self._above_pause_since is not None and now - self._above_pause_since >= \
                cfg.bandwidth_pause_s:
            level = 3
        elif util > cfg.bandwidth_throttle_1:
            level = 2
        elif util > cfg.bandwidth_throttle_2:
            level = 1
        if self.cache_pressure:
            mode = SchedulerMode.CACHE_PRESSURE_WAIT
        elif level:
            mode = SchedulerMode.BANDWIDTH_THROTTLE
        else:
            mode = SchedulerMode.NORMAL
        if mode is not self.mode or level != self.throttle_level:
            reason = (f"kv usage {usage:.2f}, bandwidth 5s avg {util:.2f}, "
                      f"throttle level {level}")
            self.publish(ModeChanged(old=self.mode.value, new=mode.value, reason=reason))
            self.mode, self.throttle_level = mode, level

    def _priority(self, request: Request) -> int:
        """The request's own priority plus its tenant's entry in tenant_priorities."""
        return request.priority + self.config.tenant_priorities.get(request.tenant, 0)

    def _queue_key(self, request: Request) -> tuple[int, float]:
        return (-self._priority(request), request.arrival)


def request_output(request: Request, new_tokens: tuple[int, ...]) -> RequestOutput:
    return RequestOutput(request_id=request.id, new_token_ids=new_tokens,
                         token_ids=tuple(request.output_token_ids),
                         finished=request.state.is_final, finish_reason=request.reason
                         if request.state.is_final else None, state=request.state.value)
