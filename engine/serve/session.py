"""An engine with its store, started and stopped in one order (run, serve, bench, console)."""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from engine.calibration.calibrate import (
    CalibrationResult,
    apply_latest,
    first_calibration,
    latest_for,
)
from engine.config import EngineConfig
from engine.events import SessionStarted, Subscriber
from engine.ops.equipped import Engine
from engine.serve.loop import EngineLoop
from engine.sim.executor import PacedClock, Simulation, simulated_engine
from engine.sim.target import resolve_target
from engine.store import CalibrationRecord, Commit, Database, StoreWriter, open_database
from engine.store.recovery import Resumption, abort_orphans, resume_unfinished

FLUSH_TIMEOUT_S = 10.0


@dataclass
class EngineSession:
    engine: Engine
    database: Database | None
    writer: StoreWriter | None
    calibration: CalibrationRecord | None
    loop: EngineLoop | None = None
    first_calibration: CalibrationResult | None = None
    # what the last process on this store left unfinished, closed as aborted at start
    orphans: tuple[str, ...] = ()

    @classmethod
    def start(cls, config: EngineConfig, *, db: str | Path | None = None, store: bool = True,
              server: str | None = None,
              journal: bool = True, calibrate: bool = True,
              observers: Sequence[Subscriber] = (),
              on_commit: Callable[[Commit], None] | None = None,
              simulate: Simulation | None = None, resume: bool = False) -> EngineSession:
        """Open the store, build the engine, apply or run a calibration, close the store's
        orphans, start the journal. Every start (serve, the console, run, bench) comes through here,
        so orphans get one treatment: closed as aborted (docs/engine.md, "Orphaned
        requests"), unless `resume` keeps them for `resume_unfinished` (run --resume)."""
        database = open_database(db, server=server) if store else None
        orphans: tuple[str, ...] = ()
        try:
            if database is not None and journal:
                database.claim_writer()  # one writer per store: refused before the model loads
            calibration, first = None, None
            if simulate is not None:
                engine = _simulated(config, simulate, database)
                for observer in observers:
                    engine.bus.subscribe(observer)
                if calibrate:
                    assert isinstance(engine.clock, PacedClock)
                    with engine.clock.unpaced():
                        first = first_calibration(engine)
            else:
                engine = Engine(config)
                for observer in observers:
                    engine.bus.subscribe(observer)
                if database is not None:
                    with database.session() as session:
                        calibration = apply_latest(engine, session)
                        if calibration is None and calibrate:
                            first = first_calibration(engine, session)
                            calibration = latest_for(session, engine)
                elif calibrate:
                    first = first_calibration(engine)
            if database is not None and journal and not resume:
                orphans = abort_orphans(database)  # once the start can no longer fail
        except BaseException:
            if database is not None:
                database.close()
            raise
        writer = (StoreWriter(database, engine.bus, on_commit=on_commit)
                  if database is not None and journal else None)
        if writer is not None:  # stored, so a long history marks each restart of the process
            engine.bus.publish(SessionStarted(orphans=len(orphans)))
        return cls(engine, database, writer, calibration, first_calibration=first,
                   orphans=orphans)

    def resume_unfinished(self, skip: Set[str] = frozenset()) -> Resumption:
        """Re-add what the journal holds unfinished, except `skip`; nothing without a store."""
        if self.database is None:
            return Resumption((), (), ())
        return resume_unfinished(self.engine, self.database, skip=frozenset(skip))

    def attach_loop(self) -> EngineLoop:
        """The engine's loop thread, not started: subscribe observers, then `start()` it."""
        if self.loop is not None:
            raise RuntimeError("this session already has an engine loop")
        clock = self.engine.clock
        paced = clock if isinstance(clock, PacedClock) else None
        # a twin's traffic arrives on its own clock, whatever pace this host keeps
        self.loop = EngineLoop(self.engine,
                               journal=self._resume_after_fault if self.writer else None,
                               journal_served=self.writer.when_served if self.writer else None,
                               workload_clock=paced,
                               workload_pace=1.0 if paced is None else paced.speed)
        if paced is not None:  # paused, its time runs on as a real engine's does
            paced.hold_while(self.loop.has_work)
        return self.loop

    def _resume_after_fault(self, engine: Engine) -> Resumption:
        """The loop's restart: what the journal holds unfinished, once the writer has caught up."""
        assert self.writer is not None and self.database is not None
        if not self.writer.flush(timeout=FLUSH_TIMEOUT_S):
            raise TimeoutError(f"the journal writer did not commit within {FLUSH_TIMEOUT_S} s")
        return resume_unfinished(engine, self.database)

    def close(self) -> None:
        """Stop stepping, then commit what the writer holds, then close the database."""
        if self.loop is not None:
            self.loop.stop()
        if self.writer is not None:
            self.writer.close()
        if self.database is not None:
            self.database.close()

    def __enter__(self) -> EngineSession:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _simulated(config: EngineConfig, simulate: Simulation, database: Database | None) -> Engine:
    with nullcontext() if database is None else database.session() as session:
        target = resolve_target(simulate.target, config, tp=simulate.tp, session=session,
                                kv_cache_dtype=simulate.kv_cache_dtype,
                                gpu_profile=simulate.gpu_profile)
    return simulated_engine(config, target, PacedClock(simulate.speed))
