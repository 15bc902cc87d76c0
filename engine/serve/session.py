"""An engine with its store, started and stopped in one order: `tokenflow run`, `serve`,
`bench` and the console's embedded source all go through `EngineSession`.

Start: the store first (a bad --db, or a store another process journals to, fails before
the model loads: a journaling session is the store's one writer), then the engine, the
newest stored calibration for its model and device, and the journal writer (subscribed
before anything is resumed or submitted, so every request is journaled). With no stored
calibration a quick first one runs before anything is served (seconds; its progress is
CalibrationProgress events on the engine's bus, delivered to `observers`), and is stored:
until an engine is calibrated it gives no budget_score, C* or slow query (issue 16). What a
killed run left is resumed by an explicit `resume_unfinished` call, once the caller has
checked its own input, so a bad flag never consumes the journal. Stop (`close`, or leaving
the `with`): the loop thread, then the writer (it commits what is queued), then the
database.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from engine.config import EngineConfig
from engine.events import Subscriber
from engine.harness.calibrate import (
    CalibrationResult,
    apply_latest,
    first_calibration,
    latest_for,
)
from engine.harness.recovery import Resumption, abort_orphans, resume_unfinished
from engine.ops.equipped import Engine
from engine.serve.loop import EngineLoop
from engine.sim.executor import PacedClock, Simulation, simulated_engine
from engine.sim.target import resolve_target
from engine.store import CalibrationRecord, Commit, Database, StoreWriter, open_database

FLUSH_TIMEOUT_S = 10.0  # a restart waits this long for the journal to catch up


@dataclass
class EngineSession:
    engine: Engine
    database: Database | None  # None: no store (--no-db)
    writer: StoreWriter | None  # None: no store, or the store is only read (bench)
    calibration: CalibrationRecord | None  # the stored calibration now applied, if any
    loop: EngineLoop | None = None
    first_calibration: CalibrationResult | None = None  # the one run at start, if any

    @classmethod
    def start(cls, config: EngineConfig, *, db: str | Path | None = None, store: bool = True,
              server: str | None = None,
              journal: bool = True, calibrate: bool = True,
              observers: Sequence[Subscriber] = (),
              on_commit: Callable[[Commit], None] | None = None,
              simulate: Simulation | None = None) -> EngineSession:
        """Open the store at `db` (default path when None; none at all without `store`) to
        write as `server` (default: this host),
        build the engine, subscribe `observers` to its bus, apply the stored calibration
        (or, with `calibrate`, run and store a first one) and, with `journal`, start the
        journal writer (`on_commit` hears each commit). The store is closed again if the
        engine cannot be built. `simulate` builds the GPU twin instead, paced to the wall
        clock, its step times from the simulation's target (which may read a calibration
        from the store); its own first calibration, on its simulated steps, is not stored."""
        database = open_database(db, server=server) if store else None
        try:
            if database is not None and journal:
                database.claim_writer()  # one writer per store: refused before the model loads
            calibration, first = None, None
            if simulate is not None:
                engine = _simulated(config, simulate, database)
                for observer in observers:
                    engine.bus.subscribe(observer)
                if calibrate:
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
        except BaseException:
            if database is not None:
                database.close()
            raise
        writer = (StoreWriter(database, engine.bus, on_commit=on_commit)
                  if database is not None and journal else None)
        return cls(engine, database, writer, calibration, first_calibration=first)

    def resume_unfinished(self, skip: Set[str] = frozenset()) -> Resumption:
        """Re-add what the journal holds unfinished (crash recovery, pitfall 12), except
        `skip`; what was resumed, quarantined or refused. Nothing without a store."""
        if self.database is None:
            return Resumption((), (), ())
        return resume_unfinished(self.engine, self.database, skip=frozenset(skip))

    def abort_orphans(self) -> tuple[str, ...]:
        """Close what a killed server had in flight as aborted (its clients are gone); the
        ids closed. Nothing without a store."""
        return () if self.database is None else abort_orphans(self.database)

    def attach_loop(self) -> EngineLoop:
        """The engine's loop thread, not started: subscribe observers, then `start()` it.
        `close` stops it before anything else."""
        if self.loop is not None:
            raise RuntimeError("this session already has an engine loop")
        self.loop = EngineLoop(self.engine,
                               journal=self._resume_after_fault if self.writer else None,
                               journal_flush=self.writer.flush if self.writer else None)
        return self.loop

    def _resume_after_fault(self, engine: Engine) -> Resumption:
        """The loop's restart: once the writer has committed everything the engine
        published, what the journal holds unfinished is what was accepted."""
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
    if database is None:
        target = resolve_target(simulate.target, config, tp=simulate.tp)
    else:
        with database.session() as session:
            target = resolve_target(simulate.target, config, tp=simulate.tp, session=session)
    return simulated_engine(config, target, PacedClock(simulate.speed))
