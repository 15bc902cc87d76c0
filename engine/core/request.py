"""A request as the engine sees it: tokens, progress, state and the timings behind its metrics.

Like vLLM V1 there are no phases: `num_computed_tokens` (tokens whose KV is cached) catches
up with `num_tokens`; a decode is simply a request one token behind.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.config import SamplingParams


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
        return self in (RequestState.FINISHED, RequestState.FAILED, RequestState.REJECTED)


@dataclass(frozen=True)
class ChunkTiming:
    index: int
    start: int
    tokens: int
    duration_s: float
    predicted_s: float


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
    num_preemptions: int = 0
    chunks: list[ChunkTiming] = field(default_factory=list)
    prefill_started: float | None = None
    prefill_finished: float | None = None
    budgeted_prefill_s: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None  # a seeded request's, made at its first draw

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
    def budget_score(self) -> float | None:
        """Actual prefill time / budgeted prefill time (seed 000 §6)."""
        if self.prefill_finished is None or self.prefill_started is None:
            return None
        if not self.budgeted_prefill_s:
            return None
        return (self.prefill_finished - self.prefill_started) / self.budgeted_prefill_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
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

    def set_state(self, state: RequestState, reason: str) -> None:
        self.state = state
        self.reason = reason
