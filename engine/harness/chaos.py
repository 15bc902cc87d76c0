"""Fault injection: each scenario breaks one thing and checks recovery within a bound, no loss."""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.batch import Batch, ModelRunnerOutput
from engine.budget.peaks import measure_peaks
from engine.clock import Clock
from engine.config import EngineConfig
from engine.core.request import RequestState
from engine.errors import EngineError
from engine.harness.driver import OutputTokens
from engine.harness.workload import WorkloadRequest
from engine.ops.equipped import Engine
from engine.ops.telemetry import BandwidthSource, InjectedBandwidth, ModelBandwidth
from engine.store import StoreWriter, open_database, unfinished_requests

MODEL = "synthetic:tiny"
KV_POOL_BYTES = 1 << 20  # 128 tiny blocks: small enough to run out, large enough to serve
STEP_BUDGET = 32
CHUNK_TILE = 8
POLL_S = 0.01
RETRIES = 3
SPIKE_UTIL = 0.99


class ChaosError(EngineError):
    """A scenario name is unknown or a scenario could not be set up."""


@dataclass(frozen=True)
class ScenarioResult:
    name: str
    passed: bool
    recovery_ms: float | None
    lost: int
    detail: str


@dataclass(frozen=True)
class SuiteResult:
    scenarios: tuple[ScenarioResult, ...]

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.scenarios)

    @property
    def lost(self) -> int:
        return sum(s.lost for s in self.scenarios)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "lost": self.lost,
                "scenarios": [asdict(s) for s in self.scenarios]}


@dataclass(frozen=True)
class ChaosSettings:
    requests: int
    fault_s: float
    bound_s: float
    crash_requests: int


QUICK = ChaosSettings(requests=8, fault_s=0.3, bound_s=60.0, crash_requests=24)
FULL = ChaosSettings(requests=32, fault_s=3.0, bound_s=300.0, crash_requests=48)


def workload(count: int, seed: int, prefix: str) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    return [WorkloadRequest(request_id=f"{prefix}{i:03d}", arrival_s=0.0,
                            prompt_token_ids=tuple(rng.randrange(3, 300)
                                                   for _ in range(rng.randrange(40, 160))),
                            max_tokens=rng.randrange(12, 40)) for i in range(count)]


def chaos_engine(bandwidth: BandwidthSource | None = None, clock: Clock = time.monotonic,
                 **changes: Any) -> Engine:
    config = EngineConfig(model=MODEL, device="cpu", dtype="float32",
                          kv_cache_bytes=KV_POOL_BYTES, max_num_batched_tokens=STEP_BUDGET,
                          chunk_tile=CHUNK_TILE).replace(**changes)
    return Engine(config, bandwidth=bandwidth, clock=clock)


def expected_outputs(requests: Sequence[WorkloadRequest]) -> dict[str, list[int]]:
    harness = _Harness(chaos_engine(), requests)
    harness.run_until(lambda: False, deadline=time.monotonic() + 600)
    return dict(harness.finished)


class _Harness:
    """Drives an engine on this thread as a client would: submits, collects, retries failures."""

    def __init__(self, engine: Engine, requests: Sequence[WorkloadRequest],
                 held: int = 0) -> None:
        self.engine = engine
        self.requests = {r.request_id: r for r in requests}
        self.finished: dict[str, list[int]] = {}
        self.tokens = OutputTokens()
        self.failed: dict[str, str] = {}
        self.attempts = dict.fromkeys(self.requests, 0)
        self._attempt_of: dict[str, str] = {}
        self.retry_failed = False
        now = len(requests) - held
        self._held = [r.request_id for r in requests[now:]]
        for request in requests[:now]:
            self.submit(request.request_id)

    def release_held(self) -> None:
        for rid in self._held:
            self.submit(rid)
        self._held = []

    def submit(self, rid: str) -> None:
        request = self.requests[rid]
        attempt = self.attempts[request.request_id]
        engine_id = f"{request.request_id}.{attempt}"
        self.attempts[request.request_id] = attempt + 1
        self._attempt_of[engine_id] = request.request_id
        self.engine.add_request(list(request.prompt_token_ids), request.sampling_params(),
                                request_id=engine_id)

    def step(self) -> bool:
        produced = False
        for out in self.engine.step():
            produced = produced or bool(out.new_token_ids)
            tokens = self.tokens.add(out)
            if not out.finished:
                continue
            rid = self._attempt_of[out.request_id]
            if out.state == RequestState.FINISHED.value:
                self.finished[rid] = tokens
                continue
            self.failed[rid] = out.finish_reason or out.state
            if self.retry_failed and self.attempts[rid] < RETRIES:
                self.submit(rid)
        return produced

    def run_until(self, condition: Callable[[], bool], deadline: float) -> None:
        """Step until `condition()`, the deadline, or nothing is left to run."""
        self.tick_until(lambda: not self.engine.has_unfinished() or condition(), deadline)

    def tick_until(self, condition: Callable[[], bool], deadline: float) -> None:
        """Step until `condition()` or the deadline, idle steps included, as the loop ticks."""
        while not condition() and time.monotonic() < deadline:
            self.step()

    def first_tokens_after(self, deadline: float,
                           normal: Callable[[], bool] = lambda: True) -> float | None:
        """Step until a step makes tokens while `normal()` holds; its end, None if too late."""
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            if self.step() and normal():
                return time.monotonic()
        return None

    def lost(self, expected: dict[str, list[int]]) -> int:
        return sum(1 for rid in self.requests
                   if rid not in self.finished
                   or self.finished[rid] != expected[rid])


