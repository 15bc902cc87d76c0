"""The step's contracts, free of torch: Batch, ModelRunnerOutput, step cost, RequestOutput."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from engine.config import SamplingParams


class TokenLogprob(NamedTuple):  # a tuple: one per token of a request that asks
    """A token's log-probability, its rank (1 is likeliest) and the top N pairs, likeliest first."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class ChunkTiming:
    """One prefill chunk as its step was booked (a part of the request's timeline)."""

    index: int
    start: int
    tokens: int
    duration_s: float
    predicted_s: float  # the step's predicted time, whole
    step_start: float = 0.0  # when the step's forward pass began (the engine's clock)
    step: int = 0
    decodes: int = 0
    other_prefill_tokens: int = 0
    mode: str = "NORMAL"
    throttle_level: int = 0
    attempt: int = 0  # preemptions before it: chunks of an earlier attempt were recomputed
    contended: bool = False  # other processes took the host's CPUs around its step


@dataclass(frozen=True)
class PlannedChunk:
    """One chunk of a request's prefill plan: positions, predicted step time, steps waited."""

    start: int
    tokens: int
    predicted_s: float
    wait_s: float = 0.0
    wait_steps: int = 0
    decodes: int = 0
    other_prefill_tokens: int = 0

    @property
    def budget_s(self) -> float:
        return self.wait_s + self.predicted_s


class SchedulerMode(enum.StrEnum):
    NORMAL = "NORMAL"
    CACHE_PRESSURE_WAIT = "CACHE_PRESSURE_WAIT"
    BANDWIDTH_THROTTLE = "BANDWIDTH_THROTTLE"


class _memo:  # a decorator, named like the one it stands for
    """functools.cached_property without its per-class lock: shapes are made every step."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self._fn, self._name = fn, fn.__name__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self._name] = self._fn(obj)
        return value


@dataclass(frozen=True)
class StepShape:
    """A step's work: (chunk_tokens, context_before) per prefill chunk, each decode's context."""

    prefill: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()
    scored_rows: int = 0  # extra logits rows computed to score prompt tokens (prompt_logprobs)

    @_memo
    def prefill_tokens(self) -> int:
        return sum(chunk for chunk, _ in self.prefill)

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass runs: the unit of the token budget."""
        return self.prefill_tokens + len(self.decode_contexts)

    @property
    def logits_rows(self) -> int:
        return len(self.prefill) + len(self.decode_contexts) + self.scored_rows

    @_memo
    def cached_tokens_read(self) -> int:
        """KV entries read from the cache: every token of context the step attends to."""
        return sum(before for _, before in self.prefill) + sum(self.decode_contexts)

    @property
    def kv_tokens_after(self) -> int:
        return self.cached_tokens_read + self.prefill_tokens + len(self.decode_contexts)

    def counted(self, key: str, count: Callable[[StepShape], float]) -> float:
        """`count(self)`, kept under `key`: a shape never changes."""
        memo = self.__dict__  # beside the memoised properties, never a field
        value = memo.get(key)
        if value is None:
            value = memo[key] = count(self)
        return value


