"""What the step loop is equipped with from above core, as protocols."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from engine.batch import QUIET, HostMark
from engine.clock import Clock
from engine.config import EngineConfig
from engine.core.request import Request
from engine.events import Event, EventBus, GuardAction

if TYPE_CHECKING:
    import torch


class BandwidthReading(NamedTuple):  # a tuple: made at least once a step
    util_5s: float  # fraction of peak memory bandwidth, averaged over the window
    source: str  # "nvml-gpm" (DRAM bandwidth, measured) | "model" | "injected"
    # read off the hardware (GPM, an injected reading), not estimated from the engine's
    # bytes: only such a figure may throttle
    measured: bool = False
    note: str = ""  # why the share is unknown, where it is (shown instead of it)


class HostSense(Protocol):
    latest: HostMark  # the last reading, as the snapshot shows it

    def mark(self, now: float) -> HostMark: ...

    def close(self) -> None: ...  # releases what it reads through (NVML): as its engine ends


class BandwidthSource(Protocol):
    def reading(self) -> BandwidthReading: ...

    def record(self, bytes_moved: float, duration_s: float) -> None: ...

    def close(self) -> None: ...  # stops any sampler thread: called as its engine ends


class GuardInputs(NamedTuple):  # a tuple: made every step
    now: float
    config: EngineConfig
    throttle_level: int
    bandwidth_util: float
    # KV fragmentation after a step that ran (None otherwise: the last measure stands)
    fragmentation: float | None = None


@dataclass(frozen=True)
class GuardDecisions:
    fail: tuple[tuple[str, str], ...] = ()  # (request id, reason)
    compact: bool = False
    prefill_paused: bool = False  # the degraded path
    events: tuple[GuardAction, ...] = ()  # to publish, in order


class Guard(Protocol):
    """The protection layers: they hear the events, the engine asks them once per step."""

    fragmentation: float
    faults_isolated: int

    def subscribe_to(self, bus: EventBus) -> None: ...

    def evaluate(self, inputs: GuardInputs) -> GuardDecisions: ...

    def engaged(self) -> tuple[str, ...]: ...


class Metrics(Protocol):
    def subscribe_to(self, bus: EventBus) -> None: ...

    def snapshot_fields(self, now: float) -> dict[str, Any]:
        ...


class PrefillWatch(Protocol):
    """Slow-query classification, fed the scheduler's events as they happen."""

    def mode(self, ts: float, mode: str, throttle_level: int, paused: bool) -> None: ...

    def step(self, start: float, end: float, step: int, mode: str, throttle_level: int,
             paused: bool, prefills: tuple[str, ...], decodes: int,
             host: HostMark = QUIET, waiting: int = 0) -> None: ...

    def arrived(self, ts: float) -> None: ...

    def hold(self, ts: float, held: bool) -> None: ...

    def prefill_ended(self, request: Request, end: float, config: EngineConfig,
                      step_overhead_s: float) -> None: ...

    def ended(self, request: Request, config: EngineConfig) -> None: ...

    def clear(self) -> None: ...

    @property
    def unstored(self) -> int: ...


class Equipment(Protocol):
    """Builds each piece once the engine knows what it needs (its device, peak, bus)."""

    def bandwidth(self, device: torch.device, peak_bytes_per_s: float,
                  clock: Clock) -> BandwidthSource: ...

    def guards(self, device: torch.device) -> Guard: ...

    def metrics(self, config: EngineConfig) -> Metrics: ...

    def prefill_watch(self, publish: Callable[[Event], None]) -> PrefillWatch: ...

    def host(self, clock: Clock, device: torch.device, simulated: bool) -> HostSense: ...
