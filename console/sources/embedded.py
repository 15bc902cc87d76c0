"""The embedded source: an engine on its own thread in this process, with its SQLite store."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.orm import Session

from console.sources.base import (
    TRACED_DRIFT_WHY,
    Capabilities,
    Capability,
    Progress,
    SourceError,
    stated_rate,
)
from console.sources.workloads import named_workload
from engine.budget.predictor import StepTimePredictor
from engine.calibration.calibrate import (
    FIRST_REASON,
    Calibration,
    CalibrationResult,
    calibrate,
    device_key,
    first_plan,
    latest_for,
    save_result,
)
from engine.calibration.drift import DriftMonitor, drift_event
from engine.config import ConfigError, EngineConfig
from engine.core.engine_core import EngineCore
from engine.errors import EngineError
from engine.events import CalibrationProgress, ConfigChanged, Event
from engine.serve.loop import EngineLoop
from engine.serve.session import EngineSession
from engine.sim.executor import Simulation
from engine.sim.live_trust import LiveTrust
from engine.sim.profiles import profile, server_defaults
from engine.sim.target import needs_store
from engine.snapshot import Snapshot
from engine.store import (
    CalibrationRecord,
    ConfigChangeRecord,
    Database,
    DriftRecord,
    SlowQueryRecord,
    StoredMetrics,
    StoreWriter,
    calibration_history,
    config_changes,
    default_db_path,
    drift_events,
    get_slow_query,
    list_slow_queries,
    next_cycle,
    open_database,
    quarantined_requests,
    save_calibration,
    stored_metrics,
)
from engine.store.calibration import REUSED

log = logging.getLogger(__name__)
ARRIVAL_RATE = "arrival_rate"  # how a change of the traffic's rate is stored
READ_FLUSH_TIMEOUT_S = 2.0
CPU_MODEL = "synthetic:small"
CUDA_MODEL = "synthetic:1b"  # the first GPU gets a preset big enough to load it


def default_model(device: str) -> str:
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return CUDA_MODEL if on_cuda else CPU_MODEL


class EmbeddedSource:
    capabilities = Capabilities.lacking({Capability.TRACED_DRIFT: TRACED_DRIFT_WHY})

    def __init__(self, session: EngineSession) -> None:
        """Over a session with a store, a journal writer and a loop (`start` makes one)."""
        if session.loop is None or session.database is None or session.writer is None:
            raise ValueError("an embedded source needs a session with a store and a loop")
        self.session = session
        self.loop: EngineLoop = session.loop
        self.database: Database = session.database
        self.writer: StoreWriter = session.writer
        engine = session.engine
        self.name = f"embedded {engine.config.model} on {engine.runner.device}"
        self.monitor: DriftMonitor | None = None  # set by start(): drift (protection layer 5)
        # set by start(): what the last session left unfinished, closed as aborted
        self.orphans: tuple[str, ...] = session.orphans
        # set by start(): requests the journal holds quarantined (they killed resumed runs)
        self.quarantined: tuple[str, ...] = ()
        # where the first calibration, run beside the traffic, stands ("pass 1/3, shape 7/16")
        self.calibrating: str | None = None
        # how far the first calibration had come when last heard (kept once it ends)
        self._calibration_progress: str | None = None
        # why the first calibration failed, until a recalibration succeeds: the engine serves
        # on uncalibrated, and the snapshot says so rather than "calibrating" for ever
        self.calibration_failure: str | None = None
        # a named GPU's twin: how far its figures may be trusted (None for a real engine)
        self.trust: LiveTrust | None = None

    @classmethod
    def start(cls, *, model: str | None = None, device: str | None = None,
              workload: str = "mixed", db: str | Path | None = None,
              server: str | None = None,
              config: EngineConfig | None = None, num_requests: int | None = None,
              rate: float | None = None, repeat: bool = True,
              simulate: Simulation | None = None,
              progress: Progress | None = None) -> EmbeddedSource:
        """Open the store, build the engine, start its loop and the workload (`num_requests`
        at `rate` requests/s, the workload's own defaults when None), repeating if asked.
        `simulate` runs the GPU twin (no weights, predicted step times) at its speed.
        `progress` hears each stage: loading the model, calibrating, restoring the settings."""
        device = device or "auto"
        base = config or EngineConfig()
        engine_config = dataclasses.replace(base, model=model or default_model(device),
                                            device=device)
        say = progress or (lambda fraction, what: None)
        if simulate is not None and not needs_store(simulate.target):
            # a GPU's twin schedules as vLLM's server does there, as `bench --simulate` does;
            # the store's last settings, restored below, still come before these
            defaults = server_defaults(profile(simulate.target, simulate.gpu_profile),
                                       engine_config)
            engine_config = dataclasses.replace(engine_config, **defaults)
            say(0.0, "vLLM's GPU server defaults: " + ", ".join(
                f"{name}={value}" for name, value in defaults.items()))
        say(0.0, f"loading {engine_config.model} on {device}")

        def calibrating(event: Event) -> None:
            if isinstance(event, CalibrationProgress):
                say(event.fraction, f"calibrating ({event.reason}): {event.note}")

        # A real engine's first calibration runs beside the traffic, once the loop runs, so
        # the panes come up at once; the twin's simulated one takes no time.
        session = EngineSession.start(engine_config, db=db, server=server, simulate=simulate,
                                      observers=(calibrating,),
                                      calibrate=simulate is not None)
        try:
            engine, database = session.engine, session.database
            assert database is not None  # started with a store
            if simulate is None and session.calibration is None:
                session.calibration = reuse_default_calibration(engine, database)
                if session.calibration is not None:
                    say(1.0, f"reusing calibration {session.calibration.id} of "
                             f"{default_db_path()}")
            # a twin's loop plays arrivals on its simulated clock (EngineSession.attach_loop)
            requests = named_workload(workload, engine, num_requests=num_requests, rate=rate)
            with database.session() as db_session:
                # numbered on from the last run's traffic (each of its cycles added
                # requests[0] first), so no id clashes with what that run left
                first_cycle = next_cycle(db_session, requests[0].request_id) if requests else 0
            restored = restore_config(engine, database, explicit=_explicit(base))
            if restored:
                say(1.0, "restoring the last stored settings: " + ", ".join(
                    f"{name}={value}" for name, value in restored.items()))
            with database.session() as db_session:
                quarantined = tuple(q.request_id for q in quarantined_requests(db_session))
            loop = session.attach_loop()
            source = cls(session)
            source.quarantined = quarantined
            if simulate is not None:
                source.name = f"SIMULATED {source.name} (x{simulate.speed:g})"
                target = engine.runner.target
                if target.calibration is None:  # a calibrated twin is judged by real runs
                    source.trust = LiveTrust(target, engine.model_config)
                    engine.bus.subscribe(source.trust.observe)
            calibration = session.calibration
            source.monitor = DriftMonitor(
                engine, loop.call, on_result=source._store_result,
                reference=None if calibration is None else StepTimePredictor.from_dict(
                    calibration.params))
            engine.bus.subscribe(source.monitor.observe)
            # a journal that stopped: the engine stops too, rather than serve on unrecorded
            source.writer.on_failure(lambda _error: loop.pause())
            if not engine.calibrated:
                source.calibrate_beside_traffic()
            loop.start()
        except BaseException:
            session.close()
            raise
        loop.play(requests, repeat=repeat, first_cycle=first_cycle)
        if rate is not None and math.isfinite(rate) and loop.arrival_rate is not None:
            # a sample of Poisson arrivals runs at its own rate (32 asked at 20/s came at 16/s):
            # play it at the one asked, the rate the Tuning field and the store then state
            loop.set_arrival_rate(rate)
        return source

    def calibrate_beside_traffic(self) -> None:
        """The first calibration, one unit of the sweep between engine steps: the traffic
        flows meanwhile, and budget_score and C* wait for it (the snapshot says how far)."""
        engine = self.loop.engine

        def progress(fraction: float, note: str) -> None:
            self.calibrating = self._calibration_progress = note.split(":")[0]  # not the shape
            engine.bus.publish(CalibrationProgress(fraction=fraction, note=note,
                                                   reason=FIRST_REASON))

        sweep = Calibration(engine, first_plan(engine.runner.device), quick=True,
                            progress=progress)

        def unit(engine: EngineCore) -> None:
            try:
                if not sweep.advance():
                    self.loop.call(unit)
                    return
                result = sweep.finish()
            except EngineError as exc:  # the engine serves on, uncalibrated; `r` retries
                log.warning("the first calibration failed: %s", exc)
                self.calibration_failure = str(exc)
                self.calibrating = None
                return
            engine.apply_calibration(result.predictor)
            self._store_result(result, FIRST_REASON)
            if self.monitor is not None:
                self.monitor.reference = result.predictor
            engine.bus.publish(CalibrationProgress(
                fraction=1.0, note=f"calibrated in {result.wall_s:.1f} s", reason=FIRST_REASON))
            self.calibrating = None

        self.calibrating = self._calibration_progress = "starting"
        self.loop.call(unit)

    def _store_result(self, result: CalibrationResult, reason: str) -> None:
        with self.database.session() as session:
            save_result(session, result, reason)

    def snapshot(self) -> Snapshot:
        if self.loop.error is not None:
            raise SourceError(f"the engine stopped: {self.loop.error!r}")
        if self.writer.failure is not None:
            raise SourceError(f"the engine is paused: {self.writer.failure}")
        snapshot = self.loop.snapshot()
        progress, failure = self._calibration_progress, self.calibration_failure
        if snapshot.calibration == "calibrating" and failure is not None:
            snapshot = dataclasses.replace(snapshot, calibration=(
                f"uncalibrated: the first calibration failed ({failure}); r on Drift (4) "
                "recalibrates"))
        elif snapshot.calibration == "calibrating" and progress is not None:
            # a snapshot published before the sweep ended says how far it had come
            snapshot = dataclasses.replace(snapshot, calibration=f"calibrating ({progress})")
        reused = self.session.calibration
        if (reused is not None and reused.reused and self.monitor is not None
                and self.monitor.recalibrations == 0):
            # marked until the first calibration measured here replaces it
            snapshot = dataclasses.replace(
                snapshot, calibration_reused=f"reused: {reused.provenance_words()}")
        return dataclasses.replace(snapshot, paused=self.loop.paused,
                                   workload_rate=self.loop.arrival_rate,
                                   twin_trust="" if self.trust is None else self.trust.line())

    def set_arrival_rate(self, rate: float) -> float:
        """Play the traffic at `rate` requests/s; stored as a change like any setting's, so
        the Changes table and the charts' marks show it beside the budget's."""
        old = self.loop.arrival_rate
        try:
            rate = self.loop.set_arrival_rate(rate)
        except ValueError as exc:
            raise SourceError(str(exc)) from None
        if old != rate:
            engine = self.loop.engine
            self.loop.call(lambda _engine: engine.bus.publish(ConfigChanged(
                changes={ARRIVAL_RATE: (None if old is None else stated_rate(old),
                                        stated_rate(rate))},
                source="console")))
        return rate

    def update_config(self, **changes: Any) -> dict[str, Any]:
        return self.loop.update_config("console", **changes).live_values()

    def pause(self) -> None:
        self.loop.pause()

    def resume(self) -> None:
        if self.writer.failure is not None:  # it stays paused until the store is mended
            raise SourceError(f"cannot resume: {self.writer.failure}")
        self.loop.resume()

    def slow_queries(self, limit: int = 500) -> list[SlowQueryRecord]:
        with self._read() as session:
            return list_slow_queries(session, sort="time", limit=limit)

    def slow_query(self, query_id: int) -> SlowQueryRecord:
        with self._read() as session:
            record = get_slow_query(session, query_id)
        if record is None:
            raise SourceError(f"no slow query with id {query_id} in {self.database.location}")
        return record

    def calibration_history(self) -> list[CalibrationRecord]:
        engine = self.loop.engine
        with self._read() as session:
            return calibration_history(session, model=engine.config.model,
                                       device=device_key(engine.runner.device))

    def drift_events(self) -> list[DriftRecord]:
        with self._read() as session:
            return drift_events(session)

    def config_changes(self) -> list[ConfigChangeRecord]:
        with self._read() as session:
            return config_changes(session)

    def stored_metrics(self, start: float, end: float, buckets: int) -> StoredMetrics:
        with self._read() as session:
            return stored_metrics(session, start, end, buckets)

    def _read(self) -> AbstractContextManager[Session]:
        """A session that sees every event published so far: a change the operator just
        made is in the history they open next, not one batch window later."""
        def publish_pending(engine: EngineCore) -> None:
            engine.apply_pending_config()  # a change made just now is applied and published
            engine.bus.drain()

        # Bounded waits: a long step or a stuck store delays the history, never hangs it.
        with contextlib.suppress(TimeoutError):
            self.loop.call(publish_pending).result(timeout=READ_FLUSH_TIMEOUT_S)
        self.writer.flush(timeout=READ_FLUSH_TIMEOUT_S)
        return self.database.session()

    def recalibrate(self, progress: Progress) -> CalibrationRecord:
        """A quick sweep between engine steps; a table >10% off the last one is a drift
        event (published, so the store keeps it); the new predictor takes over."""
        if self.calibrating is not None:
            raise SourceError(f"the first calibration is under way ({self.calibrating}); "
                              "it is stored when done")
        def sweep(engine: EngineCore) -> CalibrationRecord:
            result = calibrate(engine, quick=True, progress=progress)
            with self.database.session() as session:
                previous = latest_for(session, engine)
                if previous is not None:
                    drift = drift_event(StepTimePredictor.from_dict(previous.params), result)
                    if drift is not None:
                        engine.bus.publish(drift)
                save_result(session, result, "on demand from the console")
                engine.apply_calibration(result.predictor)
                self.calibration_failure = None
                if self.monitor is not None:
                    self.monitor.reference = result.predictor
                record = latest_for(session, engine)
            assert record is not None  # just stored
            return record

        return self.loop.call(sweep).result()

    def close(self) -> None:
        self.session.close()


def reuse_default_calibration(engine: EngineCore, database: Database) -> CalibrationRecord | None:
    """The default store's newest calibration of this engine's model, device and dtype,
    applied and copied into `database` (a new --db starts calibrated), or None."""
    default = default_db_path()
    if database.path.resolve() == default.resolve() or not default.is_file():
        return None
    try:
        source = open_database(default, read_only=True)
    except EngineError:
        return None  # an unreadable default store is no reason to stop this one
    try:
        with source.session() as session:
            record = latest_for(session, engine)
    finally:
        source.close()
    load = ((record.info.get("provenance") or {}).get("load") or {}) if record else {}
    if record is None or load.get("contended"):  # one measured under load is not spread
        return None
    with database.session() as session:
        save_calibration(session, model=record.model, device=record.device, table=record.table,
                         params=record.params, info=record.info,
                         reason=f"calibration {record.id} of {default}{REUSED}")
        copied = latest_for(session, engine)
    if copied is not None:
        engine.apply_calibration(StepTimePredictor.from_dict(copied.params))
    return copied


def restore_config(engine: EngineCore, database: Database,
                   explicit: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Set each live setting to the newest value the store's changes give it (a restart
    comes back as it was left), except those the command line set; what it set."""
    with database.session() as session:
        changes = config_changes(session, limit=None)
    live = engine.config.live_values()
    newest: dict[str, Any] = {}
    for change in reversed(changes):  # oldest first: the newest value of each field wins
        newest[change.field] = change.new
    wanted = {name: value for name, value in newest.items()
              if name in live and name not in explicit and value != live[name]}
    try:
        engine.update_config("restored from the store", **wanted)
    except ConfigError as exc:  # a value this version refuses: start from the defaults
        log.warning("not restoring the stored settings: %s", exc)
        return {}
    engine.apply_pending_config()
    return wanted


def _explicit(config: EngineConfig) -> frozenset[str]:
    """The settings a caller's config sets away from the defaults (flags beat the store)."""
    default = EngineConfig().live_values()
    return frozenset(name for name, value in config.live_values().items()
                     if default.get(name) != value)