@dataclass(frozen=True)
class NewRequest:
    """A request entering the runner (on admission, or after a preemption or restart): sent once."""

    id: str
    prompt_token_ids: Sequence[int]  # never changed once the request is made
    output_token_ids: tuple[int, ...]  # generated before it entered: recomputed with the prompt
    params: SamplingParams
    block_ids: tuple[int, ...]  # its KV blocks as it enters, prefix-cached ones first


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: tokens [start, start + num_tokens) and its new KV blocks."""

    request_id: str
    start: int
    num_tokens: int
    new_block_ids: tuple[int, ...] = ()
    is_decode: bool = False
    samples: bool = True  # it reaches the end of the known tokens, so a token is sampled
    scored_rows: int = 0  # rows scoring prompt tokens (row i predicts start + i + 1)

    @classmethod
    def of(cls, request_id: str, start: int, num_tokens: int,
           new_block_ids: tuple[int, ...] = (), is_decode: bool = False, samples: bool = True,
           scored_rows: int = 0) -> ScheduledChunk:
        """The constructor's object, without a frozen __init__'s per-field setattr."""
        chunk = object.__new__(cls)
        chunk.__dict__.update(request_id=request_id, start=start, num_tokens=num_tokens,
                              new_block_ids=new_block_ids, is_decode=is_decode,
                              samples=samples, scored_rows=scored_rows)
        return chunk


@dataclass
class Batch:
    """The scheduler's message to the runner, no live request: the runner drops `finished`, then
    `preempted`, takes `new_requests` and runs the chunks (Unheard: ids told while none runs)."""

    prefills: list[ScheduledChunk] = field(default_factory=list)
    decodes: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    # request ids preempted this step (and in steps before it that ran nothing)
    preempted: list[str] = field(default_factory=list)
    # ids of requests that ended (finished, aborted, failed) since the last batch that ran
    finished: list[str] = field(default_factory=list)
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
        """The chunks that sample a token, in logits-row order."""
        if self._sampling is None:
            self._sampling = [c for c in self.prefills if c.samples] + self.decodes
        return self._sampling

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + len(self.decodes)

    def shape(self) -> StepShape:
        if self._shape is None:
            # lists, not generators, into tuple(): a generator's frame costs more than its items
            self._shape = StepShape(prefill=tuple([(c.num_tokens, c.start) for c in self.prefills]),
                                    decode_contexts=tuple([c.start + 1 for c in self.decodes]),
                                    scored_rows=sum([c.scored_rows for c in self.prefills]))
        return self._shape


@dataclass
class Unheard:
    """Ids the runner has yet to hear ended or preempted: only batches with chunks are run."""

    ended: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    def tell(self, batch: Batch) -> None:
        """Put on a scheduled `batch` all the runner has yet to hear, if it runs."""
        self.preempted += batch.preempted
        if batch.prefills or batch.decodes:
            batch.finished, batch.preempted = self.ended, self.preempted
            self.ended, self.preempted = [], []


@contextmanager
def lent(run: Callable[[Batch], object], requests: Sequence[NewRequest]) -> Iterator[None]:
    """Lend `requests` to a runner for the block, outside any scheduler (probes, warm-ups)."""
    run(Batch(new_requests=list(requests)))
    try:
        yield
    finally:
        run(Batch(finished=[r.id for r in requests]))


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's sampled tokens or per-request errors by request id, and asked-for logprobs."""

    token_ids: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


class HostMark(NamedTuple):  # a tuple: made every step
    """The host around a step: whether other work took its CPUs or its GPU (a contended
    step)."""

    contended: bool = False
    others_cpus: float = 0.0  # CPUs' worth of other processes' time
    steal: float = 0.0  # share of CPU time the hypervisor took
    own_cpus: float = 0.0  # this process's CPU time over wall time
    measured: bool = False  # False: no reading yet, or a simulated device's host
    others_gpu: float = 0.0  # other processes' share of the GPU's SM time (NVML)
    # who they are, as nvitop lists them ("python[4242] 37% SM 2.1 GiB"); "": no GPU reading
    gpu_others: str = ""


QUIET = HostMark()


class StepTiming(NamedTuple):  # a tuple: made every step
    """When a step's forward pass ended, how long it took and what was predicted."""

    end: float
    duration_s: float
    predicted_s: float
    host: HostMark = QUIET  # the host's mark at its end: did other work take the CPUs

    @property
    def contended(self) -> bool:
        return self.host.contended


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for a request: its new tokens only, as vLLM V1's outputs."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    state: str
    # only for requests that ask; prompt logprobs come on the request's first output
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    text_end: int | None = None

    @classmethod
    def of(cls, request_id: str, new_token_ids: tuple[int, ...], finished: bool,
           finish_reason: str | None, state: str,
           logprobs: tuple[TokenLogprob, ...] | None = None,
           prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
           text_end: int | None = None) -> RequestOutput:
        """The constructor's object without a frozen __init__'s setattr: made every step."""
        output = object.__new__(cls)
        output.__dict__.update(request_id=request_id, new_token_ids=new_token_ids,
                               finished=finished, finish_reason=finish_reason, state=state,
                               logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                               text_end=text_end)
        return output
