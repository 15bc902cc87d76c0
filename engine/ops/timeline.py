"""A request's timeline: where its time went, and why a slow query was slow."""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.stats import human_duration, quantile

if TYPE_CHECKING:
    from engine.core.request import Request


class Cause(enum.StrEnum):
    """What a slow query's overrun is attributed to (stored on the slow-query record)."""

    QUEUED = "queued"
    SLOW_CHUNKS = "slow_chunks"
    CACHE_PRESSURE = "cache_pressure"
    BANDWIDTH_THROTTLE = "bandwidth_throttle"
    PREEMPTION = "preemption"
    GUARD = "guard"
    HOST_OVERHEAD = "host_overhead"
    HOST_BUSY = "host_busy"  # other processes took the CPUs (a contended step)
    PAUSED = "paused"  # the operator paused the engine
    DECODE_STALL = "decode_stall"  # a long step between two of its tokens


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


class ModeRecord(NamedTuple):
    """The scheduler's state from `ts` on (logged when it changes)."""

    ts: float
    mode: str
    throttle_level: int
    paused: bool  # a guard held prefills back (the degraded path)
    held: bool = False  # the operator paused the engine: no steps ran


@dataclass(frozen=True)
class QueueContext:
    """The queue while a request waited: arrivals and finishes a second, its length."""

    arrivals_per_s: float
    finishes_per_s: float
    queued_at_arrival: int
    window_s: float

    def words(self) -> str:
        """Its rates and length; arrivals outrunning finishes first, when they did."""
        if self.overloaded:
            return (f"arrivals outran finishes, {self.arrivals_per_s:.1f} arrivals/s against "
                    f"{self.finishes_per_s:.1f} finishes/s, {self.queued_at_arrival} queued "
                    "when it arrived")
        return (f"the {self.queued_at_arrival} queued when it arrived drained at "
                f"{self.finishes_per_s:.1f} finishes/s against {self.arrivals_per_s:.1f} "
                "arrivals/s")

    @property
    def overloaded(self) -> bool:
        return self.arrivals_per_s > self.finishes_per_s


@dataclass(frozen=True)
class GapStats:
    """Decode gaps (time between consecutive tokens after the first), summarised."""

    count: int = 0
    p50_s: float | None = None
    p99_s: float | None = None
    max_s: float | None = None
    worst_step: int | None = None


@dataclass(frozen=True)
class Preemption:
    at_s: float
    readmitted_s: float | None


@dataclass(frozen=True)
class ChunkView:
    index: int
    start: int
    tokens: int
    at_s: float
    duration_s: float
    predicted_s: float
    planned_s: float | None
    step: int
    decodes: int
    other_prefill_tokens: int
    mode: str
    throttle_level: int
    recomputed: bool
    contended: bool = False  # other processes took the host's CPUs around its step


