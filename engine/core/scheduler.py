"""The token-budget scheduler: decodes first, then chunked prefills in (priority, arrival) order."""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from engine.batch import (
    Batch,
    ModelRunnerOutput,
    RequestOutput,
    ScheduledChunk,
    SchedulerMode,
    StepTiming,
    Unheard,
)
from engine.budget.controller import BudgetController
from engine.config import EngineConfig
from engine.core.admission import Admission
from engine.core.block_manager import BlockManager
from engine.core.bookkeeping import Bookkeeper, handling_failed, request_output
from engine.core.cadence import DecodeCadence
from engine.core.equipment import BandwidthSource, PrefillWatch
from engine.core.modes import THROTTLE_CONCURRENCY, Modes
from engine.core.planning import PrefillPlan, plan_chunks
from engine.core.replanner import Replanner
from engine.core.request import Ending, Request, RequestState
from engine.events import Event, FailCause

RECENT_FINISHED = 64  # ended requests still shown in snapshots


class Scheduler:
    """Owns every live request: `schedule` picks a step's batch, `update` books its result."""

    def __init__(self, config: EngineConfig, blocks: BlockManager, bandwidth: BandwidthSource,
                 controller: BudgetController, publish: Callable[[Event], None],
                 clock: Callable[[], float], *, watch: PrefillWatch,
                 eos_token_ids: Iterable[int], max_model_len: int,
                 decode: Callable[..., str] = lambda ids, skip_special_tokens=True: ""
                 ) -> None:
        self.admission = Admission(config, blocks, publish, clock)
        self.modes = Modes(bandwidth, publish, clock)
        self.bandwidth = bandwidth
        self.controller = controller
        self.watch = watch
        self.clock = clock
        self.max_model_len = max_model_len
        self.replanner = Replanner(self.admission, controller)
        self.books = Bookkeeper(controller, bandwidth, publish, watch,
                                eos_token_ids=eos_token_ids, max_model_len=max_model_len,
                                decode=decode)
        self.stop_reason = self.books.stop_reason  # the engine checks a resumed request's tail
        self.requests: dict[str, Request] = {}  # live: waiting, running or preempted
        self.recent: deque[Request] = deque(maxlen=RECENT_FINISHED)  # ended, newest last
        self.waiting = self.admission.waiting
        self.running = self.admission.running
        self.prefill_paused = False
        self.unheard = Unheard()
        self.steps = 0  # steps booked by `update`
        self._scheduled_at = 0.0

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

    def reset(self, blocks: BlockManager, fail: Mapping[str, str]
              ) -> tuple[list[Request], list[RequestOutput]]:
        """An engine restart: the KV pool starts empty; the requests in `fail` end (FAILED,
        ENGINE) and every other live one leaves, returned to be resumed afresh."""
        for request in self.requests.values():
            request.block_table = []  # their KV went with the old pool
            request.num_hashed_blocks = 0
        self.admission.blocks = blocks
        owed = [output for request in list(self.requests.values()) if request.id in fail
                if (output := self.end(Ending(request, RequestState.FAILED, fail[request.id],
                                              FailCause.ENGINE)))]
        kept = list(self.requests.values())
        self.unheard.ended.extend(self.requests)  # resumed ones enter the runner afresh
        for queue in (self.requests, self.waiting, self.running):
            queue.clear()
        self.watch.clear()
        self.controller.forget_steps()
        return kept, owed

    def add(self, request: Request) -> None:
        self.watch.arrived(request.arrival)
        self.requests[request.id] = request
        request.set_state(RequestState.WAITING, "queued")
        insort(self.waiting, request, key=self.admission.queue_key)

    def end(self, ending: Ending) -> RequestOutput | None:
        """The one way a request ends: it leaves the queues and gives back its KV blocks, its
        state, reason and finish time are set, and its end is published; returns its last
        output. One already ended is left alone (None)."""
        request = ending.request
        if request.state.is_final:
            return None
        live = self.requests.pop(request.id, None) is not None  # else rejected at intake
        if live:
            self.unheard.ended.append(request.id)
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
        freed = self.blocks.release(request)
        request.set_state(ending.state, ending.reason)
        request.finish_time = self.clock()
        self.recent.append(request)
        if live:
            if ending.state is RequestState.FAILED and request.prefill_finished is None:
                self.watch.prefill_ended(request, request.finish_time, self.config,
                                         self.controller.step_overhead_s)
            self.watch.ended(request, self.config)
        self.books.ended(request, ending.cause, freed if live else None, self.blocks.usage)
        return request_output(request, ending.tokens)

    def _end_alone(self, ending: Ending) -> RequestOutput:
        """End a request its step's result ended; a fault while ending it is its alone."""
        try:
            output = self.end(ending)
        except Exception as exc:  # fault isolation: it fails this request only
            output = self.end(Ending(ending.request, RequestState.FAILED, handling_failed(exc),
                                     FailCause.FAULT, ending.tokens))
        return output or request_output(ending.request, ending.tokens)

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
        # read before every step: each request's state, not its is_decoding property
        decoding = RequestState.DECODING
        return len(self.waiting) + sum(r.state is not decoding for r in self.running)

    def schedule(self) -> Batch:
        now = self._scheduled_at = self.clock()
        self.controller.before_step(now, self.decode_load, self.config, self.max_model_len)
        self.modes.update(self.config, self.blocks.usage, len(self.requests),
                          self.chunk_queue_length)
        self.watch.mode(self.clock(), self.mode.value, self.throttle_level, self.prefill_paused)
        batch = Batch(mode=self.mode)
        budget = self._schedule_decodes(batch, self.token_budget)
        # once a step: the retune check and the chunk cap read it
        rules = self.replanner.rules(self.config, self.token_budget)
        self.replanner.replan_if_retuned(rules, batch.decodes, self.steps)
        self._schedule_prefills(batch, budget, rules.chunk_cap)
        self.unheard.tell(batch)
        return batch

    def _schedule_decodes(self, batch: Batch, budget: int) -> int:
        block_size = self.blocks.block_size
        decoding = RequestState.DECODING
        chunk_of = ScheduledChunk.of
        for request in list(self.running):
            if budget <= 0:
                break
            if request.state is not decoding:
                continue
            # hot path (256 decodes under 1 ms): most decodes still fit their last block
            new: list[int] | None = None
            if request.num_computed_tokens >= len(request.block_table) * block_size:
                while (new := self.blocks.allocate(request, 1)) is None:
                    victim = self.admission.pick_victim()
                    self.admission.preempt(victim, batch)
                    if any(c.request_id == victim.id for c in batch.decodes):
                        batch.decodes = [c for c in batch.decodes if c.request_id != victim.id]
                        budget += 1
                    if victim is request:
                        break
                if request.state is RequestState.PREEMPTED:
                    continue
            batch.decodes.append(chunk_of(request.id, request.num_computed_tokens, 1,
                                          tuple(new) if new else (), True))
            budget -= 1
        return budget

    def _schedule_prefills(self, batch: Batch, budget: int, chunk_cap: float) -> None:
        cfg = self.config
        if batch.decodes and cfg.mixed_step_prefill_tokens:
            budget = min(budget, cfg.mixed_step_prefill_tokens)  # decodes first, then this
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
            # no decode frees blocks (or degraded): one prefill, minimal chunks: service never stops
            slots, chunk_cap = 1, cfg.chunk_tile
        admit = not (batch.preempted or self.cache_pressure or self.throttle_level >= 3)
        cadence = DecodeCadence.of(cfg)
        if admit and self.waiting and cadence.holds(len(batch.decodes), bool(in_progress)):
            admit = cadence.admits(self._waiting_tokens(budget), budget,
                                   self.clock() - self.waiting[0].arrival)
        candidates = in_progress + (self.admission.admissible() if admit else [])
        plan = self._plan(candidates, budget, slots, chunk_cap)
        if not plan and not batch.decodes:
            # no decode will free a block: tenant limits yield, then the latest partial prefill goes
            plan = self._plan(candidates, budget, slots, chunk_cap, isolate=False)
            while not plan and len(in_progress) > 1:
                victim = self.admission.pick_victim()
                self.admission.preempt(victim, batch)
                in_progress.remove(victim)
                plan = self._plan(in_progress, budget, slots, chunk_cap, isolate=False)
        if not plan:
            return
        if fresh := self.admission.allocate(plan, batch, self.steps):
            # a new arrival shares the budget: everyone's plan changes
            self.replanner.replan(self.replanner.rules(cfg, self.token_budget), batch.decodes,
                                  fresh, self.steps)

    def _plan(self, candidates: list[Request], budget: int, slots: int, chunk_cap: float,
              isolate: bool = True) -> PrefillPlan:
        plan = plan_chunks(candidates, budget, slots, chunk_cap, self.config, self.running,
                           self.blocks, isolate)
        self.blocks.touch(plan.warmed)  # looked up, kept warm for when they are admitted
        return plan

    def _waiting_tokens(self, enough: int) -> int:
        """The queued prompts' tokens, counted until they reach `enough`."""
        tokens = 0
        for request in self.waiting:
            tokens += request.num_pending
            if tokens >= enough:
                break
        return tokens

    def update(self, batch: Batch, output: ModelRunnerOutput,
               timing: StepTiming) -> list[RequestOutput]:
        """Book a step's result and teach the controller; a faulty token fails its request alone."""
        self.steps += 1
        start = timing.end - timing.duration_s
        shape = batch.shape()
        prefill_tokens = shape.prefill_tokens
        self.watch.step(start, timing.end, self.steps, batch.mode.value, self.throttle_level,
                        self.prefill_paused, tuple([c.request_id for c in batch.prefills]),
                        len(batch.decodes), timing.host, len(self.waiting))
        cache = self.blocks.cache_full_blocks
        requests = self.requests  # a batch's requests stay live until their tokens are booked
        for chunk in batch.prefills:
            request = requests[chunk.request_id]
            self.books.record_chunk(chunk, request, timing, start, len(batch.decodes),
                                    prefill_tokens - chunk.num_tokens, batch.mode.value,
                                    self.steps, self.throttle_level)
            cache(request)
        self.books.record_prompt_logprobs(requests, output)
        block_size = self.blocks.block_size
        for chunk in batch.decodes:
            request = requests[chunk.request_id]
            request.num_computed_tokens += 1
            # register blocks once a decode fills one (and any a disabled cache skipped)
            if not request.num_computed_tokens % block_size:
                cache(request)
        booked = self.books.sampled(batch, requests, output, timing, self.steps, self.config)
        # faults end first, then the requests their tokens stopped (each in logits-row order)
        endings = sorted((ending for _, _, ending in booked if ending is not None),
                         key=lambda ending: ending.state is not RequestState.FAILED)
        last = {ending.request.id: self._end_alone(ending) for ending in endings}
        outputs = ([last.get(request.id) or request_output(request, tokens)
                    for request, tokens, _ in booked] if last  # most steps end no request
                   else [request_output(request, tokens) for request, tokens, _ in booked])
        self.books.step_done(batch, shape, timing, self.steps, self._scheduled_at,
                             self.has_work())
        return outputs
