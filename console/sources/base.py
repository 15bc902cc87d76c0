"""The one narrow interface the console reads an engine through, and what each source can do.

Every source (an embedded engine, a recorded session, an HTTP-attached server, a fleet) hands
the console snapshots. Beyond that, each declares its `capabilities`: tuning, pausing,
recalibrating, the store's slow queries and histories, and whether the snapshot's watermarks
and chunk queue mean anything. A capability brings the methods of its facet protocol
(`Tunable`, `Pausable`, ...); a source implements only the facets it declares, and says why it
lacks the others, so a screen shows "not available on this source" with that reason instead
of an empty list from a stub. Store rows arrive as the store's own records (engine.store),
newest first; the screens name those record types from here, so the TUI never imports the
store (tests/test_layering.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from engine.errors import EngineError
from engine.snapshot import Snapshot

if TYPE_CHECKING:  # the store pulls in SQLAlchemy: kept off the launch path (and the
    # record types are the Source's vocabulary: the TUI imports them from here)
    from engine.store import (
        CalibrationRecord,
        ConfigChangeRecord,
        DriftRecord,
        SlowQueryRecord,
        StoredMetrics,
        TracedDriftPoint,
    )

Progress = Callable[[float, str], None]  # fraction done in [0, 1], what is happening now
# Why a tokenflow engine offers no traced drift: it calibrates itself (Capability.DRIFT).
TRACED_DRIFT_WHY = "a tokenflow engine's drift history is its calibration runs"


class SourceError(EngineError):
    """The source cannot do what was asked (a recording cannot be tuned, a server is gone)."""


class Capability(enum.Enum):
    """One thing a source may offer beyond snapshots; the value names it to the operator."""

    TUNE = "tuning"  # Tunable: live configuration changes
    PAUSE = "pause"  # Pausable: stop and restart admitting work
    CALIBRATE = "recalibration"  # Calibrating: a token-budget sweep on the engine
    SLOW_QUERIES = "slow queries"  # SlowQueryStore
    DRIFT = "calibration history"  # CalibrationStore: calibration runs and drift events
    # TracedDrift: another engine's measured/predicted prefill ratio over time, from its
    # traced requests (the drift history a server tokenflow cannot calibrate has)
    TRACED_DRIFT = "traced drift history"
    CONFIG_HISTORY = "configuration history"  # ConfigHistory: stored config changes
    # The snapshot's config carries tokenflow's KV watermarks and bandwidth throttles, and they
    # govern the engine (another engine's KV usage is drawn without them).
    WATERMARKS = "watermarks"
    # The snapshot carries the chunk queue and each request's prefill progress.
    CHUNK_QUEUE = "chunk queue"
    TRAFFIC = "the arrival rate"  # Traffic: the console's own workload, played at a set rate
    # MetricStore: the engine's figures over hours, from its store (charts beyond memory)
    STORED_METRICS = "stored history"


@dataclass(frozen=True)
class Capabilities:
    """What a source can do, and for each thing it cannot, why (said to the operator)."""

    available: frozenset[Capability]
    why_not: Mapping[Capability, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unexplained = set(Capability) - self.available - set(self.why_not)
        if unexplained or self.available & set(self.why_not):
            raise ValueError("every capability is either available or has a reason it is not; "
                             f"check {sorted(c.name for c in unexplained) or 'both lists'}")

    @classmethod
    def everything(cls) -> Capabilities:
        return cls(frozenset(Capability))

    @classmethod
    def lacking(cls, why_not: Mapping[Capability, str]) -> Capabilities:
        """All capabilities but those in `why_not`, each with its reason."""
        return cls(frozenset(Capability) - set(why_not), why_not)

    def __contains__(self, capability: object) -> bool:
        return capability in self.available

    def refusal(self, capability: Capability) -> str | None:
        """None when `capability` is available, else the sentence that says why not."""
        if capability in self.available:
            return None
        return f"{capability.value} is not available on this source: {self.why_not[capability]}"

    def require(self, capability: Capability) -> None:
        refusal = self.refusal(capability)
        if refusal is not None:
            raise SourceError(refusal)


class Source(Protocol):
    """What every front end of the console reads from; calls may block (collectors run them)."""

    name: str  # shown in the header: "embedded synthetic:small on cpu", "replay FILE", ...
    capabilities: Capabilities  # may change over a source's life (a fleet's selected server)

    def snapshot(self) -> Snapshot: ...

    def close(self) -> None: ...


class Tunable(Source, Protocol):
    def update_config(self, **changes: Any) -> dict[str, Any]:
        """Apply live changes all at once or not at all (raises ConfigError naming the field)."""
        ...


class Pausable(Source, Protocol):
    def pause(self) -> None: ...

    def resume(self) -> None: ...


class Calibrating(Source, Protocol):
    def recalibrate(self, progress: Progress) -> CalibrationRecord: ...


class SlowQueryStore(Source, Protocol):
    def slow_queries(self, limit: int = 500) -> list[SlowQueryRecord]: ...

    def slow_query(self, query_id: int) -> SlowQueryRecord: ...


def export_slow_queries(records: list[SlowQueryRecord], fmt: str) -> str:
    """Slow queries a SlowQueryStore handed out, as CSV or JSON text: the store's one export
    (`tokenflow slow-queries --export` writes the same), loaded on first use like the store."""
    from engine.store import export_slow_queries as export

    return export(records, fmt)


def stated_rate(rate: float) -> float:
    """An arrival rate as the console states it everywhere (the Tuning field, the stored
    change, the charts' marks): three significant figures."""
    return float(f"{rate:.3g}")


class Traffic(Source, Protocol):
    def set_arrival_rate(self, rate: float) -> float:
        """Play the console's workload at `rate` requests/s from now on (SourceError if not)."""
        ...


class CalibrationStore(Source, Protocol):
    def calibration_history(self) -> list[CalibrationRecord]: ...

    def drift_events(self) -> list[DriftRecord]: ...


class TracedDrift(Source, Protocol):
    def traced_drift(self) -> list[TracedDriftPoint]:
        """Windowed median measured/predicted prefill ratios, oldest first."""
        ...


class ConfigHistory(Source, Protocol):
    def config_changes(self) -> list[ConfigChangeRecord]: ...


class MetricStore(Source, Protocol):
    def stored_metrics(self, start: float, end: float, buckets: int) -> StoredMetrics:
        """The engine's figures over wall-clock [start, end) in `buckets` equal buckets."""
        ...


FacetT = TypeVar("FacetT", bound=Source)
FACETS: dict[type[Source], Capability] = {
    Tunable: Capability.TUNE,
    Pausable: Capability.PAUSE,
    Calibrating: Capability.CALIBRATE,
    SlowQueryStore: Capability.SLOW_QUERIES,
    CalibrationStore: Capability.DRIFT,
    TracedDrift: Capability.TRACED_DRIFT,
    ConfigHistory: Capability.CONFIG_HISTORY,
    Traffic: Capability.TRAFFIC,
    MetricStore: Capability.STORED_METRICS,
}


def facet(source: Source, kind: type[FacetT]) -> FacetT:
    """`source` as the facet `kind`; SourceError, saying why, when it lacks that capability."""
    source.capabilities.require(FACETS[kind])
    return cast(FacetT, source)