@dataclass(frozen=True)
class Timeline:
    """Where a slow query's time went, in seconds; instants count from arrival."""

    admitted_s: float | None
    queue_wait_s: float | None
    prefill_s: float
    budgeted_s: float
    overrun_s: float
    first_token_s: float | None
    e2e_s: float | None
    outcome: str
    prefill_parts: dict[str, float]
    e2e_parts: dict[str, float]
    overrun_by_cause: dict[str, float]
    cause: Cause
    cause_share: float
    queued_behind: int
    throttle_level_max: int
    chunk_throttle_level: int
    chunk_ratio: float | None
    chunks: tuple[ChunkView, ...]
    preemptions: tuple[Preemption, ...]
    decode_gaps: GapStats
    queue_wait_parts: dict[str, float] = field(default_factory=dict)
    waited_behind: int = 0
    rules: tuple[str, ...] = ()  # which rules stored it: budget_score, ttft_slo, itl_slo
    threshold: float | None = None  # the budget_score threshold in force
    queue: QueueContext | None = None
    host_cpus: float = 0.0  # the most CPUs other processes took while it was live
    stall_cause: str | None = None  # why its worst gap between tokens was long, in words
    stall_class: Cause = Cause.DECODE_STALL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def felt(self) -> tuple[str, float]:
        """The largest part of what the user felt: queue wait, prefill or worst token stall."""
        gaps = self.decode_gaps
        stall = (gaps.max_s - gaps.p50_s if gaps.max_s is not None and gaps.p50_s is not None
                 else 0.0)
        parts = {"queue wait": self.queue_wait_s or 0.0, "prefill": self.prefill_s,
                 "decode stall": stall}
        name = max(parts, key=lambda k: parts[k])
        return name, parts[name]

    @property
    def budget_score(self) -> float | None:
        return self.prefill_s / self.budgeted_s if self.budgeted_s > 0 else None

    def verdict(self) -> str:
        """What the user felt most and its cause; then, second, the budget_score's reading."""
        return f"{self.felt_verdict()}\n{self.budget_verdict()}"

    def felt_cause(self) -> tuple[Cause, float]:
        """The cause of the largest felt part, with its share of that part."""
        part, seconds = self.felt()
        if part == "decode stall":
            return self.stall_class, 1.0
        if part == "prefill":
            return self.cause, self.cause_share
        cause = self._queue_cause()
        parts = self.queue_wait_parts
        taken = (parts.get(Cause.QUEUED.value, 0.0) + parts.get(Cause.HOST_BUSY.value, 0.0)
                 if cause is Cause.QUEUED else parts.get(cause.value, 0.0))
        return cause, min(1.0, taken / seconds) if seconds > 0 else 0.0

    def _queue_cause(self) -> Cause:
        parts = {k: v for k, v in self.queue_wait_parts.items() if v > 0}
        cause = Cause(max(parts, key=lambda k: parts[k])) if parts else Cause.QUEUED
        if (self.queue is not None and self.queue.overloaded
                and cause in (Cause.QUEUED, Cause.HOST_BUSY)):
            return Cause.QUEUED  # more came than left: it would have grown on a quiet host
        return cause

    def felt_verdict(self) -> str:
        part, seconds = self.felt()
        if part == "queue wait":
            return self.queue_verdict(seconds)
        if part == "decode stall":
            gaps = self.decode_gaps
            cause = f": {self.stall_cause}" if self.stall_cause else ""
            return (f"stalled {human_duration(gaps.max_s)} between two tokens at step "
                    f"{gaps.worst_step} (usually {human_duration(gaps.p50_s)}){cause}")
        return f"prefill took {human_duration(self.prefill_s)}: {self.overrun_verdict()}"

    def budget_verdict(self) -> str:
        """The seed's reading: actual over budgeted prefill time against its threshold."""
        score = self.budget_score
        if score is None:
            return "budget_score unknown: no calibrated plan for its prefill"
        overran = self.overrun_s > OVERRUN_EPSILON_S
        over = (f"{human_duration(self.overrun_s)} over its {human_duration(self.budgeted_s)} "
                f"plan" if overran else f"within its {human_duration(self.budgeted_s)} plan")
        threshold = ("" if self.threshold is None else
                     f" ({'over' if score > self.threshold else 'within'} its threshold "
                     f"{self.threshold:g})")
        why = "" if self.felt()[0] == "prefill" or not overran else f": {self.overrun_verdict()}"
        return (f"budget_score {score:.2f}{threshold}: prefill {human_duration(self.prefill_s)},"
                f" {over}{why}")

    def queue_verdict(self, seconds: float) -> str:
        """Why it waited to be admitted: the queue's rates first, then what held it."""
        waited = f"waited {human_duration(seconds)} in the queue"
        parts = {k: v for k, v in self.queue_wait_parts.items() if v > 0}
        cause = self._queue_cause()
        queue = self.queue
        rates = f"; {queue.words()}" if queue is not None else ""
        host_s = parts.get(Cause.HOST_BUSY.value, 0.0)
        host = (f"other processes took the CPU for {human_duration(host_s)} of it "
                f"({self.host_cpus:.1f} CPUs of their work)") if host_s else ""
        if cause is Cause.PAUSED:
            return (f"{waited}: the operator paused the engine for "
                    f"{human_duration(parts[cause.value])} of it{rates}")
        if queue is not None and cause is Cause.QUEUED:
            return f"{waited}: {queue.words()}" + (f"; {host}" if host else "")
        if cause is Cause.HOST_BUSY:
            return f"{waited}: {host}{rates}"
        behind = (f" behind {self.waited_behind} request"
                  f"{'' if self.waited_behind == 1 else 's'}" if self.waited_behind else "")
        return f"{waited}{behind}: {QUEUE_WAIT_CAUSES[cause]}{rates}"

    def worst_chunk(self) -> ChunkView | None:
        """Its chunk furthest over its own prediction (recomputed ones aside)."""
        chunks = [c for c in self.chunks if not c.recomputed and c.predicted_s > 0]
        return max(chunks, key=lambda c: c.duration_s - c.predicted_s, default=None)

    def chunk_words(self) -> str:
        """Its slowest chunk in words, against its own prediction: what shared its step."""
        chunk = self.worst_chunk()
        if chunk is None:
            return (f"chunks {self.chunk_ratio:.1f}× the plan" if self.chunk_ratio
                    else "chunks slower than predicted")
        ratio = f"{chunk.duration_s / chunk.predicted_s:.1f}× its own prediction"
        if chunk.decodes >= HEAVY_DECODE_SHARE * chunk.tokens:
            return (f"its {chunk.tokens}-token chunk shared a step with {chunk.decodes} "
                    f"decodes ({ratio})")
        return f"its {chunk.tokens}-token chunk took {ratio}"

    def overrun_verdict(self) -> str:
        """Why the prefill overran its plan, with the cause's share of the overrun."""
        took = human_duration(self.overrun_by_cause.get(self.cause.value, 0.0))
        share = f"{self.cause_share:.0%} of the overrun"
        match self.cause:
            case Cause.QUEUED:
                return (f"queued {took} behind {self.queued_behind} other "
                        f"prompt{'s' if self.queued_behind != 1 else ''} ({share})")
            case Cause.SLOW_CHUNKS:
                held = (f" while bandwidth throttle level {self.chunk_throttle_level} held"
                        if self.chunk_throttle_level else "")
                return f"{self.chunk_words()}{held} (+{took}, {share})"
            case Cause.CACHE_PRESSURE:
                return f"waited {took} in CACHE_PRESSURE_WAIT for KV blocks ({share})"
            case Cause.BANDWIDTH_THROTTLE:
                return (f"waited {took} while bandwidth throttle level "
                        f"{self.throttle_level_max} held ({share})")
            case Cause.PREEMPTION:
                redone = sum(c.tokens for c in self.chunks if c.recomputed)
                return (f"preempted {len(self.preemptions)}× to free KV blocks: {took} "
                        f"waiting to be readmitted and recomputing {redone} tokens ({share})")
            case Cause.GUARD:
                return f"prefills held back by a guard for {took} ({share})"
            case Cause.PAUSED:
                return f"the operator paused the engine for {took} ({share})"
            case Cause.HOST_BUSY:
                return (f"other processes took the CPU ({self.host_cpus:.1f} CPUs of their "
                        f"work) while its steps ran: +{took} ({share})")
        return f"host time between steps {took} ({share})"


