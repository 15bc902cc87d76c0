"""After a step: chunk records, appended tokens, stop conditions and the step's own record."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TypeAlias

from engine.batch import (
    Batch,
    ModelRunnerOutput,
    RequestOutput,
    ScheduledChunk,
    StepShape,
    StepTiming,
)
from engine.budget.controller import BudgetController
from engine.config import EngineConfig
from engine.core.equipment import BandwidthSource, PrefillWatch
from engine.core.request import ChunkTiming, Ending, Request, RequestState
from engine.core.stops import StopScanner
from engine.events import (
    CacheEvict,
    ChunkComplete,
    Event,
    FailCause,
    Failed,
    Finished,
    RejectCause,
    Rejected,
    StepComplete,
    TokensGenerated,
)

# a booked request, the new tokens its output carries, and its Ending if the step ended it
Booked: TypeAlias = tuple[Request, tuple[int, ...], Ending | None]

# read for every token: a module global, where an Enum class's attribute is a slow lookup
_PREFILL_CHUNKING = RequestState.PREFILL_CHUNKING


class Bookkeeper:
    """Books a step's result on its requests and publishes it; says which requests it ends
    (their Endings) and leaves the ending to the scheduler."""

    def __init__(self, controller: BudgetController, bandwidth: BandwidthSource,
                 publish: Callable[[Event], None], watch: PrefillWatch, *,
                 eos_token_ids: Iterable[int], max_model_len: int,
                 decode: Callable[..., str]) -> None:
        self.controller = controller
        self.bandwidth = bandwidth
        self.publish = publish
        self.watch = watch
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode = decode  # the tokenizer's: stop strings match on the text
        self.max_model_len = max_model_len

    def stop_reason(self, request: Request, token: int) -> str | None:
        """Why `request` ends after emitting `token` ("stop", "length"), or None."""
        params = request.params
        generated = len(request.output_token_ids)
        if generated >= params.min_tokens:  # vLLM: no stop of any kind before min_tokens
            if token in params.stop_token_ids:
                return "stop"
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if params.stop:
                if request.stop_scanner is None:
                    request.stop_scanner = StopScanner(
                        params.stop, params.include_stop_str_in_output,
                        functools.partial(self.decode,
                                          skip_special_tokens=params.skip_special_tokens),
                        prime=request.prompt_token_ids)
                request.text_end = request.stop_scanner.feed(request.output_token_ids)
                if request.text_end is not None:
                    return "stop"
        if (generated >= params.max_tokens
                or len(request.prompt_token_ids) + generated >= self.max_model_len):
            return "length"
        return None

    def record_prompt_logprobs(self, requests: dict[str, Request],
                               output: ModelRunnerOutput) -> None:
        for request_id, (first, scored) in output.prompt_logprobs.items():
            request = requests[request_id]
            # a recomputed prefill (after a preemption) scores positions already kept
            request.prompt_logprobs += scored[max(0, len(request.prompt_logprobs) + 1 - first):]

    def sampled(self, batch: Batch, requests: dict[str, Request], output: ModelRunnerOutput,
                timing: StepTiming, step: int, config: EngineConfig) -> list[Booked]:
        """Book each sampling request's token, in logits-row order, with the Ending of those
        it ends; an error is that request's alone (FAULT). The step's tokens go out as one
        event, ahead of every ending's."""
        booked: list[Booked] = []
        ids: list[str] = []
        values: list[int] = []
        # looked up once a step, not once a token
        errors, token_ids, logprobs = output.errors, output.token_ids, output.logprobs
        append_token, finished = self.append_token, RequestState.FINISHED
        for chunk in batch.sampling:
            request_id = chunk.request_id
            request = requests[request_id]
            error = errors.get(request_id) if errors else None
            if error is None:
                try:
                    token = None if request.params.prefill_only else token_ids[request_id]
                    if logprobs and request_id in logprobs:
                        request.logprobs.append(logprobs[request_id])
                    reason = append_token(request, token, timing, step, config)
                    tokens = () if token is None else (token,)
                    booked.append((request, tokens, None if reason is None else
                                   Ending(request, finished, reason, None, tokens)))
                    if token is not None:
                        ids.append(request_id)
                        values.append(token)
                    continue
                except Exception as exc:  # fault isolation: it fails this request only
                    error = handling_failed(exc)
            booked.append((request, (), Ending(request, RequestState.FAILED, error,
                                               FailCause.FAULT)))
        if ids:
            self.publish(TokensGenerated.of(tuple(ids), tuple(values), timing.end))
        return booked

    def record_chunk(self, chunk: ScheduledChunk, request: Request, timing: StepTiming,
                     start: float, decodes: int, other_tokens: int, mode: str, step: int,
                     throttle_level: int) -> None:
        request.num_computed_tokens += chunk.num_tokens
        request.last_chunk_step = step
        index = len(request.chunks)
        request.chunks.append(ChunkTiming(index, chunk.start, chunk.num_tokens,
                                          timing.duration_s, timing.predicted_s, start,
                                          step, decodes, other_tokens, mode,
                                          throttle_level, request.num_preemptions,
                                          timing.contended))
        alone = StepShape(prefill=((chunk.num_tokens, chunk.start),))
        self.publish(ChunkComplete(
            request_id=request.id, chunk_index=index, tokens=chunk.num_tokens,
            start=chunk.start, duration_s=timing.duration_s,
            estimated_bytes=self.controller.model.bytes_moved(alone),
            predicted_s=timing.predicted_s,
            prefill_done=chunk.samples))

    def append_token(self, request: Request, token: int | None, timing: StepTiming,
                     step: int, config: EngineConfig) -> str | None:
        """Book `token` after the request's last chunk or decode and say why it ends the
        request, or None; a None token ends a prefill-only one ("length")."""
        now = timing.end
        if request.state is _PREFILL_CHUNKING:
            request.set_state(RequestState.DECODING, "prefill complete")
            if request.prefill_finished is None:
                request.prefill_finished = now
                self.watch.prefill_ended(request, now, config, self.controller.step_overhead_s)
        if token is None:
            return "length"
        if request.first_token_time is None:
            request.first_token_time = now
        elif request.decode_gaps is not None and request.last_token_time is not None:
            gap = now - request.last_token_time
            request.decode_gaps.append(gap)
            if request.worst_gap is None or gap > request.worst_gap[0]:
                request.worst_gap = (gap, step)
        request.output_token_ids.append(token)
        request.last_token_time = now
        return self.stop_reason(request, token)

    def ended(self, request: Request, cause: FailCause | RejectCause | None,
              blocks_freed: int | None, usage_after: float) -> None:
        """Publish how `request` ended, then the blocks it gave back (None: it never held
        any, as a request rejected at intake)."""
        if request.state is RequestState.REJECTED:
            assert isinstance(cause, RejectCause)
            self.publish(Rejected(request_id=request.id, reason=request.reason, cause=cause))
        elif request.state is RequestState.FAILED:
            assert not isinstance(cause, RejectCause)
            self.publish(Failed(request_id=request.id, reason=request.reason,
                                cause=cause or FailCause.FAULT))
        else:
            assert request.finish_time is not None
            self.publish(Finished(
                request_id=request.id, reason=request.reason,
                prompt_tokens=request.num_prompt_tokens,
                generated_tokens=len(request.output_token_ids), ttft_s=request.ttft_s,
                e2e_s=request.finish_time - request.arrival, budget_score=request.budget_score,
                queue_wait_s=None if request.prefill_started is None
                else request.prefill_started - request.arrival))
        if blocks_freed is not None:
            self.publish(CacheEvict(request_id=request.id, blocks_freed=blocks_freed,
                                    usage_after=usage_after))

    def step_done(self, batch: Batch, shape: StepShape, timing: StepTiming, step: int,
                  scheduled_at: float, has_work: bool) -> None:
        model = self.controller.model
        bytes_moved = model.bytes_moved(shape)
        self.bandwidth.record(bytes_moved, timing.duration_s)
        self.controller.after_step(timing, scheduled_at, bool(batch.prefills), has_work)
        # the bus stamps its time on it as it publishes
        self.publish(StepComplete.of(step, shape.prefill_tokens, len(batch.decodes),
                                     timing.duration_s, timing.predicted_s, batch.mode.value,
                                     model.flops(shape), bytes_moved, timing.end))


def handling_failed(exc: Exception) -> str:
    return f"handling its token failed: {type(exc).__name__}: {exc}"


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
