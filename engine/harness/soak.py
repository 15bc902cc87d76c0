"""The time-warp soak: a day of traffic through the real engine, store and journal, in minutes."""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.clock import VirtualClock
from engine.core.engine_core import EngineCore, RequestOutput
from engine.harness.driver import drive
from engine.harness.trace import TraceRow, load_trace, sample_trace, shipped_trace
from engine.harness.workload import WorkloadRequest
from engine.store import Database, StoreWriter, open_database, unfinished_requests

HOUR_S = 3600.0
FLUSH_TIMEOUT_S = 300.0  # a day's journal may be a few seconds behind the engine
FINAL_STATES = ("FINISHED", "FAILED", "REJECTED")


@dataclass(frozen=True)
class SoakPlan:
    hours: int = 24
    busy_from: int = 8
    requests_per_hour: int = 60
    length_scale: float = 0.25
    max_prompt_tokens: int = 1024
    max_output_tokens: int = 256
    pause_s: float = 300.0
    budgets: tuple[int, ...] = (256, 512, 1024, 128)
    abort_share: float = 0.02
    seed: int = 0


@dataclass(frozen=True)
class HourRow:
    hour: int
    arrived: int
    finished: int
    generated_tokens: int
    running: int
    waiting: int
    kv_usage: float
    budget: int


@dataclass
class SoakReport:
    simulated_s: float = 0.0
    wall_s: float = 0.0
    steps: int = 0
    requests: int = 0
    states: dict[str, int] = field(default_factory=dict)
    unaccounted: list[str] = field(default_factory=list)
    journal_unfinished: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    hours: list[HourRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.exceptions or self.unaccounted or self.journal_unfinished)


def day_of_trace(plan: SoakPlan, vocab_size: int,
                 rows: Sequence[TraceRow] | None = None) -> list[WorkloadRequest]:
    """Each busy hour, `requests_per_hour` stratified trace rows at their own offsets."""
    rows = list(rows) if rows is not None else load_trace(shipped_trace("conv"))
    rows = [r for r in rows if r.arrival_s < HOUR_S]
    rng = random.Random(plan.seed)
    workload: list[WorkloadRequest] = []
    for hour in range(plan.hours):
        if hour % 24 < plan.busy_from:
            continue
        for row in sample_trace(rows, plan.requests_per_hour, "stratified", rng):
            prompt = min(plan.max_prompt_tokens, max(1, round(row.context_tokens
                                                              * plan.length_scale)))
            output = min(plan.max_output_tokens, max(1, round(row.generated_tokens
                                                              * plan.length_scale)))
            workload.append(WorkloadRequest(
                request_id=f"h{hour:02d}-{len(workload)}", arrival_s=hour * HOUR_S + row.arrival_s,
                prompt_token_ids=tuple(rng.randrange(1, vocab_size) for _ in range(prompt)),
                max_tokens=output, ignore_eos=True))
    return workload


class _Day:
    """The hourly events of the soak, run from drive's step hook and from its idle waits."""

    def __init__(self, engine: EngineCore, clock: VirtualClock, plan: SoakPlan,
                 workload: Sequence[WorkloadRequest], report: SoakReport) -> None:
        self.engine = engine
        self.clock = clock
        self.plan = plan
        self.report = report
        self.start = clock()
        self.next_hour = 1
        self.arrivals = [int(w.arrival_s // HOUR_S) for w in workload]
        self.rng = random.Random(plan.seed + 1)
        self.aborted: set[str] = set()
        self.heard: set[str] = set()
        self.totals = (0, 0)

    def on_step(self) -> None:
        self.report.steps += 1
        if self.clock() - self.start >= self.next_hour * HOUR_S:
            self._hour()

    def sleep(self, seconds: float) -> None:
        """An idle wait of drive's, cut at each hour boundary it crosses."""
        end = self.clock() + seconds
        while self.start + self.next_hour * HOUR_S <= end:
            self.clock.advance_to(self.start + self.next_hour * HOUR_S)
            self._hour()
        self.clock.advance_to(end)

    def on_output(self, output: RequestOutput) -> None:
        rid = output.request_id
        if output.finished:
            self.heard.discard(rid)
        elif rid not in self.heard:
            self.heard.add(rid)
            if self.rng.random() < self.plan.abort_share:
                self.aborted.add(rid)
                self.engine.abort(rid)

    def _hour(self) -> None:
        hour = self.next_hour
        self.next_hour += 1
        budget = self.plan.budgets[hour % len(self.plan.budgets)]
        snapshot = self.engine.snapshot()
        totals = (snapshot.requests_finished_total, snapshot.generation_tokens_total)
        self.report.hours.append(HourRow(
            hour=hour - 1, arrived=self.arrivals.count(hour - 1),
            finished=totals[0] - self.totals[0], generated_tokens=totals[1] - self.totals[1],
            running=snapshot.num_running, waiting=snapshot.num_waiting,
            kv_usage=snapshot.kv_usage, budget=snapshot.token_budget))
        self.totals = totals
        self.engine.hold(True)  # the operator's pause, as a serving loop tells the engine
        self.clock.advance_to(self.clock() + self.plan.pause_s)  # paused: no step runs
        self.engine.hold(False)
        self.engine.update_config("soak", max_num_batched_tokens=budget)
        self.engine.step()  # the idle tick a serving loop makes: modes and guards see time


def time_warp_soak(engine: EngineCore, clock: VirtualClock, plan: SoakPlan,
                   workload: Sequence[WorkloadRequest], *, database: Database | None = None,
                   flush: Callable[[], object] | None = None) -> SoakReport:
    """Drive `workload` through `engine` for `plan.hours` simulated hours, then the journal."""
    report = SoakReport(requests=len(workload))
    day = _Day(engine, clock, plan, workload, report)
    started, wall = clock(), time.perf_counter()
    try:
        result = drive(engine, list(workload), on_output=day.on_output, on_step=day.on_step,
                       sleep=day.sleep)
        day.sleep(max(0.0, started + plan.hours * HOUR_S - clock()))
    except Exception as exc:  # the soak's finding, reported with its traceback
        report.exceptions.append("".join(traceback.format_exception(exc)))
        return report
    finally:
        report.wall_s = time.perf_counter() - wall
        report.simulated_s = clock() - started
    for rid in (w.request_id for w in workload):
        record = result.records.get(rid)
        if record is None or record.state not in FINAL_STATES or not record.reason:
            report.unaccounted.append(rid)
        else:
            report.states[record.state] = report.states.get(record.state, 0) + 1
    report.states["aborted"] = len(day.aborted)
    if database is not None:
        if flush is not None:
            flush()
        with database.session() as session:
            report.journal_unfinished = [e.request_id for e in unfinished_requests(session)]
    return report


def journaled_soak(engine: EngineCore, clock: VirtualClock, plan: SoakPlan,
                   workload: Sequence[WorkloadRequest], store: Path) -> SoakReport:
    """`time_warp_soak` with a store at `store` journaling the engine's bus throughout."""
    database = open_database(store)
    writer = StoreWriter(database, engine.bus, clock=clock)
    try:
        return time_warp_soak(engine, clock, plan, workload, database=database,
                              flush=lambda: writer.flush(timeout=FLUSH_TIMEOUT_S))
    finally:
        writer.close()
        database.close()
