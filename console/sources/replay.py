"""Recorded sessions: a JSONL file of snapshots and store records, written live and replayed.

One line per record, `{"kind": ..., "data": {...}}`, where kind is snapshot, slow_query,
calibration, drift or config_change. Replaying a recording reviews a past session; the
console's snapshot tests replay one so every screen renders from the same numbers each time.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, cast

from console.sources.base import (
    CalibrationStore,
    Capabilities,
    Capability,
    ConfigHistory,
    SlowQueryStore,
    Source,
    SourceError,
)
from console.sources.checked import checked_slow_query, checked_snapshot
from engine.clock import SIM_SPEEDS
from engine.snapshot import Snapshot
from engine.store import (
    BudgetPoint,
    CalibrationRecord,
    ConfigChangeRecord,
    DriftRecord,
    MetricBucket,
    SlowQueryRecord,
    StoredMetrics,
)


class SessionRecorder:
    """Appends every new polled snapshot to a recording; `finish` adds the store's records."""

    def __init__(self, path: Path) -> None:
        # "x": a new file only, so no recording (nor a symlink's target) is written over
        self._file: TextIO = path.open("x", encoding="utf-8")

    def snapshot(self, snapshot: Snapshot) -> None:
        self._write("snapshot", snapshot.to_dict())

    def finish(self, source: Source) -> None:
        """Add what the source's store holds, as far as the source can read it."""
        capabilities = source.capabilities
        if Capability.SLOW_QUERIES in capabilities:
            for record in cast(SlowQueryStore, source).slow_queries():
                self._write("slow_query", dataclasses.asdict(record))
        if Capability.DRIFT in capabilities:
            store = cast(CalibrationStore, source)
            for record in store.calibration_history():
                self._write("calibration", dataclasses.asdict(record))
            for record in store.drift_events():
                self._write("drift", dataclasses.asdict(record))
        if Capability.CONFIG_HISTORY in capabilities:
            for record in cast(ConfigHistory, source).config_changes():
                self._write("config_change", dataclasses.asdict(record))
        self._file.close()

    def _write(self, kind: str, data: dict[str, Any]) -> None:
        self._file.write(json.dumps({"kind": kind, "data": data}, default=str) + "\n")
        self._file.flush()


