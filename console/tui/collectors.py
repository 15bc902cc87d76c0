"""Collectors: worker threads that read the source and post typed messages.

A collector never touches a widget; widgets never do I/O. The snapshot poll is re-armed only
when the previous one has finished, so a slow source never piles polls up.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from textual.app import App
from textual.dom import DOMNode
from textual.message import Message
from textual.timer import Timer

from console.sources.base import Calibrating, Source, Traffic, Tunable
from console.sources.replay import SessionRecorder
from engine.config import ConfigError
from engine.errors import EngineError
from engine.snapshot import Snapshot

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # annotations only: the store pulls SQLAlchemy and Alembic (~1 s)
    from console.sources.base import (
        CalibrationRecord,
        ConfigChangeRecord,
        DriftRecord,
        SlowQueryRecord,
        StoredMetrics,
        TracedDriftPoint,
    )


class SnapshotPolled(Message):
    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__()
        self.snapshot = snapshot


class SourceFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class SlowQueriesLoaded(Message):
    def __init__(self, records: list[SlowQueryRecord]) -> None:
        super().__init__()
        self.records = records


class DriftLoaded(Message):
    def __init__(self, calibrations: list[CalibrationRecord], events: list[DriftRecord]) -> None:
        super().__init__()
        self.calibrations = calibrations
        self.events = events


class TracedDriftLoaded(Message):
    def __init__(self, points: list[TracedDriftPoint]) -> None:
        super().__init__()
        self.points = points


class ConfigChangesLoaded(Message):
    def __init__(self, changes: list[ConfigChangeRecord]) -> None:
        super().__init__()
        self.changes = changes


class StoredMetricsLoaded(Message):
    """The store's figures over a span; `change`: the id of the stored change whose before
    and after they are, None for a chart's range."""

    def __init__(self, metrics: StoredMetrics, change: int | None = None) -> None:
        super().__init__()
        self.metrics = metrics
        self.change = change


class RecalibrationProgress(Message):
    def __init__(self, fraction: float, note: str) -> None:
        super().__init__()
        self.fraction = fraction
        self.note = note


class RecalibrationDone(Message):
    def __init__(self, record: CalibrationRecord | None, error: str | None) -> None:
        super().__init__()
        self.record = record
        self.error = error


# While nothing moves (a snapshot that differs from the last posted only in its time), the
# poll slows down to this many intervals, and the panes are redrawn every QUIET_REDRAW_S of
# the source's time only, so time axes still move: repainting every pane at 2.5 Hz for
# an idle engine cost a sixth of a core.
QUIET_SLOWDOWN = 5
QUIET_REDRAW_S = 5.0
# Wall-clock minus the engine's clock, read at two instants, differs in its last digits from
# one poll to the next; only a step of the wall clock moves it further.
WALL_JITTER_S = 0.5


def quiet(snapshot: Snapshot, last: Snapshot | None) -> bool:
    """Whether `snapshot` says nothing `last` did not, but the time."""
    if last is None:
        return False
    if (snapshot.wall_offset is None) != (last.wall_offset is None) or (
            snapshot.wall_offset is not None and last.wall_offset is not None
            and abs(snapshot.wall_offset - last.wall_offset) > WALL_JITTER_S):
        return False
    return dataclasses.replace(snapshot, ts=last.ts, wall_offset=last.wall_offset) == last


