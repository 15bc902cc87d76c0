"""The protection layers of seed 000 §6 as a pure policy: `Guards.evaluate(inputs)` returns
decisions (fail these requests, compact the KV pool, pause prefill) and the GuardAction events
to publish; the engine applies them. Guards never touch the engine.

1 breaker        a prompt over max_prefill_tokens × 1.2 was rejected within guard_window_s
2 throttle       the scheduler's bandwidth throttle level is above 0
3 defrag         KV fragmentation over defrag_threshold: the pool is compacted (and, on CUDA,
                 torch's cache emptied) at most every defrag_interval_s
4 chunk_timeout  a prefill chunk ran over base × (1 + 0.1 × chunk index): its request fails with
                 the reason and its KV blocks go back; the others go on
5 drift          the drift detector published a Drift event within guard_window_s
6 degraded       layers 1-4 all engaged: one prefill at a time in chunk_tile-sized chunks while
                 decodes go on (`scheduler.prefill_paused`), so the service never stops

Layer 7 is chaos (`engine.harness.chaos`) and fault isolation: a request that one of its own
errors failed (sampling, stop check, output) is counted and reported as a `fault_isolation`
action; the others go on. Hand-over: every layer is evaluated at each step
boundary and whenever an event reports a fault, and layers are set in order within one
evaluation, so the layer after one that failed to contain a fault engages at the instant the
fault is detected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.config import EngineConfig
from engine.core.intake import BREAKER_FACTOR
from engine.events import Drift, Event, FailCause, Failed, GuardAction, RejectCause, Rejected

LAYERS = ("breaker", "throttle", "defrag", "chunk_timeout", "drift", "degraded")
TIMEOUT_GROWTH = 0.1  # seed 000 §6: timeout = base × (1 + 0.1 × chunk index)


class ChunkRun(NamedTuple):  # a tuple: made at least once a step
    """A prefill chunk the last step ran, for layer 4."""

    request_id: str
    chunk_index: int
    duration_s: float


class GuardInputs(NamedTuple):  # a tuple: made at least once a step
    now: float
    config: EngineConfig
    throttle_level: int
    bandwidth_util: float
    # KV fragmentation measured after a step (None before one: the last measure stands)
    fragmentation: float | None = None
    chunks: tuple[ChunkRun, ...] = ()


@dataclass(frozen=True)
class GuardDecisions:
    fail: tuple[tuple[str, str], ...] = ()  # (request id, reason): layer 4
    compact: bool = False  # layer 3: compact the KV pool now
    prefill_paused: bool = False  # layer 6
    events: tuple[GuardAction, ...] = ()  # to publish, in order


_QUIET = GuardDecisions()
_PAUSED = GuardDecisions(prefill_paused=True)


def chunk_timeout_s(config: EngineConfig, chunk_index: int) -> float:
    """The time a prefill chunk may take; 0 when layer 4 is off."""
    return config.chunk_timeout_base_ms / 1000 * (1 + TIMEOUT_GROWTH * chunk_index)


# the events that can report a fault; the engine hands the guards no other kind
FAULT_EVENTS = (Rejected, Drift, Failed)


class Guards:
    def __init__(self) -> None:
        self.fragmentation = 0.0  # the larger of KV block tails and, on CUDA, allocator slack
        self.faults_isolated = 0  # requests failed alone by their own error (layer 7)
        self._engaged = (False,) * len(LAYERS)  # in LAYERS order
        self._last_breaker: float | None = None
        self._last_timeout: float | None = None
        self._last_drift: float | None = None
        self._last_defrag: float | None = None
        self._timeout_detail = ""
        self._drift_detail = ""
        self._pending: list[GuardAction] = []  # actions seen between evaluations

    def engaged(self) -> tuple[str, ...]:
        return tuple(name for name, on in zip(LAYERS, self._engaged, strict=True) if on)

    def observe(self, event: Event, clock: Callable[[], float]) -> bool:
        """Note an event that reports a fault, at `clock()`; True when the layers should be
        evaluated now (so the next layer takes over at the instant the fault is seen)."""
        if not isinstance(event, FAULT_EVENTS):
            return False
        now = clock()  # read only for a fault
        if isinstance(event, Rejected) and event.cause is RejectCause.BREAKER:
            self._last_breaker = now
        elif isinstance(event, Drift):
            self._last_drift = now
            self._drift_detail = f"budget drift {event.deviation:.0%}: {event.detail}"
        elif isinstance(event, Failed) and event.cause is FailCause.FAULT:
            self.faults_isolated += 1
            self._pending.append(GuardAction(
                layer="fault_isolation", engaged=True, ts=now,
                detail=f"request {event.request_id} failed alone: {event.reason}"))
        else:
            return False
        return True

    def evaluate(self, inputs: GuardInputs) -> GuardDecisions:
        now, cfg = inputs.now, inputs.config
        events, self._pending = self._pending, []
        fail = []
        for run in inputs.chunks:  # layer 4
            limit = chunk_timeout_s(cfg, run.chunk_index)
            if not limit or run.duration_s <= limit:
                continue
            reason = (f"chunk timeout: prefill chunk {run.chunk_index} took "
                      f"{run.duration_s * 1000:.0f} ms, over {limit * 1000:.0f} ms "
                      f"(chunk_timeout_base_ms × (1 + {TIMEOUT_GROWTH} × {run.chunk_index})); "
                      f"its KV blocks were released")
            fail.append((run.request_id, reason))
            self._last_timeout = now
            self._timeout_detail = f"request {run.request_id}: {reason}"
            events.append(GuardAction(layer="chunk_timeout", engaged=True, ts=now,
                                      detail=self._timeout_detail))
        compact = False
        if inputs.fragmentation is not None:  # layer 3
            self.fragmentation = inputs.fragmentation
            due = self._last_defrag is None or now - self._last_defrag >= cfg.defrag_interval_s
            if self.fragmentation > cfg.defrag_threshold and due:
                self._last_defrag = now
                compact = True

        window = cfg.guard_window_s
        breaker = self._last_breaker is not None and now - self._last_breaker < window
        throttle = inputs.throttle_level > 0
        defrag = self.fragmentation > cfg.defrag_threshold
        timeout = self._last_timeout is not None and now - self._last_timeout < window
        drift = self._last_drift is not None and now - self._last_drift < window
        degraded = cfg.degraded_path and breaker and throttle and defrag and timeout  # 1-4
        engaged = (breaker, throttle, defrag, timeout, drift, degraded)  # LAYERS order
        if engaged != self._engaged:  # evaluated twice a step: compare first, word later
            for name, now_on, was_on in zip(LAYERS, engaged, self._engaged, strict=True):
                if now_on != was_on:
                    events.append(GuardAction(
                        layer=name, engaged=now_on, ts=now,
                        detail=self._detail(name, inputs) if now_on else "released"))
            self._engaged = engaged
        if not (fail or compact or events):  # most evaluations: the shared "nothing to do"
            return _PAUSED if degraded else _QUIET
        return GuardDecisions(fail=tuple(fail), compact=compact, prefill_paused=degraded,
                              events=tuple(events))

    def _detail(self, layer: str, inputs: GuardInputs) -> str:
        """Why `layer` engaged; built only when it does (evaluate runs twice a step)."""
        cfg = inputs.config
        match layer:
            case "breaker":
                return (f"rejected a prompt over max_prefill_tokens × {BREAKER_FACTOR} within "
                        f"the last {cfg.guard_window_s:g} s")
            case "throttle":
                return (f"bandwidth 5 s average {inputs.bandwidth_util:.0%}: throttle level "
                        f"{inputs.throttle_level}")
            case "defrag":
                return (f"KV fragmentation {self.fragmentation:.0%} over defrag_threshold "
                        f"{cfg.defrag_threshold:.0%}")
            case "chunk_timeout":
                return self._timeout_detail
            case "drift":
                return self._drift_detail
            case _:  # degraded
                return ("layers 1-4 engaged: one prefill at a time in chunk_tile-sized chunks "
                        "while decodes go on")


def allocator_fragmentation(device: torch.device) -> float:
    """CUDA memory torch holds but no tensor uses, as a share of what it holds; 0 elsewhere."""
    if device.type != "cuda":
        return 0.0
    reserved = torch.cuda.memory_reserved(device)
    if not reserved:
        return 0.0
    return 1.0 - torch.cuda.memory_allocated(device) / reserved
