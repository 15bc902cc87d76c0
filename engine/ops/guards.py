"""The protection layers as a pure policy: events in, per-step decisions out for the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from engine.config import EngineConfig
from engine.core.equipment import GuardDecisions, GuardInputs
from engine.core.intake import BREAKER_FACTOR
from engine.events import (
    ChunkComplete,
    Drift,
    EventBus,
    FailCause,
    Failed,
    Finished,
    GuardAction,
    RejectCause,
    Rejected,
)

if TYPE_CHECKING:
    import torch

LAYERS = ("breaker", "throttle", "defrag", "chunk_timeout", "drift", "degraded")
TIMEOUT_GROWTH = 0.1


class ChunkRun(NamedTuple):
    """A prefill chunk the last step ran, for layer 4."""

    request_id: str
    chunk_index: int
    duration_s: float


_QUIET = GuardDecisions()
_PAUSED = GuardDecisions(prefill_paused=True)


def chunk_timeout_s(config: EngineConfig, chunk_index: int) -> float:
    """The time a prefill chunk may take; 0 when layer 4 is off."""
    return config.chunk_timeout_base_ms / 1000 * (1 + TIMEOUT_GROWTH * chunk_index)


class Guards:
    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.fragmentation = 0.0
        self.faults_isolated = 0
        self._engaged = (False,) * len(LAYERS)
        self._last_breaker: float | None = None
        self._last_timeout: float | None = None
        self._last_drift: float | None = None
        self._last_defrag: float | None = None
        self._timeout_detail = ""
        self._drift_detail = ""
        self._pending: list[GuardAction] = []
        self._chunks: dict[str, ChunkRun] = {}

    def engaged(self) -> tuple[str, ...]:
        return tuple(name for name, on in zip(LAYERS, self._engaged, strict=True) if on)

    def subscribe_to(self, bus: EventBus) -> None:
        bus.subscribe(self._on_chunk, (ChunkComplete,))
        bus.subscribe(self._on_end, (Rejected, Drift, Failed, Finished))

    def _on_chunk(self, event: ChunkComplete) -> None:
        self._chunks[event.request_id] = ChunkRun(event.request_id, event.chunk_index,
                                                  event.duration_s)

    def _on_end(self, event: Rejected | Drift | Failed | Finished) -> None:
        """Note the fault an event reports; an ended request's chunk no longer times out."""
        if isinstance(event, Rejected) and event.cause is RejectCause.BREAKER:
            self._last_breaker = event.ts
        elif isinstance(event, Drift):
            self._last_drift = event.ts
            self._drift_detail = f"budget drift {event.deviation:.0%}: {event.detail}"
        elif isinstance(event, Failed | Finished):
            self._chunks.pop(event.request_id, None)
            if isinstance(event, Failed) and event.cause is FailCause.FAULT:
                self.faults_isolated += 1
                self._pending.append(GuardAction(
                    layer="fault_isolation", engaged=True, ts=event.ts,
                    detail=f"request {event.request_id} failed alone: {event.reason}"))

    def evaluate(self, inputs: GuardInputs) -> GuardDecisions:
        now, cfg = inputs.now, inputs.config
        events, self._pending = self._pending, []
        runs, self._chunks = self._chunks, {}
        fail = []
        for run in runs.values():
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
        if inputs.fragmentation is not None:
            self.fragmentation = max(inputs.fragmentation, allocator_fragmentation(self.device))
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
        degraded = cfg.degraded_path and breaker and throttle and defrag and timeout
        engaged = (breaker, throttle, defrag, timeout, drift, degraded)
        if engaged != self._engaged:
            for name, now_on, was_on in zip(LAYERS, engaged, self._engaged, strict=True):
                if now_on != was_on:
                    events.append(GuardAction(
                        layer=name, engaged=now_on, ts=now,
                        detail=self._detail(name, inputs) if now_on else "released"))
            self._engaged = engaged
        if not (fail or compact or events):
            return _PAUSED if degraded else _QUIET
        return GuardDecisions(fail=tuple(fail), compact=compact, prefill_paused=degraded,
                              events=tuple(events))

    def _detail(self, layer: str, inputs: GuardInputs) -> str:
        """Why `layer` engaged; built only when it does."""
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
            case _:
                return ("layers 1-4 engaged: one prefill at a time in chunk_tile-sized chunks "
                        "while decodes go on")


def allocator_fragmentation(device: torch.device | None) -> float:
    """CUDA memory torch holds but no tensor uses, as a share of what it holds; 0 elsewhere."""
    if device is None or device.type != "cuda":
        return 0.0
    import torch
    reserved = torch.cuda.memory_reserved(device)
    if not reserved:
        return 0.0
    return 1.0 - torch.cuda.memory_allocated(device) / reserved