class ReplaySource:
    """Plays a recording back at its own pace times `speed`; speed 0 steps one snapshot per poll.

    Read-only: it cannot be tuned or recalibrated; pause holds the playback. At the end it
    holds the last snapshot.
    """

    capabilities = Capabilities.lacking({
        Capability.TUNE: "a recorded session is read-only; start the console on an engine to tune",
        Capability.CALIBRATE: "a recorded session cannot recalibrate; start the console on an "
                              "engine",
        Capability.TRAFFIC: "a recorded session's traffic is what it was",
        Capability.TRACED_DRIFT: "a recording keeps no traced requests; attach to the traced "
                                 "server with --otlp-listen",
    })

    def __init__(self, path: Path, speed: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # nan included; at inf the first poll read 0 x inf; the bound is the twin's own
        if not 0 <= speed <= SIM_SPEEDS[1]:
            raise SourceError(f"replay speed must be in [0, {SIM_SPEEDS[1]:g}] (0 steps a "
                              f"snapshot a refresh), got {speed}")
        self.name = f"replay {path.name}"
        self._speed = speed
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshots: list[Snapshot] = []
        self._slow: list[SlowQueryRecord] = []
        self._calibrations: list[CalibrationRecord] = []
        self._drift: list[DriftRecord] = []
        self._changes: list[ConfigChangeRecord] = []
        self._load(path)
        self._cursor = -1 if speed == 0 else 0  # step mode shows record 0 on the first poll
        self._started = clock()
        self._paused_at: float | None = None

    def _load(self, path: Path) -> None:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise SourceError(f"cannot read recording {path}: {exc.strerror}") from exc
        except UnicodeDecodeError:
            raise SourceError(f"{path} is not valid UTF-8: not a recording this console "
                              "wrote (--record FILE)") from None
        parsers: dict[str, Callable[[dict[str, Any]], None]] = {
            "snapshot": lambda d: self._snapshots.append(checked_snapshot(d, str(path))),
            "slow_query": lambda d: self._slow.append(checked_slow_query(d, str(path))),
            "calibration": lambda d: self._calibrations.append(_calibration(d)),
            "drift": lambda d: self._drift.append(DriftRecord(**d)),
            "config_change": lambda d: self._changes.append(ConfigChangeRecord(**d)),
        }
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                parsers[record["kind"]](record["data"])
            except (ValueError, KeyError, TypeError, SourceError) as exc:
                raise SourceError(
                    f"{path}:{number} is not a tokenflow recording line ({exc}); "
                    "record one with tokenflow-console --record FILE") from exc
        if not self._snapshots:
            raise SourceError(f"{path} holds no snapshots; record one with --record FILE")

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._cursor >= len(self._snapshots) - 1

    def snapshot(self) -> Snapshot:
        with self._lock:
            if self._paused_at is None:
                self._advance()
            current = self._snapshots[max(self._cursor, 0)]
            if current.paused or self._paused_at is None:
                return current
            return dataclasses.replace(current, paused=True)

    def _advance(self) -> None:
        last = len(self._snapshots) - 1
        if self._speed == 0:
            self._cursor = min(self._cursor + 1, last)
            return
        elapsed = (self._clock() - self._started) * self._speed
        origin = self._snapshots[0].ts
        while self._cursor < last and self._snapshots[self._cursor + 1].ts - origin <= elapsed:
            self._cursor += 1

    def pause(self) -> None:
        with self._lock:
            if self._paused_at is None:
                self._paused_at = self._clock()

    def resume(self) -> None:
        with self._lock:
            if self._paused_at is not None:
                self._started += self._clock() - self._paused_at
                self._paused_at = None

    def slow_queries(self, limit: int = 500) -> list[SlowQueryRecord]:
        return self._slow[:limit]

    def slow_query(self, query_id: int) -> SlowQueryRecord:
        for record in self._slow:
            if record.id == query_id:
                return record
        raise SourceError(f"no slow query with id {query_id} in this recording")

    def calibration_history(self) -> list[CalibrationRecord]:
        return list(self._calibrations)

    def drift_events(self) -> list[DriftRecord]:
        return list(self._drift)

    def config_changes(self) -> list[ConfigChangeRecord]:
        return list(self._changes)

    def stored_metrics(self, start: float, end: float, buckets: int) -> StoredMetrics:
        """The recording's own figures over wall-clock [start, end), as far as it has
        played: each bucket the mean of its snapshots' TTFT percentiles and tok/s, and the
        requests that arrived and finished between snapshots; a snapshot without a wall
        offset cannot be placed."""
        if not end > start or buckets < 1:
            raise SourceError(f"a history needs end > start and buckets >= 1, got "
                              f"[{start}, {end}) in {buckets}")
        with self._lock:
            played = self._snapshots[:max(self._cursor, 0) + 1]
        width = (end - start) / buckets
        figures: list[dict[str, list[float]]] = [
            {"p50": [], "p99": [], "tps": [], "arrived": [], "finished": []}
            for _ in range(buckets)]
        restarts, pauses = [], []
        for before, snapshot in zip([None, *played], played, strict=False):
            if snapshot.wall_offset is None:
                continue
            at = snapshot.ts + snapshot.wall_offset
            if not start <= at < end:
                continue
            bucket = figures[min(int((at - start) / width), buckets - 1)]
            for key, value in (("p50", snapshot.ttft_ms.p50), ("p99", snapshot.ttft_ms.p99),
                               ("tps", snapshot.tokens_per_s)):
                if value is not None:
                    bucket[key].append(value)
            if before is not None:
                bucket["arrived"].append(max(snapshot.arrived - before.arrived, 0))
                bucket["finished"].append(max(snapshot.requests_finished_total
                                              - before.requests_finished_total, 0))
                if snapshot.engine_restarts > before.engine_restarts:
                    restarts.append(at)
                if snapshot.paused != before.paused:
                    pauses.append(at)

        def mean(values: list[float]) -> float | None:
            return sum(values) / len(values) if values else None

        return StoredMetrics(
            start, end,
            tuple(MetricBucket(start + (i + 1) * width, sum(f["arrived"]) / width,
                               sum(f["finished"]) / width, mean(f["tps"]) or 0.0,
                               mean(f["p50"]), mean(f["p99"]))
                  for i, f in enumerate(figures)),
            tuple(sorted(c.created_at for c in self._changes if start <= c.created_at < end)),
            tuple(sorted(d.created_at for d in self._drift if start <= d.created_at < end)),
            tuple(restarts), tuple(pauses))

    def close(self) -> None:
        """A recording holds no resources once loaded."""


def _calibration(data: dict[str, Any]) -> CalibrationRecord:
    table = [BudgetPoint(**point) for point in data["table"]]
    return CalibrationRecord(**{**data, "table": table})
