"""The engine loop: request -> schedule -> run -> sample -> update, events out.

Everything here runs on one thread (the caller's, or `EngineLoop`'s). Other threads may
call `update_config` (applied at the next step boundary) and read the last snapshot.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.budget.cost_model import BudgetModel
from engine.budget.peaks import measure_peaks
from engine.budget.roofline import StepShape
from engine.config import EngineConfig, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.executor import Executor
from engine.core.model_runner import ModelRunner
from engine.core.request import ChunkTiming, Request, RequestState
from engine.core.sampler import make_generator, sample
from engine.core.scheduler import Batch, ScheduledChunk, Scheduler
from engine.errors import RequestError
from engine.events import (
    CacheEvict,
    ChunkComplete,
    ConfigChanged,
    EventBus,
    Failed,
    Finished,
    Rejected,
    RequestAdded,
    SlowQuery,
    StepComplete,
    TokensGenerated,
)
from engine.ops.guards import Guards
from engine.ops.metrics import Metrics
from engine.ops.telemetry import BandwidthSource, ModelBandwidth, NvmlBandwidth, nvml_available
from engine.snapshot import RequestView, Snapshot

RECENT_FINISHED = 64  # finished requests still shown in snapshots
BREAKER_FACTOR = 1.2  # protection layer 1: reject prompts over max_prefill_tokens × 1.2


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # everything generated so far
    finished: bool
    finish_reason: str | None
    state: str


class Engine:
    def __init__(self, config: EngineConfig | None = None, *,
                 bandwidth: BandwidthSource | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 runner: Executor | None = None) -> None:
        """`runner` replaces the model runner by a simulated executor (engine.sim), which
        brings its device's peaks; `clock` is then the simulation's clock."""
        config = config or EngineConfig()
        config.validate()
        self.config = config
        self.clock = clock
        self.bus = EventBus(clock)
        self.runner: ModelRunner | Executor = runner or ModelRunner(config)
        self.model_config = self.runner.model_config
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size)
        self.peaks = (runner.peaks if runner is not None
                      else measure_peaks(str(self.runner.device), self.runner.dtype))
        self.budget = BudgetModel(self.model_config, self.runner.bytes_per_element, self.peaks)
        self.predict: Callable[[StepShape], float] = self.budget.predict
        self.bandwidth = bandwidth or self._default_bandwidth()
        self.scheduler = Scheduler(config, self.blocks, self.bandwidth,
                                   lambda shape: self.predict(shape), self.bus.publish, clock)
        self.metrics = Metrics()
        self.bus.subscribe(self.metrics.observe)
        self.requests: dict[str, Request] = {}
        self.recent: deque[Request] = deque(maxlen=RECENT_FINISHED)
        self.step_count = 0
        self._out_of_band: list[RequestOutput] = []
        self._config_lock = threading.Lock()
        self._pending_config: tuple[EngineConfig, str] | None = None
        self.guards = Guards(self)

    def _default_bandwidth(self) -> BandwidthSource:
        """NVML's 5 s average on a GPU it can see, else the model estimate."""
        device = self.runner.device
        if device.type == "cuda" and nvml_available():
            source = NvmlBandwidth(device.index or 0, torch_device=str(device))
            source.start()
            return source
        return ModelBandwidth(self.peaks.bandwidth, clock=self.clock)

    # --- requests -----------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams | None = None, *,
                    tenant: str = "default", priority: int = 0, request_id: str | None = None,
                    tag: str | None = None, arrival: float | None = None,
                    generated: Sequence[int] = ()) -> str:
        """Queue a request; malformed input raises RequestError and changes nothing.

        A well-formed request the engine can never serve (too long for the model or the KV
        pool, or over the circuit breaker) is recorded as REJECTED with its reason.
        `generated` resumes a request after a crash: those tokens count as output already
        emitted; prompt and them are prefilled again (RECOMPUTE) and generation goes on."""
        params = params or SamplingParams()
        token_ids = self.prompt_token_ids(prompt)
        already = self.prompt_token_ids(generated) if generated else []
        rid = request_id or uuid.uuid4().hex[:16]
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in flight; use a unique id")
        request = Request(id=rid, prompt_token_ids=token_ids, params=params,
                          arrival=self.clock() if arrival is None else arrival, tenant=tenant,
                          priority=priority, tag=tag, generator=make_generator(params.seed),
                          output_token_ids=already)
        self.bus.publish(RequestAdded(request_id=rid, prompt_token_ids=tuple(token_ids),
                                      sampling=_params_dict(params), tenant=tenant,
                                      priority=priority, tag=tag,
                                      generated_token_ids=tuple(already)))
        reason = self.rejection_reason(len(token_ids), params.max_tokens)
        if reason:
            request.set_state(RequestState.REJECTED, reason)
            request.finish_time = self.clock()
            self.recent.append(request)
            self.bus.publish(Rejected(request_id=rid, reason=reason))
            self._out_of_band.append(_output(request, ()))
            return rid
        self.requests[rid] = request
        ended = self._stop_reason(request, already[-1]) if already else None
        if ended:  # it had ended before the crash; only its record was lost
            self._finish(request, RequestState.FINISHED, ended)
            self._out_of_band.append(_output(request, ()))
            return rid
        self.scheduler.add(request)
        return rid

    def prompt_token_ids(self, prompt: Sequence[int] | str) -> list[int]:
        """Token ids of a prompt; RequestError if it is malformed (no state changes)."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            try:
                token_ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise RequestError("prompt must be text or a list of integer token ids") from None
        if not token_ids:
            raise RequestError("the prompt is empty; send at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return token_ids

    def rejection_reason(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of this size can never be served, or None (no engine work done)."""
        limit = self.config.max_prefill_tokens or self.max_model_len
        if prompt_tokens > limit * BREAKER_FACTOR:
            return (f"circuit breaker: prompt has {prompt_tokens} tokens, over "
                    f"max_prefill_tokens {limit} × {BREAKER_FACTOR}; shorten the prompt")
        if prompt_tokens + max_tokens > self.max_model_len:
            return (f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) exceeds "
                    f"max_model_len {self.max_model_len}; shorten the prompt or lower max_tokens")
        budget = self.config.max_num_batched_tokens
        if not self.config.chunked_prefill and prompt_tokens > budget:
            return (f"chunked prefill is off and the prompt ({prompt_tokens}) exceeds "
                    f"max_num_batched_tokens {budget}; raise the budget or turn chunking on")
        needed = self.blocks.blocks_for(prompt_tokens + max_tokens)
        if needed > self.blocks.num_blocks:
            return (f"needs {needed} KV blocks but the pool has {self.blocks.num_blocks}; "
                    f"raise kv_cache_bytes or lower max_tokens")
        return None

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, RequestState.FINISHED, "aborted")
        self._out_of_band.append(_output(request, ()))
        return True

    def fail(self, request: Request, reason: str) -> None:
        """End a request with an error (protection layers); its KV blocks are released."""
        self._finish(request, RequestState.FAILED, reason)
        self._out_of_band.append(_output(request, ()))

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._out_of_band)

    def generate(self, prompts: Sequence[Sequence[int] | str],
                 params: SamplingParams | None = None) -> list[list[int]]:
        ids = [self.add_request(p, params) for p in prompts]
        results: dict[str, list[int]] = {}
        while len(results) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in ids:
                    if out.state != RequestState.FINISHED:
                        request = next(r for r in self.recent if r.id == out.request_id)
                        raise RequestError(f"request {out.request_id} {out.state}: "
                                           f"{request.reason}")
                    results[out.request_id] = list(out.token_ids)
        return [results[i] for i in ids]

    # --- configuration ------------------------------------------------------------------
    def update_config(self, source: str = "api", **changes: object) -> EngineConfig:
        """Validate now (ConfigError names the field; nothing changes), apply at the next
        step boundary. Safe to call from any thread."""
        with self._config_lock:
            base = self._pending_config[0] if self._pending_config else self.config
            candidate = base.replace(**changes)
            self._pending_config = (candidate, source)
            return candidate

    def apply_pending_config(self) -> None:
        """Make a validated update current; called at step boundaries (and by idle loops)."""
        with self._config_lock:
            pending, self._pending_config = self._pending_config, None
        if pending is None:
            return
        new, source = pending
        old = self.config
        changed = {name: (getattr(old, name), getattr(new, name))
                   for name in new.live_values() if getattr(old, name) != getattr(new, name)}
        self.config = self.scheduler.config = new
        if changed:
            self.bus.publish(ConfigChanged(changes=changed, source=source))

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.apply_pending_config()
        self.guards.before_step()
        outputs, self._out_of_band = self._out_of_band, []
        if self.config.auto_budget:
            self.scheduler.auto_budget = self._auto_budget()
        batch = self.scheduler.schedule()
        if batch.chunks:
            outputs += self._run(batch)
        self.bus.drain()
        return outputs

    def _decode_load(self) -> tuple[int, int]:
        """(D, S): running decodes and their mean context, the inputs of C*."""
        decodes = [r for r in self.scheduler.running if r.is_decoding]
        if not decodes:
            return 0, 0
        return len(decodes), sum(r.num_tokens for r in decodes) // len(decodes)

    def _auto_budget(self) -> int:
        """C* for the live decode load plus one token per decode, in whole tiles. With no
        decode to protect the configured budget stands (seed 003 §13: bigger chunks then
        only shorten TTFT)."""
        decodes, context = self._decode_load()
        if decodes == 0:
            return self.config.max_num_batched_tokens
        tile = self.config.chunk_tile
        chunk = self.budget.recommended_chunk(decodes, context)
        if self.config.auto_tpot_ms:
            # seed 003 §8: from C*, grow the chunk as far as the TPOT target allows
            chunk = max(chunk, self._largest_chunk_within(self.config.auto_tpot_ms / 1e3,
                                                          decodes, context))
        wanted = chunk + decodes
        return max(tile, -(-wanted // tile) * tile)

    def _largest_chunk_within(self, seconds: float, decodes: int, context: int) -> int:
        """The largest prefill chunk whose step, beside the live decodes, is predicted to
        take at most `seconds` (binary search; the predictor is monotone in the chunk)."""
        contexts = (context,) * decodes
        low, high = 0, self.max_model_len
        while low < high:
            middle = (low + high + 1) // 2
            shape = StepShape(prefill=((middle, 0),), decode_contexts=contexts)
            if self.predict(shape) <= seconds:
                low = middle
            else:
                high = middle - 1
        return low

    def _run(self, batch: Batch) -> list[RequestOutput]:
        self.runner.zero_blocks(self.blocks.take_newly_allocated())
        shape = batch.shape()
        predicted = self.predict(shape)
        start = self.clock()
        sampling = [c for c in batch.chunks if c.samples]
        tokens = self._forward(batch, sampling)
        end = self.clock()
        duration = end - start
        bytes_moved = self.budget.bytes_moved(shape)
        self.bandwidth.record(bytes_moved, duration)
        self.step_count += 1
        for chunk in batch.prefills:
            self._record_chunk(chunk, duration, predicted)
        for chunk in batch.decodes:
            chunk.request.num_computed_tokens += 1
        outputs = [self._append_token(c.request, token, end)
                   for c, token in zip(sampling, tokens, strict=True)]
        self.bus.publish(StepComplete(step=self.step_count, prefill_tokens=shape.prefill_tokens,
                                      decode_seqs=len(batch.decodes), duration_s=duration,
                                      predicted_s=predicted, mode=batch.mode.value,
                                      flops=self.budget.flops(shape), bytes_moved=bytes_moved))
        self.guards.after_step(batch, duration)
        return outputs

    def _forward(self, batch: Batch, sampling: list[ScheduledChunk]) -> list[int]:
        """The step's sampled tokens, one per chunk of `sampling`."""
        if isinstance(self.runner, ModelRunner):
            logits = self.runner.run(batch.chunks)
            return sample(logits, [c.request.params for c in sampling],
                          [c.request.generator for c in sampling])
        sampled = self.runner.run(batch).token_ids
        return [sampled[c.request.id] for c in sampling]

    def _record_chunk(self, chunk: ScheduledChunk, duration: float, predicted: float) -> None:
        request = chunk.request
        request.num_computed_tokens += chunk.num_tokens
        index = len(request.chunks)
        request.chunks.append(ChunkTiming(index, chunk.start, chunk.num_tokens, duration,
                                          predicted))
        alone = StepShape(prefill=((chunk.num_tokens, chunk.start),))
        self.bus.publish(ChunkComplete(
            request_id=request.id, chunk_index=index, tokens=chunk.num_tokens,
            start=chunk.start, duration_s=duration,
            estimated_bytes=self.budget.bytes_moved(alone), predicted_s=predicted,
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
        self.bus.publish(TokensGenerated(request_id=request.id, token_ids=(token,)))
        reason = self._stop_reason(request, token)
        if reason:
            self._finish(request, RequestState.FINISHED, reason)
        return _output(request, (token,))

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _check_slow(self, request: Request) -> None:
        score = request.budget_score
        if score is None or score <= self.config.slow_query_threshold:
            return
        chunks = tuple({"index": c.index, "start": c.start, "tokens": c.tokens,
                        "duration_s": c.duration_s, "predicted_s": c.predicted_s}
                       for c in request.chunks)
        self.bus.publish(SlowQuery(
            request_id=request.id, tenant=request.tenant, budget_score=score,
            prompt_tokens=request.num_prompt_tokens,
            prefill_s=request.prefill_finished - request.prefill_started,
            budgeted_s=request.budgeted_prefill_s or 0.0, chunks=chunks,
            config=self.config.live_values(), tag=request.tag))

    def _finish(self, request: Request, state: RequestState, reason: str) -> None:
        freed = self.scheduler.remove(request)
        request.set_state(state, reason)
        request.finish_time = self.clock()
        self.requests.pop(request.id, None)
        self.recent.append(request)
        if state is RequestState.FAILED:
            self.bus.publish(Failed(request_id=request.id, reason=reason))
        else:
            self.bus.publish(Finished(
                request_id=request.id, reason=reason, prompt_tokens=request.num_prompt_tokens,
                generated_tokens=len(request.output_token_ids), ttft_s=request.ttft_s,
                e2e_s=request.finish_time - request.arrival, budget_score=request.budget_score))
        self.bus.publish(CacheEvict(request_id=request.id, blocks_freed=freed,
                                    usage_after=self.blocks.usage))

    # --- observation --------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        now = self.clock()
        live = list(self.requests.values())
        tokens_per_s, output_per_s = self.metrics.rates(now)
        ttft, tpot, step = self.metrics.latency()
        decodes, context = self._decode_load()
        reading = self.bandwidth.reading()
        m = self.metrics
        return Snapshot(
            ts=now, model=self.config.model, device=str(self.runner.device),
            mode=self.scheduler.mode.value, step=self.step_count,
            mode_reason=self._mode_reason(), config=self.config.live_values(),
            requests=tuple(_view(r, self.config.max_num_batched_tokens)
                           for r in [*self.recent, *live]),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            chunk_queue_length=self.scheduler.chunk_queue_length,
            kv_usage=self.blocks.usage, kv_blocks_used=self.blocks.num_used,
            kv_blocks_total=self.blocks.num_blocks,
            kv_fragmentation=self.blocks.fragmentation(live),
            bandwidth_util_5s=reading.util_5s, bandwidth_source=reading.source,
            throttle_level=self.scheduler.throttle_level, tokens_per_s=tokens_per_s,
            output_tokens_per_s=output_per_s, ttft_ms=ttft, tpot_ms=tpot, step_ms=step,
            recommended_chunk_size=self.budget.recommended_chunk(decodes, context),
            token_budget=self.scheduler.token_budget,
            preemptions_total=m.preemptions_total, prompt_tokens_total=m.prompt_tokens_total,
            generation_tokens_total=m.generation_tokens_total,
            requests_finished_total=m.requests_finished_total,
            slow_queries_total=m.slow_queries_total,
            guards=self.guards.engaged(),
        )

    def _mode_reason(self) -> str:
        s = self.scheduler
        if s.cache_pressure:
            return (f"KV usage {self.blocks.usage:.0%} reached the high watermark "
                    f"{self.config.cache_high_watermark:.0%}; decodes only")
        if s.throttle_level:
            return (f"bandwidth 5 s average {s.bandwidth_util:.0%}: "
                    f"throttle level {s.throttle_level}")
        return ""


def _params_dict(params: SamplingParams) -> dict[str, object]:
    return {"max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k, "seed": params.seed,
            "ignore_eos": params.ignore_eos, "stop_token_ids": list(params.stop_token_ids)}


def _output(request: Request, new_tokens: tuple[int, ...]) -> RequestOutput:
    return RequestOutput(request_id=request.id, new_token_ids=new_tokens,
                         token_ids=tuple(request.output_token_ids),
                         finished=request.state.is_final, finish_reason=request.reason
                         if request.state.is_final else None, state=request.state.value)


def _view(request: Request, budget: int) -> RequestView:
    chunk = max(1, budget)
    return RequestView(
        id=request.id, tenant=request.tenant, state=request.state.value, reason=request.reason,
        prompt_tokens=request.num_prompt_tokens,
        prefilled_tokens=min(request.num_computed_tokens, request.num_prompt_tokens),
        chunks_done=len(request.chunks),
        chunks_total=max(len(request.chunks), -(-request.num_prompt_tokens // chunk)),
        generated_tokens=len(request.output_token_ids),
        ttft_ms=None if request.ttft_s is None else request.ttft_s * 1000,
        tpot_ms=None if request.tpot_s is None else request.tpot_s * 1000,
        budget_score=request.budget_score, arrival_s=request.arrival)
