"""Engine events and the double-buffered bus that carries them to observers.

The hot loop only records (vLLM V1 style): events carry monotonic timestamps and raw
figures; observers (store, metrics, console, HTTP) turn them into intervals and rates.

Producers on any thread `publish` into the front buffer; the engine loop calls `drain`,
which swaps buffers under a lock and hands the back buffer to subscribers in order. No
event is lost or reordered, and producers never wait on a subscriber (seed 000 §4).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


def wall_offset() -> float:
    """What turns a monotonic timestamp (an event's `ts`) into wall-clock time on this
    machine: the store stamps its rows with it, and snapshots carry it (Snapshot.wall_offset)
    so a console elsewhere can place those rows on the snapshots' timeline."""
    return time.time() - time.monotonic()


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = "event"
    # the C function itself: a token event per request per step is made with this default
    ts: float = field(default_factory=time.monotonic, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class StepComplete(Event):
    kind: ClassVar[str] = "step_complete"
    step: int
    prefill_tokens: int
    decode_seqs: int
    duration_s: float
    predicted_s: float = 0.0
    mode: str = "NORMAL"
    flops: float = 0.0  # the budget model's count for this step (for MFU)
    bytes_moved: float = 0.0  # likewise for memory traffic (for MBU and bandwidth)


@dataclass(frozen=True)
class ChunkComplete(Event):
    kind: ClassVar[str] = "chunk_complete"
    request_id: str
    chunk_index: int
    tokens: int
    start: int  # first prompt position the chunk covered
    duration_s: float
    estimated_bytes: float
    predicted_s: float
    prefill_done: bool


@dataclass(frozen=True)
class TokensGenerated(Event):
    """Tokens appended to a request in one step (journal and streaming read these)."""

    kind: ClassVar[str] = "tokens"
    request_id: str
    token_ids: tuple[int, ...]

    @classmethod
    def of(cls, request_id: str, token_ids: tuple[int, ...], ts: float) -> TokensGenerated:
        """The object the constructor makes, made for the step's hot path (an event per
        request per step): a frozen dataclass's __init__ sets each field through
        object.__setattr__, about twice as slow as filling the new object's __dict__."""
        event = object.__new__(cls)
        event.__dict__.update(ts=ts, request_id=request_id, token_ids=token_ids)
        return event


@dataclass(frozen=True)
class RequestAdded(Event):
    kind: ClassVar[str] = "request_added"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: dict[str, Any]
    tenant: str
    priority: int = 0
    tag: str | None = None
    generated_token_ids: tuple[int, ...] = ()  # kept from before a crash (resume)


@dataclass(frozen=True)
class CacheEvict(Event):
    kind: ClassVar[str] = "cache_evict"
    request_id: str
    blocks_freed: int
    usage_after: float


@dataclass(frozen=True)
class PrefixCacheLookup(Event):
    """A request admitted with the prefix cache on: of the `queried_tokens` it holds, the
    first `cached_tokens` were found computed (vLLM's prefix_cache_queries / _hits)."""

    kind: ClassVar[str] = "prefix_cache_lookup"
    request_id: str
    queried_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Preempted(Event):
    kind: ClassVar[str] = "preempted"
    request_id: str
    reason: str
    tokens_discarded: int


@dataclass(frozen=True)
class Finished(Event):
    kind: ClassVar[str] = "finished"
    request_id: str
    reason: str  # "length" | "stop" | "aborted"
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float | None
    e2e_s: float
    budget_score: float | None
    queue_wait_s: float | None = None  # arrival to first admission


class RejectCause(enum.StrEnum):
    """Why a well-formed request can never be served; observers branch on this, never on
    the wording of the reason."""

    BREAKER = "breaker"  # protection layer 1: prompt over max_prefill_tokens × BREAKER_FACTOR
    TOO_LONG = "too_long"  # prompt + max_tokens over max_model_len
    OVER_BUDGET = "over_budget"  # chunking off and the prompt over the token budget
    KV_POOL = "kv_pool"  # needs more KV blocks than the whole pool


class FailCause(enum.StrEnum):
    CHUNK_TIMEOUT = "chunk_timeout"  # protection layer 4
    FAULT = "fault"  # an exception in this request's sampling, stop check or output
    ENGINE = "engine"  # the engine failed in its steps, not for this request's sake
    CONFIG = "config"  # a live config change left it a prefill the engine cannot run


@dataclass(frozen=True)
class Rejected(Event):
    kind: ClassVar[str] = "rejected"
    request_id: str
    reason: str
    cause: RejectCause


@dataclass(frozen=True)
class Failed(Event):
    kind: ClassVar[str] = "failed"
    request_id: str
    reason: str
    cause: FailCause


@dataclass(frozen=True)
class SlowQuery(Event):
    kind: ClassVar[str] = "slow_query"
    request_id: str
    tenant: str
    budget_score: float
    prompt_tokens: int
    prefill_s: float
    budgeted_s: float
    chunks: tuple[dict[str, Any], ...]
    config: dict[str, Any]
    tag: str | None = None
    # where its time went (engine.ops.timeline.Timeline.to_dict), published when it ends
    timeline: dict[str, Any] = field(default_factory=dict)
    cause: str | None = None  # engine.ops.timeline.Cause: what the overrun is attributed to
    cause_share: float | None = None  # that cause's part of the overrun, 0..1
    verdict: str = ""  # one line: the cause, its time and share
    cached_tokens: int = 0  # prompt tokens found in the prefix cache: never prefilled
    resumed_tokens: int | None = None  # resumed from the journal: output tokens it had then


@dataclass(frozen=True)
class ModeChanged(Event):
    kind: ClassVar[str] = "mode_changed"
    old: str
    new: str
    reason: str


@dataclass(frozen=True)
class ConfigChanged(Event):
    kind: ClassVar[str] = "config_changed"
    changes: dict[str, tuple[Any, Any]]  # field -> (old, new)
    source: str


@dataclass(frozen=True)
class Drift(Event):
    kind: ClassVar[str] = "drift"
    deviation: float  # relative difference of the new table from the stored one
    detail: str


@dataclass(frozen=True)
class CalibrationProgress(Event):
    """A calibration sweep under way: `fraction` done (1.0: applied), what runs now, and why
    it runs (the first calibration at start, persistent drift, on demand)."""

    kind: ClassVar[str] = "calibration_progress"
    fraction: float
    note: str
    reason: str


@dataclass(frozen=True)
class GuardAction(Event):
    """A protection layer engaged or released."""

    kind: ClassVar[str] = "guard"
    layer: str
    engaged: bool
    detail: str


@dataclass(frozen=True)
class EngineRestarted(Event):
    """A step raised an exception that was no single request's fault: the engine was
    restarted from its journal (`stopped` False), or a crash loop stopped it (True)."""

    kind: ClassVar[str] = "engine_restarted"
    restarts: int  # restarts so far, this one included
    place: str  # file:line in function where the exception was raised
    error: str  # the exception, repr()
    resumed: int  # requests resumed by this restart
    failed: int  # requests failed by it (twice in a failed step, or the engine stopped)
    stopped: bool = False
    traceback: str = ""  # the exception's formatted traceback, as logged


Subscriber = Callable[[Event], None]


class EventBus:
    """`clock`, when given, stamps every published event: an engine on a simulated clock
    times its events in simulated seconds, as its requests are."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock
        self._front: list[Event] = []
        self._back: list[Event] = []
        self._lock = threading.Lock()
        # replaced, never mutated: a subscriber that (un)subscribes mid-drain changes only
        # the events after the one it is hearing
        self._subscribers: tuple[tuple[Subscriber, tuple[type[Event], ...]], ...] = ()
        # event type -> the subscribers that hear it, in subscription order; built on first
        # sight of a type and dropped whenever the subscribers change
        self._routes: dict[type[Event], tuple[Subscriber, ...]] = {}

    def subscribe(self, fn: Subscriber, kinds: tuple[type[Event], ...] = ()
                  ) -> Callable[[], None]:
        """`fn` hears every event, or only those of `kinds` (subclasses included): most
        events are a token per request per step, which a subscriber to a few kinds is then
        never called for."""
        self._subscribers = (*self._subscribers, (fn, kinds))
        self._routes = {}
        return lambda: self._unsubscribe(fn)

    def _unsubscribe(self, fn: Subscriber) -> None:
        subscribers = list(self._subscribers)
        subscribers.remove(next(s for s in subscribers if s[0] == fn))
        self._subscribers = tuple(subscribers)
        self._routes = {}

    def _route(self, kind: type[Event]) -> tuple[Subscriber, ...]:
        route = self._routes[kind] = tuple(fn for fn, kinds in self._subscribers
                                           if not kinds or issubclass(kind, kinds))
        return route

    def publish(self, event: Event) -> None:
        if self._clock is not None:  # before any subscriber sees it; frozen for them
            object.__setattr__(event, "ts", self._clock())
        with self._lock:
            self._front.append(event)

    def drain(self) -> int:
        """Swap buffers and deliver everything published so far, in order."""
        with self._lock:
            self._front, self._back = self._back, self._front
        delivered = self._back
        for index, event in enumerate(delivered):
            route = self._routes.get(type(event))  # read per event: see _subscribers
            try:
                for fn in self._route(type(event)) if route is None else route:
                    fn(event)
            except BaseException:
                # the events after the one that failed go first at the next drain, once,
                # so an engine restarted after the fault still journals what was accepted
                with self._lock:
                    self._front[:0] = delivered[index + 1:]
                delivered.clear()
                raise
        count = len(delivered)
        delivered.clear()
        return count
