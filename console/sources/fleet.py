"""FleetSource: several attached servers (tokenflow, vLLM, SGLang), polled all at once.

One event loop on a background thread polls every member on its own schedule with httpx's
async client, so a slow or dead server never holds the others back. Every Source call goes
to the selected member (the console's tabs), and the fleet can do what that member can: its
capabilities follow the selection. `rows()` is the fleet overview: one row per server, worst
first. A server that stops answering shows as down with the time it was last seen, and comes
back by itself when it answers again (Remote's back-off paces the retries).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from console.sources.base import (
    Calibrating,
    CalibrationStore,
    Capabilities,
    ConfigHistory,
    MetricStore,
    Pausable,
    Progress,
    SlowQueryStore,
    Source,
    SourceError,
    TracedDrift,
    Tunable,
    facet,
)
from console.sources.remote import MAX_DELAY_S, TIMEOUT_S
from engine.snapshot import Snapshot

if TYPE_CHECKING:  # annotations only: the store pulls SQLAlchemy and Alembic (~1 s)
    from engine.store import (
        CalibrationRecord,
        ConfigChangeRecord,
        DriftRecord,
        SlowQueryRecord,
        StoredMetrics,
        TracedDriftPoint,
    )

POLL_INTERVAL_S = 0.4
SLOW_WINDOW_S = 60.0  # slow queries per minute: the change in slow_queries_total over this


def retry_delay(interval: float, failures: int) -> float:
    """The wait before the next poll: the interval, doubling with each failure in a row up to
    MAX_DELAY_S, so a failing server is not hammered (HTTP failures also back off in Remote)."""
    return min(max(MAX_DELAY_S, interval), interval * 2 ** min(failures, 16))


class AsyncSource(Source, Protocol):
    """A source the fleet polls on its event loop (HttpSource, vLLM, SGLang); others (a
    recording) are polled on a worker thread of that loop."""

    async def snapshot_async(self) -> Snapshot: ...


async def _read(source: Source) -> Snapshot:
    read_async = getattr(source, "snapshot_async", None)
    return await (read_async() if read_async else asyncio.to_thread(source.snapshot))


def _label(source: Source) -> str:
    remote = getattr(source, "remote", None)
    return source.name if remote is None else remote.url


@dataclass
class MemberState:
    """What the fleet last heard from one server."""

    source: Source
    snapshot: Snapshot | None = None
    last_seen: float | None = None  # wall clock of the last answer
    error: str = ""
    polls: int = 0  # answered or failed
    failures: int = 0  # in a row, since the last answer
    slow_totals: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=1000))

    @property
    def up(self) -> bool:
        return self.error == "" and self.snapshot is not None

    def heard(self, snapshot: Snapshot, now: float) -> None:
        """A poll answered with `snapshot` at wall-clock `now`."""
        self.snapshot, self.last_seen, self.error = snapshot, now, ""
        self.failures = 0
        self.slow_totals.append((now, snapshot.slow_queries_total))

    def row(self, index: int) -> FleetRow:
        snap = self.snapshot
        health = "up" if self.up else ("starting" if self.polls == 0 else "down")
        note = getattr(self.source, "store_note", "")  # serving, but its store is not
        if health == "up" and note:
            health = "degraded"
        known = snap is not None and health in ("up", "degraded")
        if known and snap.paused:  # answering, but an operator holds it: not serving
            health = "paused"
        return FleetRow(
            index=index, name=_label(self.source), model=snap.model if snap else "",
            running=snap.num_running if known else 0, waiting=snap.num_waiting if known else 0,
            kv_usage=snap.kv_usage if known else None,
            tokens_per_s=snap.tokens_per_s if known else None,
            ttft_p99_ms=snap.ttft_ms.p99 if known else None,
            itl_p99_ms=snap.itl_ms.p99 if known else None,
            slow_per_min=self.slow_per_minute(), health=health,
            last_seen=self.last_seen, error=self.error or (note if health == "degraded"
                                                           else ""))

    def slow_per_minute(self) -> float:
        if len(self.slow_totals) < 2:
            return 0.0
        newest_ts, newest = self.slow_totals[-1]
        oldest_ts, oldest = next((ts, n) for ts, n in self.slow_totals
                                 if newest_ts - ts <= SLOW_WINDOW_S)
        span = newest_ts - oldest_ts
        return (newest - oldest) * 60.0 / span if span > 0 else 0.0


@dataclass(frozen=True)
class FleetRow:
    index: int  # the member's position (what `select` takes)
    name: str
    model: str
    running: int
    waiting: int
    kv_usage: float | None
    tokens_per_s: float | None
    ttft_p99_ms: float | None
    itl_p99_ms: float | None
    slow_per_min: float
    health: str  # "up", "paused", "degraded" (serving; its store is not), "down", "starting"
    last_seen: float | None
    error: str

    @property
    def severity(self) -> tuple[float, ...]:
        """Sort key, worst first: down, then slow queries, then TTFT p99, then KV usage."""
        down = {"down": 0, "starting": 1, "degraded": 1, "paused": 2}.get(self.health, 3)
        return (down, -self.slow_per_min, -(self.ttft_p99_ms or 0.0), -(self.kv_usage or 0.0))


class FleetSource:
    def __init__(self, members: list[Source], *, interval: float = POLL_INTERVAL_S,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if not members:
            raise SourceError("a fleet needs at least one server; pass --attach URL")
        self.members = members
        self.states = [MemberState(m) for m in members]
        self.selected = 0
        self.interval = interval
        self.wall_clock = wall_clock
        self.changed = threading.Condition()  # notified after every poll of any member
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tokenflow-fleet",
                                       daemon=True)
        self.thread.start()
        self.tasks = [asyncio.run_coroutine_threadsafe(self._poll_forever(state), self.loop)
                      for state in self.states]

    async def _poll_forever(self, state: MemberState) -> None:
        while True:
            try:
                snapshot = await _read(state.source)
            except Exception as exc:  # a poller must not die: any failure is this server's
                state.error = str(exc) or type(exc).__name__
                state.failures += 1
            else:
                state.heard(snapshot, self.wall_clock())
            with self.changed:
                state.polls += 1
                self.changed.notify_all()
            await asyncio.sleep(retry_delay(self.interval, state.failures))

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until `predicate()` holds after some poll (for tests and first snapshots)."""
        with self.changed:
            return self.changed.wait_for(predicate, timeout)

    @property
    def active(self) -> Source:
        return self.members[self.selected]

    @property
    def name(self) -> str:
        return f"[{self.selected + 1}/{len(self.members)}] {self.active.name}"

    @property
    def capabilities(self) -> Capabilities:
        return self.active.capabilities

    def select(self, index: int) -> None:
        if not 0 <= index < len(self.members):
            raise SourceError(f"no server {index + 1}: the fleet has {len(self.members)}")
        self.selected = index

    def rows(self) -> list[FleetRow]:
        return sorted((s.row(i) for i, s in enumerate(self.states)),
                      key=lambda row: row.severity)

    def snapshot(self) -> Snapshot:
        """The selected server's latest snapshot (waiting for its first poll at most one
        request timeout); the error it last gave while it is down."""
        state = self.states[self.selected]
        self.wait_for(lambda: state.polls > 0, TIMEOUT_S + 1.0)
        if state.error or state.snapshot is None:
            raise SourceError(state.error or f"{_label(state.source)} has not answered yet")
        return state.snapshot

    # Each facet goes to the selected member, refused with its reason where it lacks it.
    def update_config(self, **changes: Any) -> dict[str, Any]:
        return facet(self.active, Tunable).update_config(**changes)

    def pause(self) -> None:
        facet(self.active, Pausable).pause()

    def resume(self) -> None:
        facet(self.active, Pausable).resume()

    def slow_queries(self, limit: int = 500) -> list[SlowQueryRecord]:
        return facet(self.active, SlowQueryStore).slow_queries(limit)

    def slow_query(self, query_id: int) -> SlowQueryRecord:
        return facet(self.active, SlowQueryStore).slow_query(query_id)

    def calibration_history(self) -> list[CalibrationRecord]:
        return facet(self.active, CalibrationStore).calibration_history()

    def drift_events(self) -> list[DriftRecord]:
        return facet(self.active, CalibrationStore).drift_events()

    def traced_drift(self) -> list[TracedDriftPoint]:
        return facet(self.active, TracedDrift).traced_drift()

    def config_changes(self) -> list[ConfigChangeRecord]:
        return facet(self.active, ConfigHistory).config_changes()

    def stored_metrics(self, start: float, end: float, buckets: int) -> StoredMetrics:
        return facet(self.active, MetricStore).stored_metrics(start, end, buckets)

    def recalibrate(self, progress: Progress) -> CalibrationRecord:
        return facet(self.active, Calibrating).recalibrate(progress)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()

        async def close_clients() -> None:
            for member in self.members:
                remote = getattr(member, "remote", None)
                if remote is not None:
                    await remote.aclose()

        asyncio.run_coroutine_threadsafe(close_clients(), self.loop).result(TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT_S)
        for member in self.members:
            member.close()
