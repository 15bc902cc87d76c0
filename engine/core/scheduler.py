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
from collections import deque
from collections.abc import Callable, Iterable

from engine.batch import (
    Batch,
    ModelRunnerOutput,
    RequestOutput,
    ScheduledChunk,
    SchedulerMode,
    StepShape,
    StepTiming,
)
from engine.budget.controller import BudgetController
from engine.budget.plan import PlanItem, PlanRules, plan_prefills, replanned
from engine.config import EngineConfig
from engine.core.admission import Admission
from engine.core.block_manager import BlockError, BlockManager
from engine.core.equipment import BandwidthSource, PrefillWatch
from engine.core.modes import THROTTLE_CONCURRENCY, Modes
from engine.core.request import ChunkTiming, Request, RequestState
from engine.events import (
    CacheEvict,
    ChunkComplete,
    Event,
    FailCause,
    Failed,
    Finished,
    StepComplete,
    TokensGenerated,
)

RECENT_FINISHED = 64  # ended requests still shown in snapshots


class Scheduler:
    """Owns every live request: `schedule` picks a step's batch, `update` books its result.
    The end-of-sequence ids and `max_model_len` are the model's stop conditions."""

    def __init__(self, config: EngineConfig, blocks: BlockManager, bandwidth: BandwidthSource,
                 controller: BudgetController, publish: Callable[[Event], None],
                 clock: Callable[[], float], *, watch: PrefillWatch,
                 eos_token_ids: Iterable[int], max_model_len: int,
                 decode: Callable[[list[int]], str] = lambda ids: "") -> None:
        self.admission = Admission(config, blocks, publish, clock)
        self.modes = Modes(bandwidth, publish, clock)
        self.bandwidth = bandwidth
        self.controller = controller
        self.watch = watch
        self.publish = publish
        self.clock = clock
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode = decode  # the tokenizer's: stop strings match on the text
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # live: waiting, running or preempted
        self.recent: deque[Request] = deque(maxlen=RECENT_FINISHED)  # ended, newest last
        self.waiting = self.admission.waiting
        self.running = self.admission.running
        self.prefill_paused = False  # the guards' degraded path
        self.steps = 0  # steps booked by `update`
        self._scheduled_at = 0.0  # when the step under way was scheduled
        self._plan_rules: PlanRules | None = None  # the rules the plans in force assume
        # plan_rules()'s last answer, with the configuration and the budget it was made for
        self._rules_made: tuple[EngineConfig, int, PlanRules] | None = None

    @property
    def config(self) -> EngineConfig:
        return self.admission.config

    @property
    def blocks(self) -> BlockManager:
        return self.admission.blocks

    @property
    def mode(self) -> SchedulerMode:
        return self.modes.mode

    @property
    def throttle_level(self) -> int:
        return self.modes.throttle_level

    @property
    def cache_pressure(self) -> bool:
        return self.modes.cache_pressure

    @property
    def bandwidth_util(self) -> float:
        return self.modes.bandwidth_util

    def pause_prefill(self, paused: bool) -> None:
        """The guards' degraded path: one prefill at a time in chunk_tile-sized chunks."""
        self.prefill_paused = paused

    def reset(self, blocks: BlockManager) -> None:
        """An engine restart: every live request leaves, and the KV pool starts empty."""
        for queue in (self.requests, self.waiting, self.running):
            queue.clear()
        self.admission.blocks = blocks
        self.watch.clear()
        self.controller.forget_steps()

    # --- queues -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.id] = request
        request.set_state(RequestState.WAITING, "queued")
        insort(self.waiting, request, key=self.admission.queue_key)

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
            self._prefill_ended(request, request.finish_time)  # failed mid-prefill (a guard)
        self.watch.ended(request, self.config)
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
        self.admission.config = config
        if reorder:
            self.waiting.sort(key=self.admission.queue_key)

    @property
    def token_budget(self) -> int:
        """This step's token budget: the configured one, or the live C* choice."""
        return self.controller.token_budget(self.config)

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
        now = self._scheduled_at = self.clock()
        self.controller.before_step(now, *self.decode_load(), self.config, self.max_model_len)
        self.modes.update(self.config, self.blocks.usage)
        self.watch.mode(self.clock(), self.mode.value, self.throttle_level, self.prefill_paused)
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
                while self.blocks.allocate(request, 1) is None:
                    victim = self.admission.pick_victim()
                    self.admission.preempt(victim, batch)
                    if victim in (c.request for c in batch.decodes):
                        batch.decodes = [c for c in batch.decodes if c.request is not victim]
                        budget += 1
                    if victim is request:
                        break
                if request.state is RequestState.PREEMPTED:
                    continue
            batch.decodes.append(ScheduledChunk.of(request, request.num_computed_tokens, 1))
            budget -= 1
        return budget

    def _schedule_prefills(self, batch: Batch, budget: int, chunk_cap: float) -> None:
        cfg = self.config
        chunking = RequestState.PREFILL_CHUNKING
        in_progress = [r for r in self.running if r.state is chunking]
        if len(in_progress) > 1:
            in_progress.sort(key=self.admission.queue_key)
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
        candidates = in_progress + (self.admission.admissible() if admit else [])
        plan = self.admission.plan_chunks(candidates, budget, slots, chunk_cap)
        if not plan and not batch.decodes:
            # Nothing decodes, so no block will come back on its own: tenant limits yield
            # first, then the latest partial prefill gives its blocks to the others.
            plan = self.admission.plan_chunks(candidates, budget, slots, chunk_cap, isolate=False)
            while not plan and len(in_progress) > 1:
                victim = self.admission.pick_victim()
                self.admission.preempt(victim, batch)
                in_progress.remove(victim)
                plan = self.admission.plan_chunks(in_progress, budget, slots, chunk_cap,
                                                  isolate=False)
        if not plan:
            return
        now = self.clock()
        fresh = []
        for request, tokens in plan.items():
            if (request.state is not RequestState.PREFILL_CHUNKING
                    and self.admission.admit(request, now, self.steps)):
                fresh.append(request)
            chunk = ScheduledChunk(request, request.num_computed_tokens, tokens)
            if self.blocks.allocate(request, tokens) is None:
                raise BlockError("a prefill plan outgrew the free KV blocks")
            batch.prefills.append(chunk)
        if fresh:  # a new arrival shares the budget: everyone's plan changes
            self._replan(tuple(c.start + 1 for c in batch.decodes), fresh)

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
        if not self.controller.calibrated:
            return
        fresh = set(fresh)
        prefilling = sorted((r for r in self.running if r.state is RequestState.PREFILL_CHUNKING),
                            key=self.admission.queue_key)
        if not prefilling:
            return
        rules = self._plan_rules = self.plan_rules()
        items = [PlanItem(r, r.num_computed_tokens, r.num_tokens) for r in prefilling]
        plans = plan_prefills(items, decode_contexts, rules, self.controller.plan_price())
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
        appended, stop conditions, finished requests' blocks freed, the budget controller
        taught, StepComplete published. An error in one request's sampling, stop check or
        output fails that request alone (FAILED, cause FAULT); the others go on."""
        self.steps += 1
        start = timing.end - timing.duration_s
        shape = batch.shape()
        prefill_tokens = shape.prefill_tokens
        self.watch.step(start, timing.end, self.steps, batch.mode.value, self.throttle_level,
                        self.prefill_paused, tuple([c.request.id for c in batch.prefills]),
                        len(batch.decodes))
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
        self._step_done(batch, shape, timing)
        return outputs

    def _step_done(self, batch: Batch, shape: StepShape, timing: StepTiming) -> None:
        model = self.controller.model
        bytes_moved = model.bytes_moved(shape)
        self.bandwidth.record(bytes_moved, timing.duration_s)
        self.controller.after_step(timing, self._scheduled_at, bool(batch.prefills),
                                   self.has_work())
        # step, prefill tokens, decode seqs, duration, predicted, mode, FLOPs, bytes moved:
        # positional, as a frozen dataclass's keywords cost a third more
        self.publish(StepComplete(self.steps, shape.prefill_tokens, len(batch.decodes),
                                  timing.duration_s, timing.predicted_s, batch.mode.value,
                                  model.flops(shape), bytes_moved))

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
            estimated_bytes=self.controller.model.bytes_moved(alone),
            predicted_s=timing.predicted_s,
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
                self._prefill_ended(request, now)
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

    def _prefill_ended(self, request: Request, end: float) -> None:
        self.watch.prefill_ended(request, end, self.config, self.controller.step_overhead_s)

    # --- preemption ---------------------------------------------------------------------

    # --- modes --------------------------------------------------------------------------


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
