"""Drive a workload through an engine on the caller's thread and summarise what happened."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from bisect import insort
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.budget.peaks import DevicePeaks
from engine.core.engine_core import EngineCore, RequestOutput
from engine.events import (
    ChunkComplete,
    Event,
    Preempted,
    PrefixCacheLookup,
    SlowQuery,
    StepComplete,
    TokensGenerated,
)
from engine.harness.workload import WorkloadRequest
from engine.stats import ms, percentiles_ms

IDLE_STEP_S = 1e-3  # what an empty pass of the engine loop costs, about


@dataclass
class RequestRecord:
    request_id: str
    tenant: str
    arrival: float
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    state: str = "WAITING"
    reason: str = ""
    first_scheduled: float | None = None
    prompt_token_ids: tuple[int, ...] = ()
    cached_tokens: int = 0

    @property
    def scheduling_delay_s(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    def inter_token_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass
class RunResult:
    records: dict[str, RequestRecord]
    steps: list[StepComplete]
    wall_s: float
    preemptions: int = 0
    slow_queries: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    slow_queries_sampled: int = 0  # SLO breaches stored rows stand for beyond themselves

    @property
    def step_s(self) -> list[float]:
        return [s.duration_s for s in self.steps]

    def utilisation(self, peaks: DevicePeaks) -> dict[str, float | None]:
        """Prefill MFU over prefill steps, decode MBU over decode-only ones, against the peaks."""
        prefill = [s for s in self.steps if s.prefill_tokens]
        decode = [s for s in self.steps if not s.prefill_tokens]

        def ratio(num: float, seconds: float, peak: float) -> float | None:
            return num / seconds / peak if seconds > 0 else None

        return {
            "prefill_mfu": ratio(sum(s.flops for s in prefill),
                                 sum(s.duration_s for s in prefill), peaks.flops),
            "decode_mbu": ratio(sum(s.bytes_moved for s in decode),
                                sum(s.duration_s for s in decode), peaks.bandwidth),
        }

    def _priced(self, prefill: bool | None = None) -> list[tuple[float, float]]:
        """(measured, predicted) seconds of each step with both, optionally of one kind."""
        return [(s.duration_s, s.predicted_s) for s in self.steps
                if s.duration_s > 0 and s.predicted_s > 0
                and (prefill is None or bool(s.prefill_tokens) == prefill)]

    def prediction_errors(self) -> list[float]:
        return [(predicted - measured) / measured for measured, predicted in self._priced()]

    def step_time_ratio(self, prefill: bool | None = None) -> float | None:
        """The median step's measured over predicted time (all, prefill or decode-only steps)."""
        ratios = [measured / predicted for measured, predicted in self._priced(prefill)]
        return statistics.median(ratios) if ratios else None

    def summary(self) -> dict[str, Any]:
        records = list(self.records.values())
        finished = [r for r in records if r.state == "FINISHED"]
        prompt = sum(r.prompt_tokens for r in finished)
        output = sum(len(r.token_ids) for r in finished)
        itl = [gap for r in finished for gap in r.inter_token_s()]
        wall = max(self.wall_s, 1e-9)
        return {
            "requests": len(records),
            "finished": len(finished),
            "failed_or_rejected": len(records) - len(finished),
            "wall_s": self.wall_s,
            "throughput_tok_s": (prompt + output) / wall,
            "output_tok_s": output / wall,
            "ttft_ms": _ms_percentiles([r.ttft_s for r in finished if r.ttft_s is not None]),
            "tpot_ms": _ms_percentiles([r.tpot_s for r in finished if r.tpot_s is not None]),
            "itl_ms": {**_ms_percentiles(itl), "max": ms(max(itl)) if itl else None},
            "step_ms": _ms_percentiles(self.step_s),
            "steps": len(self.step_s),
            "preemptions": self.preemptions,
            "slow_queries": self.slow_queries,
            "slow_queries_sampled": self.slow_queries_sampled,
            "prefill_tokens_computed": (sum(s.prefill_tokens for s in self.steps)
                                        if self.steps else None),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "hit_rate": (self.prefix_cache_hits / self.prefix_cache_queries
                         if self.prefix_cache_queries else None),
        }


def _ms_percentiles(values: list[float]) -> dict[str, float | None]:
    return dataclasses.asdict(percentiles_ms(values))