@dataclass
class SnapshotCollector:
    """Polls `source.snapshot()` every `interval` seconds on a worker thread, and posts each
    snapshot that differs from the last: a finished or paused recording, or a fleet member
    between its own polls, repeats one, and repainting every pane for it kept a core busy.
    An idle engine's snapshots differ in their time alone: those are posted every
    QUIET_REDRAW_S, and the poll slows down until something moves or a key is pressed."""

    app: App
    source: Source
    interval: float
    recorder: SessionRecorder | None = None
    running: bool = False
    _last: Snapshot | None = field(default=None, init=False, repr=False)
    delay: float = field(default=0.0, init=False)  # until the next poll; grows while quiet
    _timer: Timer | None = field(default=None, init=False, repr=False)
    _in_flight: bool = field(default=False, init=False, repr=False)  # the app's thread's

    def start(self) -> None:
        self.running = True
        self.delay = self.interval
        self._launch()

    def stop(self) -> None:
        self.running = False

    def hurry(self) -> None:
        """The operator pressed a key: poll at the full rate again, starting now."""
        slowed = self.delay > self.interval
        self.delay = self.interval
        if slowed and self._timer is not None and not self._in_flight:
            self._timer.stop()
            self._launch()

    def _launch(self) -> None:
        self._timer = None
        if self.running and not self._in_flight:
            self._in_flight = True
            self.app.run_worker(self._collect, thread=True, group="snapshot", exit_on_error=False)

    def _collect(self) -> None:
        try:
            snapshot = self.source.snapshot()
            last = self._last
            still = quiet(snapshot, last)
            self.delay = (min(self.delay * 2, self.interval * QUIET_SLOWDOWN) if still
                          else self.interval)
            if snapshot != last and (not still or last is None
                                     or snapshot.ts - last.ts >= QUIET_REDRAW_S):
                self._last = snapshot
                if self.recorder is not None:
                    self.recorder.snapshot(snapshot)
                self.app.post_message(SnapshotPolled(snapshot))
        except Exception as exc:  # a poller must not die: any fault becomes a notification
            self._last = None  # the next snapshot clears the failure shown, even if the same
            self.app.post_message(SourceFailed(worker_error(exc)))
        finally:
            self._rearm()

    def _rearm(self) -> None:
        if not self.running:
            return
        try:
            self.app.call_from_thread(self._arm)
        except RuntimeError:
            self.running = False  # the app closed while this poll was in flight

    def _arm(self) -> None:
        self._in_flight = False
        if self.running:
            self._timer = self.app.set_timer(self.delay, self._launch)


def worker_error(exc: Exception) -> str:
    """What a worker thread's failure shows in a notification. Errors the engine and the OS
    explain say it themselves; anything else is a bug, logged with its traceback (never
    printed over the screen) and named by its type."""
    if isinstance(exc, EngineError | OSError):
        return str(exc)
    log.error("console worker failed: %r", exc, exc_info=exc)
    return f"{type(exc).__name__}: {exc} (traceback in the log)"


def load_in_worker(target: DOMNode, read: Callable[[], Message]) -> None:
    """Run a store read on a worker thread and post its message to `target`."""

    def work() -> None:
        try:
            target.post_message(read())
        except Exception as exc:
            target.post_message(SourceFailed(worker_error(exc)))

    target.run_worker(work, thread=True, group="store", exit_on_error=False)


def recalibrate_in_worker(target: DOMNode, source: Calibrating) -> None:
    """Run a recalibration on a worker thread, posting its progress and its result to `target`."""

    def work() -> None:
        try:
            record = source.recalibrate(
                lambda fraction, note: target.post_message(RecalibrationProgress(fraction, note)))
            target.post_message(RecalibrationDone(record, None))
        except Exception as exc:
            target.post_message(RecalibrationDone(None, worker_error(exc)))

    target.run_worker(work, thread=True, group="recalibrate", exit_on_error=False)


class ConfigApplied(Message):
    """The live values after a change, and what to tell the operator ("" for the default)."""

    def __init__(self, config: dict[str, Any], note: str = "") -> None:
        super().__init__()
        self.config = config
        self.note = note or "configuration applied"


class ConfigRejected(Message):
    def __init__(self, field: str, message: str) -> None:
        super().__init__()
        self.field = field
        self.message = message


def apply_config_in_worker(target: DOMNode, source: Tunable, changes: dict[str, Any],
                           note: str = "") -> None:
    """Apply live changes on a worker thread; the result comes back as a message to `target`
    (ConfigApplied carrying `note`, or ConfigRejected)."""

    def work() -> None:
        try:
            target.post_message(ConfigApplied(source.update_config(**changes), note))
        except ConfigError as exc:
            target.post_message(ConfigRejected(exc.field, exc.message))
        except Exception as exc:
            target.post_message(ConfigRejected("", worker_error(exc)))

    target.run_worker(work, thread=True, group="config", exit_on_error=False)


class RateSet(Message):
    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate


RATE_FIELD = "arrival_rate"  # how a refused rate names itself to the form


def set_rate_in_worker(target: DOMNode, source: Traffic, rate: float) -> None:
    """Set the traffic's arrival rate on a worker thread; RateSet or ConfigRejected to `target`."""

    def work() -> None:
        try:
            target.post_message(RateSet(source.set_arrival_rate(rate)))
        except Exception as exc:
            target.post_message(ConfigRejected(RATE_FIELD, worker_error(exc)))

    target.run_worker(work, thread=True, group="config", exit_on_error=False)