NORMAL = ModeRecord(0.0, "NORMAL", 0, False)
OVERRUN_EPSILON_S = 1e-6  # below a microsecond, a prefill ran as planned (float sums)
HEAVY_DECODE_SHARE = 4
QUEUE_WAIT_CAUSES = {
    Cause.QUEUED: "arrivals outran the budget",
    Cause.CACHE_PRESSURE: "the KV cache stayed above its high watermark",
    Cause.BANDWIDTH_THROTTLE: "the bandwidth throttle held new prefills",
    Cause.GUARD: "a guard held new prefills back",
    Cause.HOST_OVERHEAD: "the engine sat between steps",
    Cause.HOST_BUSY: "other processes took the CPU",
    Cause.PAUSED: "the operator paused the engine",
    Cause.SLOW_CHUNKS: "the steps ran slower than predicted",
    Cause.PREEMPTION: "it was preempted",
}
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
        stall_cause=None if stall is None else stall[1],
        stall_class=Cause.DECODE_STALL if stall is None else stall[0])


def _parts(parts: dict[str, float], signed: bool = False) -> str:
    shown = [f"{name.replace('_', ' ')} {'+' if signed and v > 0 else ''}{human_duration(v)}"
             for name, v in parts.items() if v]
    return ", ".join(shown) or "none"


def timeline_lines(t: dict[str, Any]) -> list[str]:
    """A stored timeline as the lines the CLI and the console's slow-query detail print."""
    e2e = t["e2e_parts"]
    lines = [f"end to end {human_duration(t['e2e_s'])} = queue wait "
             f"{human_duration(e2e['queue_wait'])} + prefill {human_duration(e2e['prefill'])} "
             f"+ decode {human_duration(e2e['decode'])} + tail {human_duration(e2e['tail'])}"
             f"  ({t['outcome']})"]
    if t.get("rules"):
        lines.append(f"stored by: {', '.join(t['rules'])}")
    queue = t.get("queue")
    if queue:
        lines.append(f"queue: {QueueContext(**queue).words()} "
                     f"(over {human_duration(queue['window_s'])})")
    if t.get("host_cpus"):
        lines.append(f"host: other processes took up to {t['host_cpus']:.1f} CPUs while it "
                     "was live")
    if t.get("queue_wait_parts"):
        lines.append(f"queue wait {human_duration(t['queue_wait_s'])}: "
                     f"{_parts(t['queue_wait_parts'])}; "
                     f"{t.get('waited_behind', 0)} other requests prefilled meanwhile")
    lines.append(f"prefill {human_duration(t['prefill_s'])}: {_parts(t['prefill_parts'])}")
    lines.append(f"overrun {human_duration(t['overrun_s'])} by cause: "
                 f"{_parts(t['overrun_by_cause'], signed=True)}")
    for p in t["preemptions"]:
        again = human_duration(p["readmitted_s"]) if p["readmitted_s"] is not None else "never"
        lines.append(f"preempted at {human_duration(p['at_s'])}, readmitted at {again}")
    gaps = t["decode_gaps"]
    if gaps["count"]:
        lines.append(f"decode gaps: {gaps['count']}, p50 {human_duration(gaps['p50_s'])}, "
                     f"p99 {human_duration(gaps['p99_s'])}, max {human_duration(gaps['max_s'])} "
                     f"at step {gaps['worst_step']}")
    return lines
