"""A slow query's timeline: where its time went, and the verdict, why it was slow, in words
(engine.ops.gaps classes the time and builds it)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.stats import human_duration


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
    host_gpu: float = 0.0  # the largest share of the GPU's SM time they took meanwhile
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
        took, theirs = host_taken(self.host_cpus, self.host_gpu)
        host = f"{took} for {human_duration(host_s)} of it ({theirs})" if host_s else ""
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
                host, theirs = host_taken(self.host_cpus, self.host_gpu)
                return f"{host} ({theirs}) while its steps ran: +{took} ({share})"
        return f"host time between steps {took} ({share})"


def host_taken(cpus: float, gpu: float) -> tuple[str, str]:
    """What other processes took, and how much of their work: "the CPU" in CPUs, and on a GPU
    NVML measured, its share of the SM time."""
    if not gpu:
        return "other processes took the CPU", f"{cpus:.1f} CPUs of their work"
    their = f"{gpu:.0%} of the GPU's SM time"
    if cpus:
        return "other processes took the CPU and GPU", f"{cpus:.1f} CPUs and {their}"
    return "other processes took the GPU", their


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
    if t.get("host_gpu"):
        lines.append(f"host: other processes took up to {t['host_gpu']:.0%} of the GPU's SM "
                     "time while it was live")
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