class Recorder:
    """Subscribes to one engine's events (`KINDS`) and keeps what a run summary needs."""

    KINDS = (TokensGenerated, StepComplete, ChunkComplete, Preempted, SlowQuery,
             PrefixCacheLookup)

    def __init__(self) -> None:
        self.records: dict[str, RequestRecord] = {}
        self.steps: list[StepComplete] = []
        self.preemptions = 0
        self.slow_queries = 0
        self.slow_queries_sampled = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def __call__(self, event: Event) -> None:
        match event:
            case TokensGenerated():
                records, ts = self.records, event.ts
                for request_id in event.request_ids:
                    record = records.get(request_id)
                    if record is not None:
                        record.token_times.append(ts)
            case StepComplete():
                self.steps.append(event)
            case ChunkComplete(chunk_index=0):
                record = self.records.get(event.request_id)
                if record is not None and record.first_scheduled is None:
                    record.first_scheduled = event.ts - event.duration_s
            case Preempted():
                self.preemptions += 1
            case SlowQuery():
                self.slow_queries += 1
                self.slow_queries_sampled += event.represents - 1
            case PrefixCacheLookup():
                self.prefix_cache_queries += event.queried_tokens
                self.prefix_cache_hits += event.cached_tokens
                record = self.records.get(event.request_id)
                if record is not None:
                    record.cached_tokens = event.cached_tokens

    def expect(self, item: WorkloadRequest, arrival: float) -> None:
        """A request about to be added, arriving at `arrival` on the engine's clock."""
        self.records[item.request_id] = RequestRecord(
            item.request_id, item.tenant, arrival, len(item.prompt_token_ids),
            prompt_token_ids=item.prompt_token_ids)

    def settle(self, output: RequestOutput) -> None:
        record = self.records.get(output.request_id)
        if record is None:
            return
        record.token_ids += output.new_token_ids
        record.state = output.state
        if output.finished:
            record.reason = output.finish_reason or ""

    def result(self, wall_s: float) -> RunResult:
        return RunResult(self.records, self.steps, wall_s, self.preemptions, self.slow_queries,
                         self.prefix_cache_queries, self.prefix_cache_hits,
                         self.slow_queries_sampled)


class OutputTokens:
    """Each live request's output tokens so far; a resumed one starts from those it came with."""

    def __init__(self, resumed: Mapping[str, Sequence[int]] | None = None) -> None:
        self._held = {rid: list(tokens) for rid, tokens in (resumed or {}).items()}

    def add(self, output: RequestOutput) -> list[int]:
        """The request's tokens so far, this output's included; forgotten once it ends."""
        rid = output.request_id
        held = self._held.setdefault(rid, [])
        held += output.new_token_ids
        if output.finished:
            del self._held[rid]
        return held


def add(engine: EngineCore, item: WorkloadRequest, arrival: float) -> None:
    """Add a workload request to `engine` as arriving at `arrival`."""
    engine.add_request(item.prompt_token_ids, item.sampling_params(), tenant=item.tenant,
                       priority=item.priority, request_id=item.request_id, tag=item.tag,
                       arrival=arrival)


def drive(engine: EngineCore, workload: list[WorkloadRequest], *,
          on_output: Callable[[RequestOutput], None] | None = None,
          on_step: Callable[[], None] | None = None,
          sleep: Callable[[float], None] = time.sleep) -> RunResult:
    """Serve `workload` as its arrivals come; `on_step` runs after each step's outputs."""
    recorder = Recorder()
    unsubscribe = engine.bus.subscribe(recorder, Recorder.KINDS)
    ids = {w.request_id for w in workload}
    # follow-ups wait for their turn (unless it is not in the workload)
    followers = {w.follows: w for w in workload if w.follows in ids}
    pending = sorted((w for w in workload if w.follows not in ids), key=_arrival)
    start = engine.clock()
    try:
        while pending or followers or engine.has_unfinished():
            now = engine.clock()
            while pending and start + pending[0].arrival_s <= now:
                item = pending.pop(0)
                recorder.expect(item, start + item.arrival_s)
                add(engine, item, start + item.arrival_s)
            if engine.has_unfinished():
                before = engine.clock()
                for output in engine.step():
                    record = recorder.records.get(output.request_id)
                    recorder.settle(output)
                    if on_output is not None:
                        on_output(output)
                    if output.finished and output.request_id in followers and record:
                        follower = followers.pop(output.request_id)
                        insort(pending, _next_turn(follower, record, engine.clock() - start),
                               key=_arrival)
                if engine.clock() == before:
                    idle(sleep)
                if on_step is not None:
                    on_step()
            elif pending:
                sleep(max(0.0, start + pending[0].arrival_s - engine.clock()))
            elif followers:  # never hang: a turn whose predecessor left no output goes now
                pending = sorted(followers.values(), key=_arrival)
                followers.clear()
    finally:
        unsubscribe()
    return recorder.result(engine.clock() - start)


def _arrival(item: WorkloadRequest) -> float:
    return item.arrival_s


def _next_turn(item: WorkloadRequest, previous: RequestRecord, ended: float) -> WorkloadRequest:
    """A follow-up turn sent think_s after `previous` ended, with its real history."""
    prompt = item.prompt_token_ids
    if previous.state == "FINISHED":
        prompt = (previous.prompt_token_ids + tuple(previous.token_ids)
                  + prompt[item.history_tokens:])
    return dataclasses.replace(item, arrival_s=ended + item.think_s, prompt_token_ids=prompt)


def idle(sleep: Callable[[float], None]) -> None:
    """A step that ran nothing: let a simulated clock pass as a real loop's next iteration would."""
    sleep(IDLE_STEP_S)
