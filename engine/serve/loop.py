"""The engine on a background thread; other threads' commands apply at a step boundary."""

from __future__ import annotations

import dataclasses
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
from engine.core.engine import Engine, RequestOutput
from engine.core.request import Request, RequestState
from engine.errors import EngineError
from engine.events import EngineRestarted
from engine.harness.recovery import Resumption
from engine.harness.workload import WorkloadRequest
from engine.serve.memory import IdleTrim
from engine.serve.playback import WorkloadPlayer
from engine.serve.supervisor import Supervisor
from engine.snapshot import Snapshot

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]
JournalResume = Callable[[Engine], Resumption]


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
    def __init__(self, engine: Engine, snapshot_interval_s: float = 0.1, *,
                 clock: Clock = time.monotonic, journal: JournalResume | None = None,
                 journal_flush: Callable[[float], bool] | None = None,
                 supervisor: Supervisor | None = None) -> None:
        """`clock` paces snapshots and workloads; `journal_flush` commits what was published."""
        self.engine = engine
        self.snapshot_interval_s = snapshot_interval_s
        self.clock = clock
        self.journal = journal
        self.journal_flush = journal_flush
        self.supervisor = supervisor or Supervisor(engine.clock)
        self.failed_while_down = 0
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._listeners: dict[str, _Listener] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._paused = False
        self._snapshot = engine.snapshot()
        self._snapshot_at = 0.0
        self.player = WorkloadPlayer(clock)
        self.error: BaseException | None = None
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

    def call(self, fn: Callable[[Engine], Any]) -> Future[Any]:
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
        return self._snapshot

    def play(self, workload: list[WorkloadRequest], repeat: bool = False,
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
            self._listeners[s.request_id] = _Listener(s.on_output)
        if self.error is not None:
            self.failed_while_down += 1
            self._deliver(_failed(s.request_id, str(self.error)))
            return
        try:
            self.engine.add_request(s.token_ids, s.params, tenant=s.tenant, priority=s.priority,
                                    request_id=s.request_id, tag=s.tag)
        except EngineError as exc:  # this request's own fault (a duplicate id): it alone fails
            self._deliver(_failed(s.request_id, str(exc)))

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self._commands and not self._has_work():
                        self._wake.wait(timeout=self.player.idle_timeout(self.snapshot_interval_s))
                        self._supervised(self._feed_workload)
                        if not self._paused:
                            self._step()
                        self._publish_snapshot(force=True)
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, deque()
                for command in commands:
                    self._supervised(command)
                self._supervised(self.engine.apply_pending_config)
                self._supervised(self._feed_workload)
                if not self._paused and self.engine.has_unfinished():
                    for output in self._step():
                        self._deliver(output)
                    if self.engine.has_unfinished():
                        self.trim.busy()
                    else:
                        self.trim.idle()
                self._publish_snapshot(force=not self.engine.has_unfinished())
        except BaseException as exc:
            # logged, never raised: a thread's traceback on stderr would paint over a console
            self.error = exc
            log.critical("the engine loop died: %r", exc, exc_info=exc)
            self._publish_snapshot(force=True)

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
        engine, supervisor = self.engine, self.supervisor
        if self.error is not None:
            log.error("after the engine stopped: %r", exc, exc_info=exc)
            return
        fault = supervisor.judge(exc)
        log.error("engine fault at %s: %s\n%s", fault.place, fault.error, fault.traceback)
        stopped = supervisor.stopped
        live = list(engine.scheduler.requests)
        doomed = (set(live) if stopped is not None
                  else supervisor.struck_out(engine.stepping, live))
        reason = (str(stopped) if stopped is not None else
                  f"the engine failed twice in a step holding this request: {fault.error} at "
                  f"{fault.place}")
        kept, owed = engine.restart(dict.fromkeys(doomed, reason))
        if stopped is not None:
            self.error = stopped
            self.failed_while_down += len(doomed)
            resumed: list[str] = []
        else:
            resumed = self._resume(kept, owed)
        engine.bus.publish(EngineRestarted(restarts=supervisor.restarts, place=fault.place,
                                           error=fault.error, resumed=len(resumed),
                                           failed=len(doomed), stopped=stopped is not None,
                                           traceback=fault.traceback))
        try:
            engine.bus.drain()
        except Exception:
            log.exception("delivering the events of a restart failed")
        for output in owed:
            self._deliver(output)
        self._publish_snapshot(force=True)

    def _resume(self, kept: list[Request], owed: list[RequestOutput]) -> list[str]:
        """Re-add what the engine had accepted: from the journal when there is one, else in hand."""
        engine = self.engine
        handled: set[str] = set()
        generated = {r.id: r.output_token_ids for r in kept}
        if self.journal is not None:
            try:
                engine.bus.drain()
                resumption = self.journal(engine)
            except Exception:
                log.exception("resuming from the journal failed; resuming what is in memory")
            else:
                handled = {*resumption.resumed, *resumption.quarantined, *resumption.failed}
                closed = {*resumption.quarantined, *resumption.failed}
                owed.extend(_failed(r.id, "not resumed after an engine restart (see the "
                                          "journal)")
                            for r in kept if r.id in closed)
                generated.update(resumption.generated)
        for request in kept:
            if request.id not in handled:
                engine.add_request(request.prompt_token_ids, request.params,
                                   tenant=request.tenant, priority=request.priority,
                                   request_id=request.id, tag=request.tag,
                                   arrival=request.arrival,
                                   generated=request.output_token_ids)
        # ahead of what is owed: a resumed request that ended at once is owed its end
        owed[:0] = [output for rid, tokens in generated.items()
                    if (listener := self._listeners.get(rid)) is not None
                    and (output := listener.resumed(rid, tokens)) is not None]
        return list(engine.scheduler.requests)

    def health(self) -> LoopHealth:
        return LoopHealth(self.error is None, self.supervisor.restarts, self.failed_while_down,
                          None if self.error is None else str(self.error))

    def _has_work(self) -> bool:
        return not self._paused and self.engine.has_unfinished()

    def _feed_workload(self) -> None:
        self.player.feed(self.engine)

    def _deliver(self, output: RequestOutput) -> None:
        listener = self._listeners.get(output.request_id)
        if listener is None:
            return
        if output.finished:
            del self._listeners[output.request_id]
        try:
            listener.hear(output)
        except Exception as exc:  # a fault in one request's output fails that request alone
            self._listeners.pop(output.request_id, None)
            self.engine.fail(output.request_id, f"delivering its output failed: "
                                                f"{type(exc).__name__}: {exc}")

    def _publish_snapshot(self, force: bool = False) -> None:
        now = self.clock()
        if force or now - self._snapshot_at >= self.snapshot_interval_s:
            snapshot = self.engine.snapshot()
            last = self.supervisor.last
            if last is not None:
                snapshot = dataclasses.replace(
                    snapshot, engine_restarts=self.supervisor.restarts,
                    engine_fault=f"{last.error} at {last.place}")
            self._snapshot = snapshot
            self._snapshot_at = now


def _failed(request_id: str, reason: str) -> RequestOutput:
    """The last output of a request that ended outside the engine's steps."""
    return RequestOutput(request_id, (), True, reason, RequestState.FAILED.value)


class _Listener:
    """A request's callback and the tokens it heard: a resumed request may have more or fewer."""

    def __init__(self, callback: OutputCallback) -> None:
        self.callback = callback
        self.heard = 0
        self.repeats = 0  # tokens the resumed request generates again, already heard

    def hear(self, output: RequestOutput) -> None:
        if self.repeats:
            new = output.new_token_ids
            dropped = min(self.repeats, len(new))
            self.repeats -= dropped
            logprobs = output.logprobs
            output = dataclasses.replace(
                output, new_token_ids=new[dropped:],
                logprobs=None if logprobs is None else logprobs[dropped:])
        self.heard += len(output.new_token_ids)
        self.callback(output)

    def resumed(self, request_id: str, generated: Sequence[int]) -> RequestOutput | None:
        """After a resume with `generated`: an output of the tokens not yet heard, or None."""
        self.repeats = max(0, self.heard - len(generated))
        unheard = tuple(generated[self.heard:])
        if not unheard:
            return None
        return RequestOutput(request_id, unheard, False, None, RequestState.WAITING.value)
