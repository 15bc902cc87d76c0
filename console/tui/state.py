"""The console's state: what every screen reads, and the few things a screen may ask for.

The app feeds it (each polled snapshot, the source's latest failure); screens read it and call
its actions, and never reach for the App class. An action first checks that the source can do
it: it answers with the refusal to show the operator, or None once its worker has started
(the result then comes back as a message to the node that asked).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from textual.dom import DOMNode

from console.sources.base import (
    Calibrating,
    CalibrationStore,
    Capabilities,
    Capability,
    ConfigHistory,
    MetricStore,
    Pausable,
    SlowQueryStore,
    Source,
    TracedDrift,
    Traffic,
    Tunable,
    facet,
)
from console.sources.fleet import FleetSource
from console.sources.http import HttpSource
from console.tui.collectors import (
    ConfigChangesLoaded,
    DriftLoaded,
    SlowQueriesLoaded,
    StoredMetricsLoaded,
    TracedDriftLoaded,
    apply_config_in_worker,
    load_in_worker,
    recalibrate_in_worker,
    set_rate_in_worker,
)
from console.tui.history import MetricHistory
from console.tui.widgets.confirm import Confirm
from engine.slo_targets import ServiceSLO
from engine.snapshot import Snapshot

# (store, gpu, token budget, model, context length or None) -> the twin run's report:
# `bench --simulate GPU --workload traced:STORE`, which the shell (console.cli) provides
TwinRun = Callable[[str, str, int, str, int | None], dict[str, Any]]


@dataclass(frozen=True)
class TracedTraffic:
    """The requests an attached fleet served, as --otlp-listen stores their traces, and the
    twin run that replays them."""

    store: str
    simulate: TwinRun


@dataclass
class ConsoleState:
    source: Source
    history: MetricHistory = field(default_factory=MetricHistory)
    latest: Snapshot | None = None
    failure: str = ""  # the source's latest error, until a snapshot arrives again
    slo: ServiceSLO = field(default_factory=ServiceSLO)  # the operator's latency targets
    traced: TracedTraffic | None = None  # None: no --otlp-listen, nothing to simulate
    session_start: float | None = None  # the first snapshot's time: the "session" range

    @property
    def capabilities(self) -> Capabilities:
        return self.source.capabilities  # read each time: a fleet's follow its selected server

    @property
    def paused(self) -> bool:
        return self.latest is not None and self.latest.paused

    def refusal(self, capability: Capability) -> str | None:
        return self.capabilities.refusal(capability)

    def record(self, snapshot: Snapshot) -> None:
        self.history.record(snapshot)
        if self.session_start is None:
            self.session_start = snapshot.ts
        self.latest = snapshot
        self.failure = ""

    def forget_history(self) -> None:
        """The console switched to another server: its series start afresh."""
        self.history.clear()

    @property
    def remote(self) -> bool:
        """Whether the engine is a server attached over HTTP, which others may be using:
        changes to it are confirmed first."""
        source = self.source.active if isinstance(self.source, FleetSource) else self.source
        return isinstance(source, HttpSource)

    # --- actions --------------------------------------------------------------------------
    def apply_config(self, node: DOMNode, changes: dict[str, Any], note: str = "") -> str | None:
        """Apply `changes` (on a remote server once the operator has said yes); `note` is
        said once they are applied."""
        refusal = self.refusal(Capability.TUNE)
        if refusal is not None:
            return refusal
        tunable = facet(self.source, Tunable)
        listed = ", ".join(f"{name} → {value}" for name, value in changes.items())
        self._confirmed(node, f"Change {self.source.name}?\n{listed}", "not applied",
                        lambda: apply_config_in_worker(node, tunable, changes, note))
        return None

    def _confirmed(self, node: DOMNode, question: str, declined: str,
                   act: Callable[[], None]) -> None:
        """Run `act` now on our own engine; on a remote server once the operator says yes."""
        if not self.remote:
            act()
            return

        def answered(yes: bool | None) -> None:
            if yes:
                act()
            else:
                node.notify(declined, timeout=2)
        node.app.push_screen(Confirm(question), answered)

    def set_arrival_rate(self, node: DOMNode, rate: float) -> str | None:
        refusal = self.refusal(Capability.TRAFFIC)
        if refusal is None:
            set_rate_in_worker(node, facet(self.source, Traffic), rate)
        return refusal

    def apply_recommended(self, node: DOMNode) -> str | None:
        """Set the token budget to the recommended C* with room for the smoothed decode load:
        the unclamped C*, so applying it again at the same load changes nothing."""
        refusal = self.refusal(Capability.TUNE)
        if refusal is not None:
            return refusal
        latest = self.latest
        budget = None if latest is None else latest.recommended_token_budget
        if latest is None or budget is None:
            return "no recommended C* yet: it needs a calibrated budget model"
        why = recommended_why(latest)
        old = latest.config.get("max_num_batched_tokens")
        if old == budget:
            return f"unchanged: the token budget is already {budget} ({why})"
        return self.apply_config(node, {"max_num_batched_tokens": budget},
                                 note=f"budget {old} → {budget} ({why})")

    def toggle_pause(self, node: DOMNode) -> str | None:
        """Pause or resume (on a remote server once the operator has said yes)."""
        refusal = self.refusal(Capability.PAUSE)
        if refusal is None:
            source = facet(self.source, Pausable)
            verb, doing, command = (("Resume", "resuming", source.resume) if self.paused
                                    else ("Pause", "pausing", source.pause))

            def act() -> None:
                node.run_worker(command, thread=True, group="pause", exit_on_error=False)
                node.notify(doing, timeout=1.5)
            self._confirmed(node, f"{verb} {self.source.name}?", f"not {verb.lower()}d", act)
        return refusal

    def recalibrate(self, node: DOMNode) -> str | None:
        refusal = self.refusal(Capability.CALIBRATE)
        if refusal is None:
            recalibrate_in_worker(node, facet(self.source, Calibrating))
        return refusal

    def load_slow_queries(self, node: DOMNode) -> str | None:
        refusal = self.refusal(Capability.SLOW_QUERIES)
        if refusal is None:
            store = facet(self.source, SlowQueryStore)
            load_in_worker(node, lambda: SlowQueriesLoaded(store.slow_queries()))
        return refusal

    def load_drift(self, node: DOMNode) -> str | None:
        """The calibration history, or for a traced server its traced drift history."""
        refusal = self.refusal(Capability.DRIFT)
        if refusal is None:
            store = facet(self.source, CalibrationStore)
            load_in_worker(node, lambda: DriftLoaded(store.calibration_history(),
                                                     store.drift_events()))
        elif self.refusal(Capability.TRACED_DRIFT) is None:
            traced = facet(self.source, TracedDrift)
            load_in_worker(node, lambda: TracedDriftLoaded(traced.traced_drift()))
            return None
        return refusal

    def load_stored_metrics(self, node: DOMNode, start: float, end: float, buckets: int,
                            change: int | None = None) -> str | None:
        """The engine's figures over wall-clock [start, end) from its store (for the stored
        change `change`, if one)."""
        refusal = self.refusal(Capability.STORED_METRICS)
        if refusal is None:
            store = facet(self.source, MetricStore)
            load_in_worker(node, lambda: StoredMetricsLoaded(
                store.stored_metrics(start, end, buckets), change))
        return refusal

    def load_config_changes(self, node: DOMNode) -> str | None:
        refusal = self.refusal(Capability.CONFIG_HISTORY)
        if refusal is None:
            store = facet(self.source, ConfigHistory)
            load_in_worker(node, lambda: ConfigChangesLoaded(store.config_changes()))
        return refusal


def recommended_why(snapshot: Snapshot) -> str:
    """How the recommended budget was reached: "C* 256 + 28 decodes, rounded to tiles"."""
    cstar = snapshot.recommended_chunk_unclamped or snapshot.recommended_chunk_size
    tile = snapshot.config.get("chunk_tile")
    chunk = f"C* {cstar}"
    if cstar is not None and isinstance(tile, int) and cstar < tile:
        chunk += f" raised to the tile {tile}"
    return f"{chunk} + {snapshot.recommended_decodes or 0} decodes, rounded to tiles"
