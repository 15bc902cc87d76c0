"""Engine events and the double-buffered bus that carries them to observers."""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar


def wall_offset() -> float:
    """Wall-clock minus monotonic time: places monotonic timestamps on the wall clock."""
    return time.time() - time.monotonic()


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = "event"
    # the C function itself: the hot path makes one event per request per step
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
    flops: float = 0.0
    bytes_moved: float = 0.0

    @classmethod
    def of(cls, step: int, prefill_tokens: int, decode_seqs: int, duration_s: float,
           predicted_s: float, mode: str, flops: float, bytes_moved: float,
           ts: float) -> StepComplete:
        """Skip the frozen __init__'s per-field __setattr__: this runs every step."""
        event = object.__new__(cls)
        event.__dict__.update(ts=ts, step=step, prefill_tokens=prefill_tokens,
                              decode_seqs=decode_seqs, duration_s=duration_s,
                              predicted_s=predicted_s, mode=mode, flops=flops,
                              bytes_moved=bytes_moved)
        return event


@dataclass(frozen=True)
class ChunkComplete(Event):
    kind: ClassVar[str] = "chunk_complete"
    request_id: str
    chunk_index: int
    tokens: int
    start: int
    duration_s: float
    estimated_bytes: float
    predicted_s: float
    prefill_done: bool


@dataclass(frozen=True)
class TokensGenerated(Event):
    """A step's new tokens, `token_ids[i]` for `request_ids[i]`: one event a step rather
    than one a token, which is most of the bus's traffic (a request may appear twice)."""

    kind: ClassVar[str] = "tokens"
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]

    @classmethod
    def of(cls, request_ids: tuple[str, ...], token_ids: tuple[int, ...],
           ts: float) -> TokensGenerated:
        """Skip the frozen __init__'s per-field __setattr__: this runs every step."""
        event = object.__new__(cls)
        event.__dict__.update(ts=ts, request_ids=request_ids, token_ids=token_ids)
        return event

    def pairs(self) -> Iterator[tuple[str, int]]:
        """(request_id, token) in the order sampled."""
        return zip(self.request_ids, self.token_ids, strict=True)


@dataclass(frozen=True)
class RequestAdded(Event):
    kind: ClassVar[str] = "request_added"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: dict[str, Any]
    tenant: str
    priority: int = 0
    tag: str | None = None
    generated_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CacheEvict(Event):
    kind: ClassVar[str] = "cache_evict"
    request_id: str
    blocks_freed: int
    usage_after: float


@dataclass(frozen=True)
class PrefixCacheLookup(Event):
    """Admitted with the prefix cache on: `cached_tokens` of its `queried_tokens` were found."""

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
    queue_wait_s: float | None = None


class RejectCause(enum.StrEnum):
    """Why a well-formed request can never be served; observers branch on this, not on wording."""

    BREAKER = "breaker"
    TOO_LONG = "too_long"
    OVER_BUDGET = "over_budget"
    KV_POOL = "kv_pool"


class FailCause(enum.StrEnum):
    CHUNK_TIMEOUT = "chunk_timeout"
    FAULT = "fault"
    ENGINE = "engine"
    CONFIG = "config"


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
    budget_score: float | None  # None: no calibrated plan (an SLO breach stored it)
    prompt_tokens: int
    prefill_s: float
    budgeted_s: float
    chunks: tuple[dict[str, Any], ...]
    config: dict[str, Any]
    tag: str | None = None
    timeline: dict[str, Any] = field(default_factory=dict)
    cause: str | None = None
    cause_share: float | None = None
    verdict: str = ""
    cached_tokens: int = 0
    resumed_tokens: int | None = None  # output tokens it had when resumed from the journal
    rules: tuple[str, ...] = ("budget_score",)  # which rules stored it
    represents: int = 1  # itself and the SLO breaches sampled out before it
    # what the user felt most (queue_wait, prefill, decode_stall), its cause and share of it;
    # `cause` and `cause_share` are the prefill overrun's, the budget_score's reading
    felt_part: str | None = None
    felt_cause: str | None = None
    felt_share: float | None = None


@dataclass(frozen=True)
class ModeChanged(Event):
    kind: ClassVar[str] = "mode_changed"
    old: str
    new: str
    reason: str


@dataclass(frozen=True)
class ConfigChanged(Event):
    kind: ClassVar[str] = "config_changed"
    changes: dict[str, tuple[Any, Any]]
    source: str


@dataclass(frozen=True)
class PauseChanged(Event):
    """The operator paused stepping (`paused`), or resumed it."""

    kind: ClassVar[str] = "pause_changed"
    paused: bool


@dataclass(frozen=True)
class SessionStarted(Event):
    """A process (serve, the console, run, bench) started the engine on its store; `orphans`
    is how many requests the process before it left unfinished, closed at this start."""

    kind: ClassVar[str] = "session_started"
    orphans: int = 0


@dataclass(frozen=True)
class Drift(Event):
    kind: ClassVar[str] = "drift"
    deviation: float
    detail: str


@dataclass(frozen=True)
class CalibrationProgress(Event):
    """A calibration sweep under way: `fraction` done (1.0: applied), what runs now and why."""

    kind: ClassVar[str] = "calibration_progress"
    fraction: float
    note: str
    reason: str


@dataclass(frozen=True)
class GuardAction(Event):

    kind: ClassVar[str] = "guard"
    layer: str
    engaged: bool
    detail: str


@dataclass(frozen=True)
class EngineRestarted(Event):
    """A step's fault restarted the engine from its journal, or a crash loop `stopped` it."""

    kind: ClassVar[str] = "engine_restarted"
    restarts: int
    place: str
    error: str
    resumed: int
    failed: int
    stopped: bool = False
    traceback: str = ""


Subscriber = Callable[[Event], None]


class EventBus:
    """`clock`, when given, stamps every published event (simulated seconds when simulated)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock
        self._front: list[Event] = []
        self._back: list[Event] = []
        self._lock = threading.Lock()
        # replaced, never mutated: a (un)subscribe mid-drain changes only the later events
        self._subscribers: tuple[tuple[Subscriber, tuple[type[Event], ...]], ...] = ()
        self._routes: dict[type[Event], tuple[Subscriber, ...]] = {}

    def subscribe(self, fn: Subscriber, kinds: tuple[type[Event], ...] = ()
                  ) -> Callable[[], None]:
        """`fn` hears every event, or only those of `kinds` (subclasses included)."""
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
        with self._lock:
            self._front, self._back = self._back, self._front
        delivered = self._back
        for index, event in enumerate(delivered):
            route = self._routes.get(type(event))
            try:
                for fn in self._route(type(event)) if route is None else route:
                    fn(event)
            except BaseException:
                # undelivered events go first at the next drain: a restarted engine journals them
                with self._lock:
                    self._front[:0] = delivered[index + 1:]
                delivered.clear()
                raise
        count = len(delivered)
        delivered.clear()
        return count
