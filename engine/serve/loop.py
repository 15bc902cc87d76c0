"""The engine on a background thread, for the console and the HTTP server.

Other threads submit, abort, tune and read snapshots; everything that touches engine state
is applied on the loop thread at a step boundary, so the engine itself stays single-threaded.
The loop waits on a condition when idle (no polling sleeps) and refreshes the published
snapshot after steps, at most every `snapshot_interval_s`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig, SamplingParams
from engine.core.engine import Engine, RequestOutput
from engine.harness.workload import WorkloadRequest
from engine.snapshot import Snapshot

OutputCallback = Callable[[RequestOutput], None]


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
    def __init__(self, engine: Engine, snapshot_interval_s: float = 0.1) -> None:
        self.engine = engine
        self.snapshot_interval_s = snapshot_interval_s
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._callbacks: dict[str, OutputCallback] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._paused = False
        self._snapshot = engine.snapshot()
        self._snapshot_at = 0.0
        self._workload: deque[WorkloadRequest] = deque()
        self._workload_start = 0.0
        self._workload_cycle: list[WorkloadRequest] | None = None
        self._cycle_count = 0
        self.error: BaseException | None = None

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

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        with self._wake:
            self._paused = False
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
            except BaseException as exc:  # handed to the caller through the future
                future.set_exception(exc)

        self._enqueue(run)
        return future

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def play(self, workload: list[WorkloadRequest], repeat: bool = False,
             first_cycle: int = 0) -> None:
        """Submit `workload` at its arrival times (relative to now); `repeat` cycles it. Each
        request is named `{id}-{cycle}`, cycles counted from `first_cycle`."""
        def install() -> None:
            self._workload = deque(workload)
            self._workload_start = time.monotonic()
            self._workload_cycle = list(workload) if repeat else None
            self._cycle_count = first_cycle
        self._enqueue(install)

    # --- the loop thread ----------------------------------------------------------------
    def _enqueue(self, command: Callable[[], None]) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _add(self, s: _Submission) -> None:
        if s.on_output is not None:
            self._callbacks[s.request_id] = s.on_output
        self.engine.add_request(s.token_ids, s.params, tenant=s.tenant, priority=s.priority,
                                request_id=s.request_id, tag=s.tag)

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self._commands and not self._has_work():
                        self._wake.wait(timeout=self._idle_timeout())
                        self._feed_workload()
                        if not self._paused:
                            self.engine.step()  # idle tick: modes and guards see time pass
                        self._publish_snapshot(force=True)
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, deque()
                for command in commands:
                    command()
                self.engine.apply_pending_config()
                self._feed_workload()
                if not self._paused and self.engine.has_unfinished():
                    for output in self.engine.step():
                        self._deliver(output)
                # going idle: publish now, so readers see the last requests finished
                self._publish_snapshot(force=not self.engine.has_unfinished())
        except BaseException as exc:  # surfaced to the UI / server instead of dying silently
            self.error = exc
            self._publish_snapshot(force=True)
            raise

    def _has_work(self) -> bool:
        return not self._paused and self.engine.has_unfinished()

    def _idle_timeout(self) -> float:
        if self._workload:
            due = self._workload_start + self._workload[0].arrival_s - time.monotonic()
            return max(0.0, min(due, self.snapshot_interval_s))
        return self.snapshot_interval_s

    def _feed_workload(self) -> None:
        elapsed = time.monotonic() - self._workload_start
        while self._workload and self._workload[0].arrival_s <= elapsed:
            item = self._workload.popleft()
            self.engine.add_request(list(item.prompt_token_ids), item.sampling_params(),
                                    tenant=item.tenant, priority=item.priority,
                                    request_id=f"{item.request_id}-{self._cycle_count}",
                                    tag=item.tag)
        if not self._workload and self._workload_cycle:
            self._cycle_count += 1
            self._workload = deque(self._workload_cycle)
            self._workload_start = time.monotonic()

    def _deliver(self, output: RequestOutput) -> None:
        callback = self._callbacks.get(output.request_id)
        if callback is None:
            return
        if output.finished:
            del self._callbacks[output.request_id]
        try:
            callback(output)
        except Exception as exc:  # a fault in one request's output fails that request alone
            self._callbacks.pop(output.request_id, None)
            self.engine.fail(output.request_id, f"delivering its output failed: "
                                                f"{type(exc).__name__}: {exc}")

    def _publish_snapshot(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._snapshot_at >= self.snapshot_interval_s:
            self._snapshot = self.engine.snapshot()
            self._snapshot_at = now
