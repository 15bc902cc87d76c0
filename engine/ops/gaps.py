"""Where a prefill's time went: the scheduler's step and mode logs, the gaps between a
request's own chunks classed by them, and the timeline explained from those classes."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from engine.ops.timeline import (
    Cause,
    ChunkView,
    GapStats,
    Preemption,
    QueueContext,
    Timeline,
)
from engine.stats import quantile

if TYPE_CHECKING:
    from engine.core.request import Request


class StepRecord(NamedTuple):
    """One executed step in the scheduler's step log."""

    start: float
    end: float
    step: int
    mode: str
    throttle_level: int
    paused: bool
    prefills: tuple[str, ...]
    decodes: int
    contended: bool = False  # the host's mark: other work took the CPUs around it
    others_cpus: float = 0.0
    waiting: int = 0  # the queue after it was scheduled
    others_gpu: float = 0.0  # other processes' share of the GPU's SM time around it


class ModeRecord(NamedTuple):
    """The scheduler's state from `ts` on (logged when it changes)."""

    ts: float
    mode: str
    throttle_level: int
    paused: bool  # a guard held prefills back (the degraded path)
    held: bool = False  # the operator paused the engine: no steps ran



NORMAL = ModeRecord(0.0, "NORMAL", 0, False)
GAP_CLASSES = {"CACHE_PRESSURE_WAIT": Cause.CACHE_PRESSURE,
               "BANDWIDTH_THROTTLE": Cause.BANDWIDTH_THROTTLE}


def _gap_class(mode: str, paused: bool, in_step: bool, held: bool = False,
               contended: bool = False) -> Cause:
    if held:
        return Cause.PAUSED
    if paused:
        return Cause.GUARD
    cls = GAP_CLASSES.get(mode)
    if cls is not None:
        return cls
    if contended:  # the steps ran, or the engine waited for a CPU, while others held them
        return Cause.HOST_BUSY
    return Cause.QUEUED if in_step else Cause.HOST_OVERHEAD


