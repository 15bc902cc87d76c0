"""The step's contracts: what the scheduler hands the runner (`Batch` of `ScheduledChunk`s),
what the runner hands back (`ModelRunnerOutput`), what a step cost (`StepShape`, `StepTiming`)
and what a caller of `Engine.step` receives (`RequestOutput`).

The runner, the cost models, the calibrator, the SLO code and the chaos harness import this
module rather than the scheduler (vLLM V1 keeps `SchedulerOutput` apart for the same reason).
It imports nothing heavy, so `tokenflow roofline` stays free of torch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.core.request import TokenLogprob

if TYPE_CHECKING:
    from engine.core.request import Request


class SchedulerMode(enum.StrEnum):
    NORMAL = "NORMAL"
    CACHE_PRESSURE_WAIT = "CACHE_PRESSURE_WAIT"
    BANDWIDTH_THROTTLE = "BANDWIDTH_THROTTLE"


class _memo:  # a decorator, named like the one it stands for
    """functools.cached_property without Python 3.11's per-class lock, which a shape made
    and priced every step paid on each first read."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self._fn, self._name = fn, fn.__name__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self._name] = self._fn(obj)  # later reads find it there
        return value


@dataclass(frozen=True)
class StepShape:
    """What one step computes, as the cost models need it.

    prefill: (chunk_tokens, context_before) per prefill chunk in the step; decode_contexts: the
    cached context length of each decode sequence.
    """

    prefill: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()
    scored_rows: int = 0  # extra logits rows computed to score prompt tokens (prompt_logprobs)

    # memoised: the cost models read these several times for every shape they price
    @_memo
    def prefill_tokens(self) -> int:
        return sum(chunk for chunk, _ in self.prefill)

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass runs: the unit of the token budget."""
        return self.prefill_tokens + len(self.decode_contexts)

    @property
    def logits_rows(self) -> int:
        """Rows of logits computed: one per prefill chunk end and one per decode, and the
        rows that score prompt tokens."""
        return len(self.prefill) + len(self.decode_contexts) + self.scored_rows

    @_memo
    def cached_tokens_read(self) -> int:
        """KV entries read from the cache: every token of context the step attends to."""
        return sum(before for _, before in self.prefill) + sum(self.decode_contexts)

    @property
    def kv_tokens_after(self) -> int:
        """KV entries the step's sequences hold once it has run."""
        return self.cached_tokens_read + self.prefill_tokens + len(self.decode_contexts)

    def counted(self, key: str, count: Callable[[StepShape], float]) -> float:
        """`count(self)`, kept under `key`: a shape never changes, so a count made once
        stands for every model that counts alike (the engine prices a step, a simulated
        executor times it, the step's event reports its FLOPs and bytes)."""
        memo = self.__dict__  # beside the memoised properties, never a field
        value = memo.get(key)
        if value is None:
            value = memo[key] = count(self)
        return value


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first token position computed this step
    num_tokens: int

    @classmethod
    def of(cls, request: Request, start: int, num_tokens: int) -> ScheduledChunk:
        """The object the constructor makes, made for the hot path (a chunk per decode per
        step): see RequestOutput.of."""
        chunk = object.__new__(cls)
        chunk.__dict__.update(request=request, start=start, num_tokens=num_tokens)
        return chunk

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so a new token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.request.is_decoding

    @property
    def scored_rows(self) -> int:
        """Rows whose logits score a prompt token (row i predicts the token at start + i +
        1): those of a prefill chunk whose request asks for prompt logprobs, else none."""
        request = self.request
        if request.params.prompt_logprobs is None or self.is_decode:
            return 0
        return max(0, min(self.num_tokens, request.num_prompt_tokens - 1 - self.start))


@dataclass
class Batch:
    prefills: list[ScheduledChunk] = field(default_factory=list)
    decodes: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    mode: SchedulerMode = SchedulerMode.NORMAL
    # derived once the batch is scheduled (it is not changed after): see shape(), sampling
    _shape: StepShape | None = field(default=None, init=False, repr=False, compare=False)
    _sampling: list[ScheduledChunk] | None = field(default=None, init=False, repr=False,
                                                   compare=False)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """Prefill chunks first, then decodes: the packed order of the forward pass."""
        return self.prefills + self.decodes

    @property
    def sampling(self) -> list[ScheduledChunk]:
        """The chunks that sample a token, in `chunks` order (the rows of the logits); found
        once, before the step's tokens are appended (the runner and the scheduler's update
        both read it). Every decode samples: it computes its request's last token."""
        if self._sampling is None:
            self._sampling = [c for c in self.prefills if c.samples] + self.decodes
        return self._sampling

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + len(self.decodes)

    def shape(self) -> StepShape:
        """The step's shape, built once: the engine prices it and a simulated executor runs
        it."""
        if self._shape is None:
            self._shape = StepShape(prefill=tuple((c.num_tokens, c.start) for c in self.prefills),
                                    decode_contexts=tuple(c.start + 1 for c in self.decodes),
                                    scored_rows=sum(c.scored_rows for c in self.prefills))
        return self._shape


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's sampled tokens by request id; a request whose sampling raised is in
    `errors` (id -> what went wrong) instead, so it fails alone. Requests that
    ask for them get their sampled token's logprob, and the prompt tokens each prefill
    chunk scored (positions from 1: the first prompt token has no prediction)."""

    token_ids: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


class StepTiming(NamedTuple):  # a tuple: made every step
    """When a step's forward pass and sampling ended, how long they took, what the budget
    model predicted."""

    end: float
    duration_s: float
    predicted_s: float


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for a request: its new tokens only, as vLLM V1's outputs;
    whoever needs the whole output keeps it."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    state: str
    # only for requests that ask: the new tokens' logprobs, the scored prompt tokens' (on the
    # request's first output) and where a matched stop string cuts the output text
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    text_end: int | None = None

    @classmethod
    def of(cls, request_id: str, new_token_ids: tuple[int, ...], finished: bool,
           finish_reason: str | None, state: str,
           logprobs: tuple[TokenLogprob, ...] | None = None,
           prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
           text_end: int | None = None) -> RequestOutput:
        """The constructor's object without a frozen __init__'s per-field setattr: made for
        every request every step."""
        output = object.__new__(cls)
        output.__dict__.update(request_id=request_id, new_token_ids=new_token_ids,
                               finished=finished, finish_reason=finish_reason, state=state,
                               logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                               text_end=text_end)
        return output
