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
import statistics
from array import array
from bisect import insort
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import asdict

from engine.batch import (
    Batch,
    ModelRunnerOutput,
    RequestOutput,
    ScheduledChunk,
    SchedulerMode,
    StepShape,
    StepTiming,
)
from engine.budget.plan import PlanItem, PlanRules, plan_prefills, replanned
from engine.config import EngineConfig
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
    PrefixCacheLookup,
    SlowQuery,
    TokensGenerated,
)
from engine.ops.telemetry import BandwidthSource
from engine.ops.timeline import ModeRecord, PrefillGaps, StepRecord, classify_prefill, explain

RECENT_FINISHED = 64  # ended requests still shown in snapshots
# steps and mode changes kept to explain a slow prefill (one small tuple each; a prefill longer
# than the log classes its earliest gaps by the mode log alone)
STEP_LOG = 65536
MODE_LOG = 4096
OVERHEAD_STEPS = 64  # steps whose median overhead the prefill plans add to each step
QUEUED = (RequestState.WAITING, RequestState.PREEMPTED)
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
                 max_model_len: int,
                 decode: Callable[[list[int]], str] = lambda ids: "") -> None:
        self.config = config
        self.blocks = blocks
        self.bandwidth = bandwidth
        self.predict = predict
        self.bytes_moved = bytes_moved
        self.publish = publish
        self.clock = clock
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode = decode  # the tokenizer's: stop strings match on the text
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
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG)
        self.mode_log: deque[ModeRecord] = deque(maxlen=MODE_LOG)
        # live requests flagged slow, with their prefill's gaps classed (published at the end)
        self.flagged: dict[str, PrefillGaps] = {}
        self.steps = 0  # steps booked by `update`
        # No plan, so no budget_score or slow query, until the predictor is calibrated
        # (engine.harness.calibrate.apply sets it).
        self.calibrated = False
        self._plan_rules: PlanRules | None = None  # the rules the plans in force assume
        # plan_rules()'s last answer, with the configuration and the budget it was made for
        self._rules_made: tuple[EngineConfig, int, PlanRules] | None = None
        # set by the engine: each recent step's time beyond the forward pass, and how far
        # steps run from the predictor lately (engine.budget.predictor.StepTimeRatio)
        self.overheads: deque[float] = deque(maxlen=OVERHEAD_STEPS)
        self.step_scale = 1.0

    @property
    def step_overhead_s(self) -> float:
        """The median recent overhead, taken when a plan reads it rather than every step."""
        return statistics.median(self.overheads) if self.overheads else 0.0

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
        if state is RequestState.FAILED and request.prefill_finished is None:
            self._check_slow(request, request.finish_time)  # failed mid-prefill (a guard)
        gaps = self.flagged.pop(request.id, None)
        if gaps is not None:
            self._publish_slow(request, gaps)
        if state is RequestState.FAILED:
            self.publish(Failed(request_id=request.id, reason=reason,
                                cause=cause or FailCause.FAULT))
        else:
            self.publish(Finished(
                request_id=request.id, reason=reason, prompt_tokens=request.num_prompt_tokens,
                generated_tokens=len(request.output_token_ids), ttft_s=request.ttft_s,
                e2e_s=request.finish_time - request.arrival, budget_score=request.budget_score,
                queue_wait_s=None if request.prefill_started is None
                else request.prefill_started - request.arrival))
        self.publish(CacheEvict(request_id=request.id, blocks_freed=freed,
                                usage_after=self.blocks.usage))

    def set_config(self, config: EngineConfig) -> None:
        """Take a new configuration at a step boundary; tenant priorities reorder the queue."""
        reorder = config.tenant_priorities != self.config.tenant_priorities
        if config.enable_prefix_caching != self.config.enable_prefix_caching:
            self.blocks.set_caching(config.enable_prefix_caching)
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
        state = (self.mode.value, self.throttle_level, self.prefill_paused)
        if not self.mode_log or self.mode_log[-1][1:] != state:
            self.mode_log.append(ModeRecord(self.clock(), *state))
        batch = Batch(mode=self.mode)
        budget = self._schedule_decodes(batch, self.token_budget)
        rules = self.plan_rules()  # once a step: the retune check and the chunk cap read it
        self._replan_if_retuned(rules, batch)
        self._schedule_prefills(batch, budget, rules.chunk_cap)
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
            batch.decodes.append(ScheduledChunk.of(request, request.num_computed_tokens, 1))
            budget -= 1
        return budget

    def _schedule_prefills(self, batch: Batch, budget: int, chunk_cap: float) -> None:
        cfg = self.config
        chunking = RequestState.PREFILL_CHUNKING
        in_progress = [r for r in self.running if r.state is chunking]
        if len(in_progress) > 1:
            in_progress.sort(key=self._queue_key)
        slots = cfg.max_prefill_chunks
        cap = THROTTLE_CONCURRENCY[self.throttle_level]
        if cap is not None:
            slots = min(slots, cap)
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
        fresh = []
        for request, tokens in plan.items():
            if request.state is not RequestState.PREFILL_CHUNKING and self._admit(request, now):
                fresh.append(request)
            chunk = ScheduledChunk(request, request.num_computed_tokens, tokens)
            self.blocks.grow(request, tokens)
            batch.prefills.append(chunk)
        if fresh:  # a new arrival shares the budget: everyone's plan changes
            self._replan(tuple(c.start + 1 for c in batch.decodes), fresh)

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
                    # left out: a waiting request holds no block (its cached ones may be
                    # the very blocks the others need)
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

    def _admit(self, request: Request, now: float) -> bool:
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
        request.last_chunk_step = self.steps
        return True

    # --- the prefill plan budget_score is measured against (engine.budget.plan) ---------
    def plan_rules(self) -> PlanRules:
        """The normal-mode rules this step's budget and configuration set."""
        cfg, budget = self.config, self.token_budget
        made = self._rules_made
        # read every step: made again only when the configuration or the budget changed
        if made is not None and made[0] is cfg and made[1] == budget:
            return made[2]
        # a cap below one tile would round every partial chunk to nothing (pitfall 4), and
        # without chunking a capped prompt could never run whole
        cap = max(cfg.long_prefill_threshold, cfg.chunk_tile) \
            if cfg.long_prefill_threshold and cfg.chunked_prefill else math.inf
        rules = PlanRules(budget=budget, tile=cfg.chunk_tile, slots=cfg.max_prefill_chunks,
                          chunk_cap=cap, chunked=cfg.chunked_prefill)
        self._rules_made = (cfg, budget, rules)
        return rules

    def _replan_if_retuned(self, rules: PlanRules, batch: Batch) -> None:
        """A tuning change (configuration, the auto budget's C*) re-plans what is in flight,
        beside the batch's decodes."""
        if rules is not self._plan_rules and rules != self._plan_rules:
            self._plan_rules = rules
            self._replan(tuple(c.start + 1 for c in batch.decodes), ())

    def _replan(self, decode_contexts: tuple[int, ...], fresh: Iterable[Request]) -> None:
        """Plan every prefill in flight from where it stands, beside `decode_contexts`.

        Every running prefill is simulated (it shares the steps), but only a plan made since
        calibration and never broken by a preemption is replaced: a request admitted before
        the first calibration gets no verdict, and one preempted mid-prefill keeps the plan
        it had, so the recompute counts as overrun."""
        if not self.calibrated:
            return
        fresh = set(fresh)
        prefilling = sorted((r for r in self.running if r.state is RequestState.PREFILL_CHUNKING),
                            key=self._queue_key)
        if not prefilling:
            return
        rules = self._plan_rules = self.plan_rules()
        items = [PlanItem(r, r.num_computed_tokens, r.num_tokens) for r in prefilling]
        scale, overhead = self.step_scale, self.step_overhead_s
        plans = plan_prefills(items, decode_contexts, rules,
                              lambda shape: self.predict(shape) * scale + overhead)
        for request in prefilling:
            if request in fresh:
                request.planned = plans[request]
            elif request.planned and not request.num_preemptions:
                request.planned = replanned(request.planned, request.num_computed_tokens,
                                            self.steps - request.last_chunk_step,
                                            plans[request])
                request.replans += 1

    # --- after the step -----------------------------------------------------------------
    def update(self, batch: Batch, output: ModelRunnerOutput,
               timing: StepTiming) -> list[RequestOutput]:
        """Book a step's result: prefill progress and chunk records, the sampled tokens
        appended, stop conditions, finished requests' blocks freed. An error in one request's
        sampling, stop check or output fails that request alone (FAILED, cause FAULT); the
        others go on."""
        self.steps += 1
        start = timing.end - timing.duration_s
        prefill_tokens = batch.shape().prefill_tokens
        self.step_log.append(StepRecord(start, timing.end, self.steps, batch.mode.value,
                                     self.throttle_level, self.prefill_paused,
                                     tuple([c.request.id for c in batch.prefills]),
                                     len(batch.decodes)))
        cache = self.blocks.cache_full_blocks
        for chunk in batch.prefills:
            self._record_chunk(chunk, timing, start, len(batch.decodes),
                               prefill_tokens - chunk.num_tokens, batch.mode.value)
            cache(chunk.request)
        for request_id, (first, scored) in output.prompt_logprobs.items():
            request = self.requests[request_id]
            # a recomputed prefill (after a preemption) scores positions already kept
            request.prompt_logprobs += scored[max(0, len(request.prompt_logprobs) + 1 - first):]
        block_size = self.blocks.block_size
        for chunk in batch.decodes:
            request = chunk.request
            request.num_computed_tokens += 1
            # a decode fills a block only on its last slot: register it (and any block a
            # cache that was off left unregistered) then, not on every token
            if not request.num_computed_tokens % block_size:
                cache(request)
        outputs = []
        for chunk in batch.sampling:
            request = chunk.request
            error = output.errors.get(request.id)
            if error is None:
                try:
                    token = (None if request.params.prefill_only
                             else output.token_ids[request.id])
                    if request.id in output.logprobs:
                        request.logprobs.append(output.logprobs[request.id])
                    outputs.append(self._append_token(request, token, timing))
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
        if params.stop and request.match_stop(self.decode(request.output_token_ids)
                                              .rstrip("\ufffd")):
            return "stop"
        generated = len(request.output_token_ids)
        if generated >= params.max_tokens:
            return "length"
        if len(request.prompt_token_ids) + generated >= self.max_model_len:  # num_tokens
            return "length"
        return None

    def _record_chunk(self, chunk: ScheduledChunk, timing: StepTiming, start: float,
                      decodes: int, other_tokens: int, mode: str) -> None:
        request = chunk.request
        request.num_computed_tokens += chunk.num_tokens
        request.last_chunk_step = self.steps
        index = len(request.chunks)
        request.chunks.append(ChunkTiming(index, chunk.start, chunk.num_tokens,
                                          timing.duration_s, timing.predicted_s, start,
                                          self.steps, decodes, other_tokens, mode,
                                          self.throttle_level, request.num_preemptions))
        alone = StepShape(prefill=((chunk.num_tokens, chunk.start),))
        self.publish(ChunkComplete(
            request_id=request.id, chunk_index=index, tokens=chunk.num_tokens,
            start=chunk.start, duration_s=timing.duration_s,
            estimated_bytes=self.bytes_moved(alone), predicted_s=timing.predicted_s,
            prefill_done=chunk.samples))

    def _append_token(self, request: Request, token: int | None,
                      timing: StepTiming) -> RequestOutput:
        """Book `token` after the request's last chunk or decode; None ends a prefill-only
        (scoring) request there, its prompt computed and nothing generated."""
        now = timing.end
        if request.state is RequestState.PREFILL_CHUNKING:
            request.set_state(RequestState.DECODING, "prefill complete")
            if request.prefill_finished is None:
                request.prefill_finished = now
                self._check_slow(request, now)
        if token is None:
            self.finish(request, RequestState.FINISHED, "length")
            return request_output(request, ())
        if request.first_token_time is None:
            request.first_token_time = now
        elif request.decode_gaps is not None and request.last_token_time is not None:
            gap = now - request.last_token_time
            request.decode_gaps.append(gap)
            if request.worst_gap is None or gap > request.worst_gap[0]:
                request.worst_gap = (gap, self.steps)
        request.output_token_ids.append(token)
        request.last_token_time = now
        self.publish(TokensGenerated.of(request.id, (token,), now))
        reason = self.stop_reason(request, token)
        if reason:
            self.finish(request, RequestState.FINISHED, reason)
        return request_output(request, (token,))

    def _check_slow(self, request: Request, end: float) -> None:
        """Flag a request whose prefill (ended at `end`, or cut short there by a failure)
        overran its budget; its gaps are classed now, while the step log covers them, and
        the slow query is published when it ends."""
        budget = request.budgeted_prefill_s
        if not budget or request.prefill_started is None:
            return
        if not self.config.is_slow_query(end - request.prefill_started, budget):
            return
        first = request.arrival  # its queue wait is classed too
        steps = []
        for step in reversed(self.step_log):  # only the steps since its arrival
            steps.append(step)
            if step.start <= first:
                break
        steps.reverse()
        request.decode_gaps = array("d")
        self.flagged[request.id] = classify_prefill(request, steps, list(self.mode_log), end,
                                                    self.step_overhead_s)

    def _publish_slow(self, request: Request, gaps: PrefillGaps) -> None:
        timeline = explain(request, gaps)
        verdict = timeline.verdict()
        if request.state is RequestState.FAILED:
            verdict += f"; then failed: {request.reason}"
        self.publish(SlowQuery(
            request_id=request.id, tenant=request.tenant,
            budget_score=timeline.prefill_s / timeline.budgeted_s,
            prompt_tokens=request.num_prompt_tokens, prefill_s=timeline.prefill_s,
            budgeted_s=timeline.budgeted_s, chunks=tuple(asdict(c) for c in timeline.chunks),
            config=self.config.live_values(), tag=request.tag,
            # its chunks travel once, in the record's own chunks column
            timeline={k: v for k, v in timeline.to_dict().items() if k != "chunks"},
            cause=timeline.cause.value, cause_share=timeline.cause_share, verdict=verdict,
            cached_tokens=request.cached_tokens))

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
        victim.preempted_at.append(self.clock())
        victim.num_preemptions += 1
        victim.set_state(RequestState.PREEMPTED, "KV blocks exhausted; will recompute")
        insort(self.waiting, victim, key=self._queue_key)
        batch.preempted.append(victim.id)
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
    state = request.state
    final = state.is_final
    # str() of a StrEnum is its value, without the enum's Python-level `value` property
    params = request.params
    if params.logprobs is None and params.prompt_logprobs is None and not params.stop:
        return RequestOutput.of(request.id, new_tokens, final,
                                request.reason if final else None, str(state))
    # the prompt's logprobs go with the first output: nothing was generated before it
    first = len(request.output_token_ids) == len(new_tokens)
    return RequestOutput.of(
        request.id, new_tokens, final, request.reason if final else None, str(state),
        logprobs=(None if params.logprobs is None
                  else tuple(request.logprobs[-len(new_tokens):]) if new_tokens else ()),
        prompt_logprobs=(tuple(request.prompt_logprobs)
                         if params.prompt_logprobs is not None and first else None),
        text_end=request.text_end)