def _result(name: str, recovered_at: float | None, fault_end: float, lost: int,
            settings: ChaosSettings, detail: str, *checks: tuple[bool, str]) -> ScenarioResult:
    recovery_ms = None if recovered_at is None else max(0.0, recovered_at - fault_end) * 1000
    failures = [why for ok, why in checks if not ok]
    if recovery_ms is None:
        failures.append("no recovery")
    elif recovery_ms > settings.bound_s * 1000:
        failures.append(f"recovery over the {settings.bound_s:g} s bound")
    if lost:
        failures.append(f"{lost} request(s) lost")
    passed = not failures
    return ScenarioResult(name, passed, recovery_ms, lost,
                          detail if passed else f"{'; '.join(failures)} ({detail})")


def kv_exhaustion(settings: ChaosSettings, expected: dict[str, list[int]],
                  requests: Sequence[WorkloadRequest]) -> ScenarioResult:
    """Every free KV block reserved away mid-run; the engine preempts and waits, then resumes."""
    engine = chaos_engine()
    harness = _Harness(engine, requests)
    harness.run_until(lambda: any(r.is_decoding for r in engine.scheduler.requests.values()),
                      time.monotonic() + settings.bound_s)
    preemptions = engine.metrics.preemptions_total
    held = engine.blocks.reserve(engine.blocks.num_blocks)
    fault_end = time.monotonic() + settings.fault_s
    # The fault lasts its time and until the scheduler has met it, whatever the machine's load.
    harness.run_until(lambda: time.monotonic() >= fault_end and engine.scheduler.cache_pressure,
                      fault_end + settings.bound_s)
    detected = engine.scheduler.cache_pressure
    engine.blocks.reserve(0)
    fault_end = time.monotonic()
    recovered = harness.first_tokens_after(fault_end + settings.bound_s)
    harness.run_until(lambda: False, fault_end + settings.bound_s)
    lost = harness.lost(expected)
    detail = (f"{held} blocks reserved for {settings.fault_s:g} s; "
              f"{engine.metrics.preemptions_total - preemptions} preemption(s)")
    return _result("kv_exhaustion", recovered, fault_end, lost, settings, detail,
                   (detected, "cache pressure never engaged"))


def bandwidth_spike(settings: ChaosSettings, expected: dict[str, list[int]],
                    requests: Sequence[WorkloadRequest]) -> ScenarioResult:
    """The bandwidth reading pinned at 99% until the throttle reaches level 3; then released."""
    peak = measure_peaks("cpu", torch.float32).bandwidth
    injected = InjectedBandwidth(ModelBandwidth(peak))
    engine = chaos_engine(injected, bandwidth_pause_s=settings.fault_s / 30)
    # Every client arrives during the spike, and the pause comes soon: the throttle acts only
    # while several requests run and some still prefill; level 3 then holds prefills back
    harness = _Harness(engine, requests)
    spike_until = time.monotonic() + settings.fault_s
    injected.inject(SPIKE_UTIL, spike_until + settings.bound_s)
    top = 0

    def spike_over() -> bool:
        nonlocal top
        top = max(top, engine.scheduler.throttle_level)
        return time.monotonic() >= spike_until and top == 3

    harness.tick_until(spike_over, spike_until + settings.bound_s)
    engaged = "throttle" in engine.guards.engaged()
    injected.clear()
    fault_end = time.monotonic()
    harness.release_held()

    recovered = harness.first_tokens_after(fault_end + settings.bound_s,
                                           lambda: engine.scheduler.throttle_level == 0)
    harness.run_until(lambda: False, fault_end + settings.bound_s)
    engine.step()  # an idle tick: modes see the spike has ended
    released = "throttle" not in engine.guards.engaged()
    return _result("bandwidth_spike", recovered, fault_end, harness.lost(expected), settings,
                   f"{SPIKE_UTIL:.0%} for {settings.fault_s:g} s; throttle reached level {top}",
                   (engaged and top == 3, "the throttle did not reach level 3"),
                   (released, "the throttle did not release"))


