"""The embedded engine in a child process, as vLLM V1 runs its EngineCore beside the API server.

In one process the console's rendering and the engine's step share one GIL: every torch op
the engine dispatches waits while the UI lays out a table (measured here: a UI thread busy
25% of the time cost the engine 19% of its throughput, 50% cost 45%). In a child process the
engine keeps its core to itself and the UI only pays for a pickled snapshot per poll.

The parent holds a ProcessSource (the console's Source); the child runs an EmbeddedSource and
answers each call on a worker thread, so a recalibration in progress does not hold up the
snapshots. Messages on the pipe: (call_id, method, args, kwargs) down; (call_id, kind,
payload) up, kind being "ready", "result", "error", "progress" or "log" (call_id None for
the ones no call asked for).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext, ForkServerContext
from typing import TYPE_CHECKING, Any

from console.sources.base import (
    TRACED_DRIFT_WHY,
    Capabilities,
    Capability,
    Progress,
    SourceError,
)
from engine.snapshot import Snapshot

if TYPE_CHECKING:  # the store pulls in SQLAlchemy: kept off the launch path
    from engine.store import (
        CalibrationRecord,
        ConfigChangeRecord,
        DriftRecord,
        SlowQueryRecord,
        StoredMetrics,
    )

# The Source methods a child answers; anything else is refused.
CALLS = frozenset({"snapshot", "update_config", "pause", "resume", "slow_queries",
                   "slow_query", "calibration_history", "drift_events", "config_changes",
                   "recalibrate", "set_arrival_rate", "stored_metrics"})
CLOSE_TIMEOUT_S = 15.0


class ProcessSource:
    # the child's EmbeddedSource answers every call
    capabilities = Capabilities.lacking({Capability.TRACED_DRIFT: TRACED_DRIFT_WHY})

    def __init__(self, process: multiprocessing.process.BaseProcess,
                 connection: Connection) -> None:
        self.name = "embedded engine (starting)"
        self._process = process
        self._connection = connection
        self._send_lock = threading.Lock()
        # one thread reaps the child at a time: another's waitpid meanwhile finds no child and
        # reads its exit code as unknown
        self._reap_lock = threading.Lock()
        self._pending: dict[int, tuple[Future[Any], Progress | None]] = {}
        self._ids = itertools.count()
        self._ready = False
        # what the last session on the store left unfinished, closed as aborted at start
        self.orphans: tuple[str, ...] = ()
        self.quarantined: tuple[str, ...] = ()  # and those the journal holds quarantined
        self._closed = False
        self._reader_done = False  # set before the reader fails what is pending
        self._reader = threading.Thread(target=self._read, name="tokenflow-engine-pipe",
                                        daemon=True)

    @classmethod
    def launch(cls, context: BaseContext | None = None, **options: Any) -> ProcessSource:
        """Start the child, which runs EmbeddedSource.start(**options), and return at once;
        `wait_ready` then waits for it and raises its start-up error, if any. The child is
        spawned (no fork under Textual's threads) unless `context` says otherwise: a
        `preloaded()` forkserver's children skip the engine's imports."""
        context = context or multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        # a forkserver's child starts in the server's environment and directory: it takes ours
        process = context.Process(target=serve, args=(child, options, dict(os.environ),
                                                      os.getcwd()),
                                  name="tokenflow-engine", daemon=True)
        process.start()
        child.close()
        return cls(process, parent)

    @classmethod
    def start(cls, context: BaseContext | None = None, **options: Any) -> ProcessSource:
        """launch() and wait_ready() in one."""
        return cls.launch(context, **options).wait_ready()

    def wait_ready(self, progress: Progress | None = None) -> ProcessSource:
        """Wait for the child to start, passing `progress` each stage it reports (loading the
        model, calibrating, restoring the settings); raise its start-up error, if any."""
        if self._ready:
            return self
        try:
            kind, payload = _first_answer(self._connection, progress)
        except EOFError:
            self._process.join(CLOSE_TIMEOUT_S)
            raise SourceError(f"the engine process exited while starting (exit code "
                              f"{self._process.exitcode})") from None
        if kind == "error":
            self._process.join(CLOSE_TIMEOUT_S)
            raise payload
        (self.name, self.orphans, self.quarantined), self._ready = payload, True
        self._reader.start()
        return self

    # --- the Source interface -------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return self._call("snapshot")

    def update_config(self, **changes: Any) -> dict[str, Any]:
        return self._call("update_config", **changes)

    def set_arrival_rate(self, rate: float) -> float:
        return self._call("set_arrival_rate", rate)

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def slow_queries(self, limit: int = 500) -> list[SlowQueryRecord]:
        return self._call("slow_queries", limit=limit)

    def slow_query(self, query_id: int) -> SlowQueryRecord:
        return self._call("slow_query", query_id)

    def calibration_history(self) -> list[CalibrationRecord]:
        return self._call("calibration_history")

    def drift_events(self) -> list[DriftRecord]:
        return self._call("drift_events")

    def config_changes(self) -> list[ConfigChangeRecord]:
        return self._call("config_changes")

    def stored_metrics(self, start: float, end: float, buckets: int) -> StoredMetrics:
        return self._call("stored_metrics", start, end, buckets)

    def recalibrate(self, progress: Progress) -> CalibrationRecord:
        return self._call("recalibrate", progress=progress)

    def close(self) -> None:
        """Ask the child to stop its engine and flush its store, then wait for it."""
        if self._closed:
            return
        self._closed = True  # from here on the child's last warnings are not re-logged
        if not self._ready:  # still starting, it reads no call: `q` on the splash stops it now
            self._process.terminate()
        with contextlib.suppress(BrokenPipeError, OSError), self._send_lock:  # or it is gone
            self._connection.send(None)
        with self._reap_lock:
            self._process.join(CLOSE_TIMEOUT_S)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(CLOSE_TIMEOUT_S)
        self._connection.close()

    # --- plumbing -------------------------------------------------------------------------
    def _call(self, method: str, *args: Any, progress: Progress | None = None,
              **kwargs: Any) -> Any:
        future: Future[Any] = Future()
        call_id = next(self._ids)
        with self._send_lock:
            if self._closed:
                raise SourceError("the embedded engine is closed")
            self._pending[call_id] = (future, progress)
            try:
                self._connection.send((call_id, method, args, kwargs))
            except (BrokenPipeError, OSError) as exc:
                self._pending.pop(call_id, None)  # the reader may have failed it already
                raise self._gone() from exc
        if self._reader_done:  # it may have failed the pending calls before this one arrived
            self._pending.pop(call_id, None)
            raise self._gone()
        return future.result()

    def _read(self) -> None:
        while True:
            try:
                call_id, kind, payload = self._connection.recv()
            except (EOFError, OSError):
                break
            if kind == "log":
                if not self._closed:  # after close the console's log handler may be gone
                    _relog(payload)
                continue
            future, progress = self._pending.get(call_id, (None, None))
            if future is None:
                continue
            if kind == "progress":
                if progress is not None:
                    progress(*payload)
                continue
            del self._pending[call_id]
            if kind == "error":
                future.set_exception(payload)
            else:
                future.set_result(payload)
        self._reader_done = True
        for call_id, (future, _) in list(self._pending.items()):  # nobody will answer these
            self._pending.pop(call_id, None)
            future.set_exception(self._gone())

    def _gone(self) -> SourceError:
        with self._reap_lock:
            self._process.join(0.5)
            code = self._process.exitcode
        return SourceError("the engine process has exited" +
                           ("" if code is None else f" (exit code {code})") +
                           "; restart tokenflow-console")


def preloaded() -> ForkServerContext:
    """A forkserver context whose server imports the engine (torch, seconds of CPU) once, when
    it starts; every child it starts then forks from there. The first child waits for that
    import, so a process that starts one child gains nothing: the console spawns its engine,
    overlapping the import with its own. The server runs no thread of its own (BLAS's pool
    stops around a fork), so a fork copies no lock another thread holds."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["console.sources.embedded"])
    return context


def serve(connection: Connection, options: dict[str, Any], environ: dict[str, str],
          cwd: str) -> None:
    """The child: an EmbeddedSource answering the parent's calls until told to stop, in the
    parent's environment and directory (as of its launch)."""
    os.environ.clear()
    os.environ.update(environ)
    time.tzset()  # the local time's zone follows TZ
    os.chdir(cwd)
    from console.sources.embedded import EmbeddedSource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's to handle
    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:
            connection.send(message)

    # Warnings go up the pipe: written here they would land in the middle of the parent's UI.
    logging.basicConfig(level=logging.WARNING, handlers=[_PipeHandler(send)], force=True)
    def starting(fraction: float, what: str) -> None:
        send((None, "progress", (fraction, what)))

    try:
        source = EmbeddedSource.start(**options, progress=starting)
    except BaseException as exc:  # handed to the parent, which raises it
        send((None, "error", _portable(exc)))
        return
    def answer(call_id: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            if method not in CALLS:
                raise SourceError(f"the embedded engine has no call {method!r}")
            if method == "recalibrate":
                def progress(fraction: float, what: str) -> None:
                    send((call_id, "progress", (fraction, what)))
                kwargs = {"progress": progress}
            result = getattr(source, method)(*args, **kwargs)
        except Exception as exc:  # the caller's error, raised in the parent
            send((call_id, "error", _portable(exc)))
            return
        send((call_id, "result", result))

    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="tokenflow-call") as pool:
        send((None, "ready", (source.name, source.orphans, source.quarantined)))
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                break  # the parent died: stop cleanly all the same
            if message is None:
                break
            pool.submit(answer, *message)
    source.close()


class _PipeHandler(logging.Handler):
    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        super().__init__()
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):  # the parent is gone: nobody to tell
            self.send((None, "log", (record.name, record.levelno, record.getMessage())))


def _first_answer(connection: Connection,
                  progress: Progress | None = None) -> tuple[str, Any]:
    """The "ready" or "error" of a starting child, re-logging what it logs and passing on
    the progress it reports on the way."""
    while True:
        _, kind, payload = connection.recv()
        if kind == "log":
            _relog(payload)
        elif kind == "progress":
            if progress is not None:
                progress(*payload)
        else:
            return kind, payload


def _relog(record: tuple[str, int, str]) -> None:
    """A record the child logged, into this process's logging (the console's log)."""
    name, level, text = record
    logging.getLogger(name).log(level, "%s", text)


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a SourceError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return SourceError(f"{type(exc).__name__}: {exc}")
    return exc
