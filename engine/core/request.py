"""A request as the engine sees it; as in vLLM V1 a decode is a request one token behind."""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.batch import ChunkTiming, NewRequest, PlannedChunk, ScheduledChunk, TokenLogprob
from engine.config import SamplingParams
from engine.core.stops import StopScanner
from engine.events import FailCause, RejectCause

if TYPE_CHECKING:  # the console imports this module without torch
    import torch


# the HTTP server's tags for chat completions and prompt scoring, shown with slow queries
CHAT_TAG = "chat-completion"
SCORE_TAG = "prompt-score"


class RequestState(enum.StrEnum):
    WAITING = "WAITING"
    PREFILL_CHUNKING = "PREFILL_CHUNKING"
    DECODING = "DECODING"
    PREEMPTED = "PREEMPTED"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    REJECTED = "REJECTED"

    @property
    def is_final(self) -> bool:
        return self in _FINAL  # read for every output of every step: one set lookup


_FINAL = frozenset((RequestState.FINISHED, RequestState.FAILED, RequestState.REJECTED))


@dataclass(eq=False)
class Request:
    id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    tenant: str = "default"
    priority: int = 0
    tag: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    state: RequestState = RequestState.WAITING
    reason: str = "queued"
    block_table: list[int] = field(default_factory=list)
    # prefix cache: its full blocks' hashes, how many are registered, tokens found cached
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0
    cached_tokens: int = 0
    # resumed from the journal after a restart: the output tokens it had by then (None: not)
    resumed_tokens: int | None = None
    num_preemptions: int = 0
    chunks: list[ChunkTiming] = field(default_factory=list)
    prefill_started: float | None = None
    prefill_finished: float | None = None
    # the prefill plan, re-planned unless on a fault; empty until the engine is calibrated
    planned: list[PlannedChunk] = field(default_factory=list)
    replans: int = 0
    admissions: list[float] = field(default_factory=list)
    preempted_at: list[float] = field(default_factory=list)
    # seconds between tokens, kept only once the request is flagged slow
    decode_gaps: array[float] | None = None
    worst_gap: tuple[float, int] | None = None  # the longest decode gap and its step
    last_chunk_step: int = 0  # the scheduler's step count at its last chunk (or admission)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None  # a seeded request's, made at its first draw
    # asked-for logprobs: per generated token, and per prompt token from the second
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_scanner: StopScanner | None = None  # made at the first token of a request with stops
    text_end: int | None = None  # where a matched stop string cuts the output text

    @property
    def kind(self) -> str:
        """What the console calls it: "score" (prefill only), "chat" or "generate"."""
        if self.params.prefill_only:
            return "score"
        return "chat" if self.tag == CHAT_TAG else "generate"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.state is RequestState.DECODING

    @property
    def budgeted_prefill_s(self) -> float | None:
        """The planned prefill time: the sum of the plan's chunk budgets; None unplanned."""
        if not self.planned:
            return None
        return sum(c.budget_s for c in self.planned)

    @property
    def budget_score(self) -> float | None:
        if self.prefill_finished is None or self.prefill_started is None:
            return None
        budget = self.budgeted_prefill_s
        if not budget:
            return None
        return (self.prefill_finished - self.prefill_started) / budget

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def tpot_s(self) -> float | None:
        n = len(self.output_token_ids)
        if n < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without copying the whole sequence."""
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        if start >= prompt:
            return self.output_token_ids[start - prompt:end - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt]

    def entering(self) -> NewRequest:
        """What the runner is told as this request enters it: its tokens and blocks now."""
        return NewRequest(self.id, self.prompt_token_ids, tuple(self.output_token_ids),
                          self.params, tuple(self.block_table))

    def chunk(self, start: int, num_tokens: int, new_block_ids: tuple[int, ...] = ()
              ) -> ScheduledChunk:
        """The message for this request's `num_tokens` from `start`, in its state now."""
        decode = self.is_decoding
        scored = 0
        if self.params.prompt_logprobs is not None and not decode:
            scored = max(0, min(num_tokens, self.num_prompt_tokens - 1 - start))
        return ScheduledChunk.of(self.id, start, num_tokens, new_block_ids, decode,
                                 start + num_tokens == self.num_tokens, scored)

    def set_state(self, state: RequestState, reason: str) -> None:
        self.state = state
        self.reason = reason


@dataclass(frozen=True)
class Ending:
    """How a request ends (`Scheduler.end`): FINISHED for a reason ("stop", "length",
    "aborted"), FAILED with its cause, or REJECTED at intake with its cause; `tokens` are the
    new tokens its last output carries (the token that stopped it)."""

    request: Request
    state: RequestState
    reason: str
    cause: FailCause | RejectCause | None = None
    tokens: tuple[int, ...] = ()