def slow_chunks(settings: ChaosSettings, expected: dict[str, list[int]],
                requests: Sequence[WorkloadRequest]) -> ScenarioResult:
    """Prefill steps delayed past the chunk timeout: layer 4 fails them; the client retries."""
    base_ms = 100.0
    engine = chaos_engine(chunk_timeout_base_ms=base_ms)
    delay_s = 3 * base_ms / 1000
    slow_until = time.monotonic() + settings.fault_s
    forward = engine.runner.run
    fault = threading.Event()
    fault.set()

    def slow_forward(batch: Batch) -> ModelRunnerOutput:
        if fault.is_set() and batch.prefills:
            time.sleep(delay_s)
        return forward(batch)

    engine.runner.run = slow_forward
    harness = _Harness(engine, requests)
    # The fault lasts until a chunk has timed out: an event, never missed on a loaded machine.
    harness.run_until(lambda: time.monotonic() >= slow_until and bool(harness.failed),
                      slow_until + settings.bound_s)
    fault.clear()
    fault_end = time.monotonic()
    harness.retry_failed = True
    for rid in list(harness.failed):
        harness.submit(rid)
    recovered = harness.first_tokens_after(fault_end + settings.bound_s)
    harness.run_until(lambda: False, fault_end + settings.bound_s)
    timed_out = len(harness.failed)
    leaked = engine.blocks.num_used
    return _result("slow_chunks", recovered, fault_end, harness.lost(expected), settings,
                   f"{delay_s * 1000:.0f} ms delay on prefill steps for {settings.fault_s:g} s; "
                   f"{timed_out} request(s) timed out and were retried",
                   (timed_out > 0, "no chunk timed out"),
                   (leaked == 0, f"{leaked} KV block(s) still held at the end"))


def locked_database(settings: ChaosSettings, expected: dict[str, list[int]],
                    requests: Sequence[WorkloadRequest]) -> ScenarioResult:
    """Another connection holds an exclusive lock: the engine goes on, the journal catches up."""
    with tempfile.TemporaryDirectory(prefix="tokenflow-chaos-") as tmp:
        path = Path(tmp) / "chaos.db"
        database = open_database(path)
        engine = chaos_engine()
        writer = StoreWriter(database, engine.bus, batch_window_s=0.02)
        lock = sqlite3.connect(path, isolation_level=None, timeout=0)
        try:
            lock.execute("BEGIN EXCLUSIVE")
            harness = _Harness(engine, requests)
            lock_until = time.monotonic() + settings.fault_s
            served = 0

            def lock_over() -> bool:
                nonlocal served
                served += harness.step()
                return time.monotonic() >= lock_until and served > 0

            harness.run_until(lock_over, lock_until + settings.bound_s)
            lock.execute("ROLLBACK")
            fault_end = time.monotonic()
            caught_up = writer.flush(settings.bound_s)
            recovered = time.monotonic() if caught_up else None
            harness.run_until(lambda: False, fault_end + settings.bound_s)
            writer.flush(settings.bound_s)
            with database.session() as session:
                open_ids = {e.request_id for e in unfinished_requests(session)}
        finally:
            lock.close()
            writer.close()
            database.close()
    lost = max(harness.lost(expected), len(open_ids))
    return _result("locked_database", recovered, fault_end, lost, settings,
                   f"database locked for {settings.fault_s:g} s; {served} step(s) produced tokens "
                   f"meanwhile; journal caught up", (served > 0, "the engine stalled on the lock"),
                   (writer.dropped == 0, f"the writer dropped {writer.dropped} event(s)"))


