"""The engine on a background thread; other threads' commands apply at a step boundary."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.clock import Clock
from engine.config import EngineConfig, SamplingParams
from engine.core.engine_core import EngineCore, RequestOutput
from engine.errors import EngineError
from engine.serve.healing import Healer, JournalResume
from engine.serve.memory import IdleTrim
from engine.serve.outputs import OutputCallback, Outputs, failed
from engine.serve.playback import Arrival, WorkloadPlayer
from engine.serve.snapshots import SnapshotPublisher
from engine.serve.supervisor import Supervisor
from engine.snapshot import Snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopHealth:

    up: bool
    restarts: int
    failed_while_down: int
    error: str | None


@dataclass(frozen=True)
class _Submission:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    tenant: str
    priority: int
    tag: str | None
    on_output: OutputCallback | None


class EngineLoop:
    """The thread and its commands; requests' outputs (Outputs), restarts after a fault
    (Healer), the published snapshot (SnapshotPublisher) and workload playback
    (WorkloadPlayer) each have their own class."""

    def __init__(self, engine: EngineCore, snapshot_interval_s: float = 0.1, *,
                 clock: Clock = time.monotonic, journal: JournalResume | None = None,
                 journal_served: Callable[[Callable[[bool], None]], None] | None = None,
                 supervisor: Supervisor | None = None, workload_clock: Clock | None = None,
                 workload_pace: float = 1.0) -> None:
        """`clock` paces snapshots, and workloads unless `workload_clock` does (a twin's
        simulated clock, `workload_pace` of its seconds a wall second); `journal_served(then)`
        calls `then(ok)` once what was published is committed (StoreWriter.when_served)."""
        self.engine = engine
        self.snapshot_interval_s = snapshot_interval_s
        self.journal_served = journal_served
        self.supervisor = supervisor or Supervisor(engine.clock)
        self.failed_while_down = 0
        self.error: BaseException | None = None  # the engine stopped: a crash loop, or died
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._paused = False
        self.outputs = Outputs(engine)
        self.healer = Healer(engine, self.supervisor, journal, self.outputs)
        self.snapshots = SnapshotPublisher(engine, self.supervisor, clock, snapshot_interval_s)
        self.player = WorkloadPlayer(workload_clock or clock, workload_pace)
        # a backlog never lets the engine idle: freed memory goes back while it works
        self.trim = IdleTrim(clock=clock)

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread = threading.Thread(target=self._run, name="tokenflow-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.close()  # its telemetry thread ends with it

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        self._paused = True
        # the engine hears it on its own thread: the pause is then named in its verdicts
        self._enqueue(lambda: self.engine.hold(True))

    def resume(self) -> None:
        with self._wake:
            self._paused = False
            self._commands.append(lambda: self.engine.hold(False))
            self._wake.notify()

    # --- from any thread ----------------------------------------------------------------
    def submit(self, prompt: Sequence[int] | str, params: SamplingParams | None = None, *,
               tenant: str = "default", priority: int = 0, request_id: str | None = None,
               tag: str | None = None, on_output: OutputCallback | None = None) -> str:
        """Validate on the caller's thread (RequestError for bad input), queue for the loop."""
        token_ids = self.engine.prompt_token_ids(prompt)
        submission = _Submission(request_id or uuid.uuid4().hex[:16], token_ids,
                                 params or SamplingParams(), tenant, priority, tag, on_output)
        self._enqueue(lambda: self._add(submission))
        return submission.request_id

    def abort(self, request_id: str) -> None:
        self._enqueue(lambda: self.engine.abort(request_id))

    def update_config(self, source: str = "api", **changes: Any) -> EngineConfig:
        config = self.engine.update_config(source, **changes)
        self._enqueue(lambda: None)  # wake an idle loop so the change applies now
        return config

    def call(self, fn: Callable[[EngineCore], Any]) -> Future[Any]:
        """Run fn(engine) on the loop thread at the next step boundary."""
        future: Future[Any] = Future()

        def run() -> None:
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:
                future.set_exception(exc)

        self._enqueue(run)
        return future

    def snapshot(self) -> Snapshot:
        return self.snapshots.latest

    def play(self, workload: Sequence[Arrival], repeat: bool = False,
             first_cycle: int = 0) -> None:
        """Submit `workload` at its arrival times from now as `{id}-{cycle}`; `repeat` cycles it."""
        self.player.plan(workload)
        self._enqueue(lambda: self.player.install(workload, repeat, first_cycle))

    @property
    def arrival_rate(self) -> float | None:
        return self.player.arrival_rate

    def set_arrival_rate(self, rate: float) -> float:
        """Play the workload at `rate` requests/s (0 holds arrivals), keeping its gaps' pattern."""
        speed = self.player.speed_for(rate)
        self._enqueue(lambda: self.player.retime(speed))
        return rate

    # --- the loop thread ----------------------------------------------------------------
    def _enqueue(self, command: Callable[[], None]) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _add(self, s: _Submission) -> None:
        if s.on_output is not None:
            self.outputs.listen(s.request_id, s.on_output)
        if self.error is not None:
            self.failed_while_down += 1
            self.outputs.deliver(failed(s.request_id, str(self.error)))
            return
        try:
            self.engine.add_request(s.token_ids, s.params, tenant=s.tenant, priority=s.priority,
                                    request_id=s.request_id, tag=s.tag)
        except EngineError as exc:  # this request's own fault (a duplicate id): it alone fails
            self.outputs.deliver(failed(s.request_id, str(exc)))

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self._commands and not self.has_work():
                        self._wake.wait(timeout=self.player.idle_timeout(self.snapshot_interval_s))
                        self._supervised(self._feed_workload)
                        if not self._paused:  # a resume or a workload may have brought work
                            self._step_and_deliver()
                        if not self._commands:  # a command's wake: its own pass publishes,
                            # after it runs (a snapshot now would only delay the command)
                            self.snapshots.publish(force=True)
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, deque()
                for command in commands:
                    self._supervised(command)
                self._supervised(self.outputs.sent)  # a command may have ended a request
                self._supervised(self.engine.apply_pending_config)
                self._supervised(self._feed_workload)
                if not self._paused and self.engine.has_unfinished():
                    self._step_and_deliver()
                    if self.engine.has_unfinished():
                        self.trim.busy()
                    else:
                        self.trim.idle()
                self.snapshots.publish(force=not self.engine.has_unfinished())
        except BaseException as exc:
            # logged, never raised: a thread's traceback on stderr would paint over a console
            self.error = exc
            log.critical("the engine loop died: %r", exc, exc_info=exc)
            self.snapshots.publish(force=True)

    def _step_and_deliver(self) -> None:
        """A step, its outputs delivered and sent on before anything else (the snapshot)."""
        for output in self._step():
            self.outputs.deliver(output)
        self._supervised(self.outputs.sent)

    def _step(self) -> list[RequestOutput]:
        """One engine step, supervised; nothing once the engine has stopped."""
        if self.error is not None:
            return []
        try:
            return self.engine.step()
        except Exception as exc:
            self._heal(exc)
            return []

    def _supervised(self, work: Callable[[], object]) -> None:
        try:
            work()
        except Exception as exc:
            self._heal(exc)

    def _heal(self, exc: Exception) -> None:
        """A fault no request caused: restart from the journal, or stop on a crash loop."""
        if self.error is not None:
            log.error("after the engine stopped: %r", exc, exc_info=exc)
            return
        healed = self.healer.heal(exc)
        if healed.stopped is not None:
            self.error = healed.stopped
            self.failed_while_down += healed.failed_while_down
        for output in healed.owed:
            self.outputs.deliver(output)
        self.snapshots.publish(force=True)

    def health(self) -> LoopHealth:
        return LoopHealth(self.error is None, self.supervisor.restarts, self.failed_while_down,
                          None if self.error is None else str(self.error))

    def has_work(self) -> bool:
        """Whether the loop steps: unfinished requests, and not paused."""
        return not self._paused and self.engine.has_unfinished()

    def _feed_workload(self) -> None:
        self.player.feed(self.engine)