def _complement(start: float, end: float,
                taken: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """[start, end] minus the (sorted, disjoint) `taken` intervals."""
    gaps, cursor = [], start
    for a, b in sorted(taken):
        a, b = max(a, start), min(b, end)
        if b <= a:
            continue
        if a > cursor:
            gaps.append((cursor, a))
        cursor = max(cursor, b)
    if end > cursor:
        gaps.append((cursor, end))
    return gaps


class _GapClassifier:
    """Classes instants of time by the step log and the mode log."""

    def __init__(self, steps: Sequence[StepRecord], modes: Sequence[ModeRecord],
                 request_id: str) -> None:
        self.steps = steps
        self.step_starts = [s.start for s in steps]
        self.modes = modes
        self.mode_ts = [m.ts for m in modes]
        self.request_id = request_id
        self.totals: dict[Cause, float] = {}
        self.behind: set[str] = set()

    def add(self, start: float, end: float) -> None:
        cursor = start
        i = max(0, bisect.bisect_right(self.step_starts, start) - 1)
        while i < len(self.steps) and self.steps[i].start < end:
            step = self.steps[i]
            i += 1
            if step.end <= cursor:
                continue
            if step.start > cursor:
                self._idle(cursor, step.start, step.contended)
            a, b = max(cursor, step.start), min(end, step.end)
            cls = _gap_class(step.mode, step.paused, in_step=True, contended=step.contended)
            self.totals[cls] = self.totals.get(cls, 0.0) + (b - a)
            if cls in (Cause.QUEUED, Cause.HOST_BUSY):
                self.behind.update(r for r in step.prefills if r != self.request_id)
            cursor = b
        if end > cursor:
            self._idle(cursor, end)

    def _idle(self, start: float, end: float, contended: bool = False) -> None:
        """Time with no step running, classed by the mode in force, split at its changes;
        `contended`: the host reading that covers it (the next step's) was busy."""
        i = bisect.bisect_right(self.mode_ts, start) - 1
        cursor = start
        while cursor < end:
            state = self.modes[i] if i >= 0 else NORMAL
            upto = min(end, self.mode_ts[i + 1]) if i + 1 < len(self.modes) else end
            cls = _gap_class(state.mode, state.paused, in_step=False, held=state.held,
                             contended=contended)
            self.totals[cls] = self.totals.get(cls, 0.0) + max(0.0, upto - cursor)
            cursor = max(cursor, upto)
            i += 1


def gap_stats(gaps: Sequence[float], worst_step: int | None) -> GapStats:
    if not gaps:
        return GapStats()
    ordered = sorted(gaps)
    return GapStats(count=len(ordered), p50_s=quantile(ordered, 0.5),
                    p99_s=quantile(ordered, 0.99), max_s=ordered[-1], worst_step=worst_step)


@dataclass(frozen=True)
class PrefillGaps:
    """A prefill's gaps classed while the step log still covers them (when it is flagged)."""

    totals: dict[str, float]
    queued_behind: int
    throttle_level_max: int
    attempt: int
    end: float
    step_overhead_s: float = 0.0
    queue_wait: dict[str, float] = field(default_factory=dict)
    waited_behind: int = 0
    queue: QueueContext | None = None
    host_cpus: float = 0.0
    host_gpu: float = 0.0


def classify_prefill(request: Request, steps: Sequence[StepRecord],
                     modes: Sequence[ModeRecord], end: float,
                     step_overhead_s: float = 0.0,
                     queue: QueueContext | None = None) -> PrefillGaps:
    """Class the gaps of a request whose prefill has just ended at `end`."""
    t0, t1 = request.prefill_started, end
    if t0 is None:
        raise ValueError(f"request {request.id} was never admitted")
    classifier = _GapClassifier(steps, modes, request.id)
    for a, b in _complement(t0, t1, [*_own(request, t1), *_held(request, t1)]):
        classifier.add(a, b)
    first = bisect.bisect_left(classifier.step_starts, t0)
    levels = [s.throttle_level for s in steps[first:] if s.start < t1]
    levels += [m.throttle_level for m in modes if t0 <= m.ts < t1]
    waiting = _GapClassifier(steps, modes, request.id)
    admitted = request.admissions[0] if request.admissions else t0
    if admitted > request.arrival:
        waiting.add(request.arrival, admitted)
    return PrefillGaps(totals={c.value: v for c, v in classifier.totals.items()},
                       queued_behind=len(classifier.behind),
                       throttle_level_max=max(levels, default=0),
                       attempt=request.num_preemptions, end=t1,
                       step_overhead_s=step_overhead_s,
                       queue_wait={c.value: v for c, v in waiting.totals.items()},
                       waited_behind=len(waiting.behind), queue=queue,
                       host_cpus=max((s.others_cpus for s in steps
                                      if s.contended and s.end > request.arrival), default=0.0),
                       host_gpu=max((s.others_gpu for s in steps
                                     if s.contended and s.end > request.arrival), default=0.0))


def _own(request: Request, t1: float) -> list[tuple[float, float]]:
    return [(c.step_start, c.step_start + c.duration_s) for c in request.chunks
            if c.step_start < t1]


def _preemptions(request: Request) -> list[tuple[float, float | None]]:
    """Each preemption with the admission that followed it (None: not readmitted)."""
    return [(at, next((a for a in request.admissions if a >= at), None))
            for at in request.preempted_at]


def _held(request: Request, t1: float) -> list[tuple[float, float]]:
    """Intervals spent preempted, an open one ending at `t1`."""
    return [(at, t1 if again is None else again) for at, again in _preemptions(request)]


def explain(request: Request, gaps: PrefillGaps, rules: tuple[str, ...] = (),
            threshold: float | None = None,
            stall: tuple[Cause, str] | None = None) -> Timeline:
    """The timeline of a flagged request, once it has ended."""
    t0, t1 = request.prefill_started, gaps.end
    if t0 is None:
        raise ValueError(f"request {request.id} was never admitted")
    arrival = request.arrival
    prefill_chunks = [c for c in request.chunks if c.step_start < t1]
    effective = [c for c in prefill_chunks if c.attempt == gaps.attempt]
    chunk_s = sum(c.duration_s for c in effective)
    recomputed_s = sum(c.duration_s for c in prefill_chunks if c.attempt != gaps.attempt)
    held_s = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in _held(request, t1))
    gap = gaps.totals
    prefill_parts = {"chunks": chunk_s, "recomputed_chunks": recomputed_s, "preempted": held_s,
                     **{cls.value: gap.get(cls.value, 0.0) for cls in
                        (Cause.QUEUED, Cause.CACHE_PRESSURE, Cause.BANDWIDTH_THROTTLE,
                         Cause.GUARD, Cause.HOST_OVERHEAD, Cause.HOST_BUSY, Cause.PAUSED)}}
    planned = request.planned
    planned_steps = sum(p.predicted_s for p in planned)
    overhead = gaps.step_overhead_s
    chunk_overhead = overhead * len(planned)
    wait_overhead = overhead * sum(p.wait_steps for p in planned)
    slow_chunks = chunk_s - (planned_steps - chunk_overhead)
    # a chunk that ran while other processes held the CPUs: its overrun is theirs
    contended = max(0.0, min(slow_chunks, sum(c.duration_s - c.predicted_s
                                              for c in effective if c.contended)))
    # time queued behind others' chunks: past the plan, shared out as it was classed
    queued, busy = gap.get(Cause.QUEUED.value, 0.0), gap.get(Cause.HOST_BUSY.value, 0.0)
    queued_over = queued + busy - (sum(p.wait_s for p in planned) - wait_overhead)
    busy_over = queued_over * busy / (queued + busy) if queued + busy > 0 else 0.0
    by_cause = {
        Cause.SLOW_CHUNKS: slow_chunks - contended,
        Cause.HOST_BUSY: contended + busy_over,
        Cause.QUEUED: queued_over - busy_over,
        Cause.PREEMPTION: recomputed_s + held_s,
        Cause.HOST_OVERHEAD: gap.get(Cause.HOST_OVERHEAD.value, 0.0) - chunk_overhead
        - wait_overhead,
        **{cls: gap.get(cls.value, 0.0) for cls in
           (Cause.CACHE_PRESSURE, Cause.BANDWIDTH_THROTTLE, Cause.GUARD, Cause.PAUSED)},
    }
    cause = max(by_cause, key=lambda c: by_cause[c])
    prefill_s = t1 - t0
    budget = request.budgeted_prefill_s or 0.0
    overrun = prefill_s - budget
    positive = sum(v for v in by_cause.values() if v > 0)
    share = by_cause[cause] / max(overrun, positive) if by_cause[cause] > 0 else 0.0
    plan_by_start = {p.start: p.predicted_s for p in planned}
    preemptions = tuple(Preemption(a - arrival, None if b is None else b - arrival)
                        for a, b in _preemptions(request))
    end, last = request.finish_time, request.last_token_time
    e2e_parts = {"queue_wait": t0 - arrival, "prefill": prefill_s,
                 "decode": sum(request.decode_gaps or ()),
                 "tail": end - last if end is not None and last is not None else 0.0}
    return Timeline(
        admitted_s=t0 - arrival, queue_wait_s=t0 - arrival, prefill_s=prefill_s,
        budgeted_s=budget, overrun_s=overrun,
        first_token_s=None if request.first_token_time is None
        else request.first_token_time - arrival,
        e2e_s=None if end is None else end - arrival,
        outcome=f"{request.state.value}: {request.reason}",
        prefill_parts=prefill_parts, e2e_parts=e2e_parts,
        overrun_by_cause={c.value: v for c, v in by_cause.items()}, cause=cause,
        cause_share=min(1.0, share), queued_behind=gaps.queued_behind,
        throttle_level_max=gaps.throttle_level_max,
        chunk_throttle_level=max((c.throttle_level for c in effective), default=0),
        chunk_ratio=chunk_s / (planned_steps - chunk_overhead)
        if planned_steps > chunk_overhead else None,
        chunks=tuple(ChunkView(
            index=c.index, start=c.start, tokens=c.tokens, at_s=c.step_start - arrival,
            duration_s=c.duration_s, predicted_s=c.predicted_s,
            planned_s=plan_by_start.get(c.start), step=c.step, decodes=c.decodes,
            other_prefill_tokens=c.other_prefill_tokens, mode=c.mode,
            throttle_level=c.throttle_level, recomputed=c.attempt != gaps.attempt,
            contended=c.contended)
            for c in request.chunks),
        preemptions=preemptions,
        decode_gaps=gap_stats(request.decode_gaps or (),
                              None if request.worst_gap is None else request.worst_gap[1]),
        queue_wait_parts=gaps.queue_wait, waited_behind=gaps.waited_behind, rules=rules,
        threshold=threshold, queue=gaps.queue, host_cpus=gaps.host_cpus,
        host_gpu=gaps.host_gpu,
        stall_cause=None if stall is None else stall[1],
        stall_class=Cause.DECODE_STALL if stall is None else stall[0])