def sigkill(settings: ChaosSettings, expected: dict[str, list[int]],
            requests: Sequence[WorkloadRequest]) -> ScenarioResult:
    """SIGKILL of a journaling engine process mid-chunk, then the same with `--resume`."""
    with tempfile.TemporaryDirectory(prefix="tokenflow-chaos-") as tmp:
        folder = Path(tmp)
        source, output, db = folder / "requests.jsonl", folder / "out.jsonl", folder / "j.db"
        source.write_text("".join(json.dumps({"id": r.request_id,
                                              "prompt_token_ids": list(r.prompt_token_ids),
                                              "max_tokens": r.max_tokens}) + "\n"
                                  for r in requests))
        args = ["--requests", str(source), "--output", str(output), "--db", str(db)]
        deadline = time.monotonic() + settings.bound_s
        # Killed at a step the child holds, chosen by its journal commits: the same on any machine.
        first = _launch([*args, "--report-commits", "--hold"], report=True)
        killed = _kill_when_held(first, lambda prefilling, held: bool(prefilling)
                                 and held["emitted"] > 0, deadline)
        killed_at = time.monotonic()
        before = _lines(output)
        second = _launch([*args, "--resume"])
        served = _wait(second, lambda: len(_lines(output)) > len(before),
                       killed_at + settings.bound_s, kill=False)
        recovered = time.monotonic() if served else None
        try:
            second.wait(max(1.0, killed_at + settings.bound_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            second.kill()
            second.wait()
        lines = _lines(output)
    outputs: dict[str, list[int]] = {}
    duplicates = 0
    for line in lines:
        duplicates += line["id"] in outputs
        outputs[line["id"]] = line["token_ids"]
    lost = sum(1 for r in requests if outputs.get(r.request_id) != expected[r.request_id])
    return _result("sigkill", recovered, killed_at, lost, settings,
                   f"killed mid-chunk after {len(before)} of {len(requests)} finished; "
                   f"resumed run exit code {second.returncode}",
                   (killed, "the run ended before it could be killed"),
                   (duplicates == 0, f"{duplicates} request(s) emitted twice"),
                   (second.returncode == 0, "the resumed run failed"))


def _launch(args: list[str], report: bool = False) -> subprocess.Popen[bytes]:
    # the child, started elsewhere, imports this engine ('' made an absolute path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(os.path.abspath, sys.path)),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "engine.harness.chaos_child", *args],
                            env=env, cwd=Path(args[args.index("--db") + 1]).parent,
                            bufsize=0,
                            stdin=subprocess.PIPE if report else subprocess.DEVNULL,
                            stdout=subprocess.PIPE if report else subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _kill_when_held(process: subprocess.Popen[bytes],
                    wanted: Callable[[set[str], dict[str, Any]], bool], deadline: float) -> bool:
    """Step a held child one step at a time; SIGKILL it at the first held step `wanted` accepts."""
    assert process.stdin is not None and process.stdout is not None
    prefilling: set[str] = set()
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not selector.select(timeout=deadline - time.monotonic()):
                continue
            line = process.stdout.readline()
            if not line:
                process.wait()
                return False
            try:
                report = json.loads(line)
            except ValueError:
                continue
            if "commit" in report:
                prefilling.update(report["commit"]["prefilling"])
                continue
            if "held" not in report:
                continue
            if wanted(prefilling, report["held"]):
                process.send_signal(signal.SIGKILL)
                process.wait()
                return True
            prefilling.clear()
            try:
                process.stdin.write(b"\n")
            except BrokenPipeError:
                continue
    process.kill()
    process.wait()
    return False


def _wait(process: subprocess.Popen[bytes], condition: Callable[[], bool], deadline: float,
          kill: bool = True) -> bool:
    """Poll another process's progress until `condition` (then SIGKILL it if `kill`)."""
    while process.poll() is None and time.monotonic() < deadline:
        if condition():
            if kill:
                process.send_signal(signal.SIGKILL)
                process.wait()
            return True
        time.sleep(POLL_S)
    return not kill and condition()


def query_journal(db: Path, sql: str) -> list[tuple[Any, ...]]:
    if not db.exists():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            return conn.execute(sql).fetchall()
    except sqlite3.OperationalError:
        return []


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # cut short by the kill; that request is resumed
    return rows


Scenario = Callable[[ChaosSettings, dict[str, list[int]], Sequence[WorkloadRequest]],
                    ScenarioResult]
SCENARIOS: dict[str, Scenario] = {
    "sigkill": sigkill,
    "kv_exhaustion": kv_exhaustion,
    "bandwidth_spike": bandwidth_spike,
    "slow_chunks": slow_chunks,
    "locked_database": locked_database,
}


def run_chaos(names: Sequence[str] | None = None, quick: bool = False,
              on_result: Callable[[ScenarioResult], None] | None = None) -> SuiteResult:
    """Run the named scenarios (all by default), each reported to `on_result` as it ends."""
    names = list(names or SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ChaosError(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    settings = QUICK if quick else FULL
    return _run_scenarios(names, settings, on_result)


def _run_scenarios(names: list[str], settings: ChaosSettings,
                   on_result: Callable[[ScenarioResult], None] | None) -> SuiteResult:
    crash_requests = workload(settings.crash_requests, seed=3, prefix="crash")
    requests = workload(settings.requests, seed=7, prefix="chaos")
    wanted = crash_requests + requests if "sigkill" in names else requests
    expected = expected_outputs(wanted)
    results = []
    for name in names:
        result = SCENARIOS[name](settings, expected,
                                 crash_requests if name == "sigkill" else requests)
        if on_result is not None:
            on_result(result)
        results.append(result)
    return SuiteResult(tuple(results))
