"""The slow-query watch: requests that overran their plan or broke the operator's SLO,
classed while the logs cover them."""

from __future__ import annotations

import bisect
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import asdict

from engine.batch import QUIET, HostMark
from engine.config import BUDGET_RULE, SLO_ITL_RULE, EngineConfig
from engine.core.request import Request, RequestState
from engine.events import Event, SlowQuery
from engine.ops.gaps import ModeRecord, PrefillGaps, StepRecord, classify_prefill, explain
from engine.ops.timeline import Cause, QueueContext, host_taken
from engine.stats import human_duration

STEP_LOG = 65536
MODE_LOG = 4096
RATE_LOG = 65536  # arrival and finish instants kept for the queue's rates
RATE_WINDOW_S = 10.0  # the shortest window the queue's rates are taken over
# SLO breaches stored as they come up to a burst, then at most this many a second; the rest
# are counted and the next stored one says how many it stands for (budget_score's rule is
# the seed's and stores every one)
SLO_BURST = 120
SLO_RATE_PER_S = 1.0


class SloSampler:
    """A token bucket on the engine's clock: which SLO breaches are stored one by one."""

    def __init__(self, burst: int = SLO_BURST, rate_per_s: float = SLO_RATE_PER_S) -> None:
        self.burst, self.rate_per_s = burst, rate_per_s
        self.tokens = float(burst)
        self.at: float | None = None
        self.unstored = 0  # breaches since the last stored one, carried by the next
        self.unstored_total = 0

    def admit(self, now: float) -> bool:
        if self.at is not None:
            self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate_per_s)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.unstored += 1
        self.unstored_total += 1
        return False

    def take_represented(self) -> int:
        """How many breaches the record being stored stands for: itself and those skipped."""
        represents, self.unstored = 1 + self.unstored, 0
        return represents


class SlowQueryWatch:
    def __init__(self, publish: Callable[[Event], None],
                 sampler: SloSampler | None = None) -> None:
        self.publish = publish
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG)
        self.mode_log: deque[ModeRecord] = deque(maxlen=MODE_LOG)
        self.arrivals: deque[float] = deque(maxlen=RATE_LOG)
        self.finishes: deque[float] = deque(maxlen=RATE_LOG)
        self.flagged: dict[str, tuple[PrefillGaps, tuple[str, ...]]] = {}
        self.sampler = sampler or SloSampler()
        self.sampled_out: set[str] = set()  # live requests whose breach was only counted
        self.held = False

    @property
    def unstored(self) -> int:
        """SLO breaches sampled out so far (each stored one says how many it stands for)."""
        return self.sampler.unstored_total

    def arrived(self, ts: float) -> None:
        self.arrivals.append(ts)

    def hold(self, ts: float, held: bool) -> None:
        self.held = held
        last = self.mode_log[-1] if self.mode_log else ModeRecord(ts, "NORMAL", 0, False)
        self.mode_log.append(last._replace(ts=ts, held=held))

    def mode(self, ts: float, mode: str, throttle_level: int, paused: bool) -> None:
        state = (mode, throttle_level, paused, self.held)
        if not self.mode_log or self.mode_log[-1][1:] != state:
            self.mode_log.append(ModeRecord(ts, *state))

    def step(self, start: float, end: float, step: int, mode: str, throttle_level: int,
             paused: bool, prefills: tuple[str, ...], decodes: int,
             host: HostMark = QUIET, waiting: int = 0) -> None:
        self.step_log.append(StepRecord(start, end, step, mode, throttle_level, paused,
                                        prefills, decodes, host.contended, host.others_cpus,
                                        waiting, host.others_gpu))

    def prefill_ended(self, request: Request, end: float, config: EngineConfig,
                      step_overhead_s: float) -> None:
        """Flag a request whose prefill overran its budget or whose first token came past the
        SLO; keep its decode gaps from now on (every request's, while there is an ITL SLO)."""
        if config.slo_itl_ms:
            request.decode_gaps = array("d")
        rules = config.slo_breaches(end - request.arrival, None)
        budget = request.budgeted_prefill_s
        if (budget and request.prefill_started is not None
                and config.is_slow_query(end - request.prefill_started, budget)):
            rules = (BUDGET_RULE, *rules)
        elif rules and not self.sampler.admit(end):
            self.sampled_out.add(request.id)
            return
        if not rules or request.prefill_started is None:
            return
        request.decode_gaps = array("d")
        self.flagged[request.id] = (self._classify(request, end, step_overhead_s), rules)

    def _classify(self, request: Request, end: float, step_overhead_s: float) -> PrefillGaps:
        steps = []
        for step in reversed(self.step_log):
            steps.append(step)
            if step.start <= request.arrival:
                break
        steps.reverse()
        return classify_prefill(request, steps, list(self.mode_log), end, step_overhead_s,
                                self._queue(request, steps))

    def _queue(self, request: Request, steps: list[StepRecord]) -> QueueContext:
        """Arrivals and finishes a second while it waited (over at least RATE_WINDOW_S, up
        to its admission), and the queue it joined."""
        until = request.admissions[0] if request.admissions else request.arrival
        since = min(request.arrival, until - RATE_WINDOW_S)
        if self.arrivals:  # not before the first arrival: an engine just started is no rate
            since = max(since, min(self.arrivals[0], request.arrival))
        window = max(until - since, 1e-3)

        def count(log: deque[float]) -> int:
            return bisect.bisect_right(log, until) - bisect.bisect_left(log, since)

        i = bisect.bisect_left([s.end for s in steps], request.arrival)
        queued = steps[i].waiting if i < len(steps) else 0
        return QueueContext(arrivals_per_s=count(self.arrivals) / window,
                            finishes_per_s=count(self.finishes) / window,
                            queued_at_arrival=queued, window_s=window)

    def ended(self, request: Request, config: EngineConfig) -> None:
        if request.finish_time is not None:
            self.finishes.append(request.finish_time)
        flagged = self.flagged.pop(request.id, None)
        if request.id in self.sampled_out:
            self.sampled_out.discard(request.id)
            return
        gaps, rules = flagged if flagged is not None else (None, ())
        worst = request.worst_gap[0] if request.worst_gap is not None else None
        if SLO_ITL_RULE not in rules and SLO_ITL_RULE in config.slo_breaches(None, worst):
            if gaps is None:
                end = request.prefill_finished
                if end is None or not self.sampler.admit(request.finish_time or end):
                    return
                gaps = self._classify(request, end, 0.0)
            rules = (*rules, SLO_ITL_RULE)
        if gaps is None:
            return
        timeline = explain(request, gaps, rules, config.slow_query_threshold,
                           self._stall_cause(request))
        verdict = timeline.verdict()
        if request.state is RequestState.FAILED:
            verdict += f"; then failed: {request.reason}"
        represents = 1 if rules == (BUDGET_RULE,) else self.sampler.take_represented()
        if represents > 1:
            verdict += (f"\nsampled: stands for {represents} requests past the SLO, "
                        f"{represents - 1} not stored one by one (more than "
                        f"{SLO_RATE_PER_S:g}/s after a burst of {SLO_BURST})")
        score = timeline.budget_score
        felt, felt_share = timeline.felt_cause()
        self.publish(SlowQuery(
            request_id=request.id, tenant=request.tenant, budget_score=score,
            prompt_tokens=request.num_prompt_tokens, prefill_s=timeline.prefill_s,
            budgeted_s=timeline.budgeted_s, chunks=tuple(asdict(c) for c in timeline.chunks),
            config=config.live_values(), tag=request.tag,
            timeline={k: v for k, v in timeline.to_dict().items() if k != "chunks"},
            cause=timeline.cause.value, cause_share=timeline.cause_share, verdict=verdict,
            cached_tokens=request.cached_tokens, resumed_tokens=request.resumed_tokens,
            rules=rules, represents=represents, felt_part=timeline.felt()[0].replace(" ", "_"),
            felt_cause=felt.value, felt_share=felt_share))

    def _stall_cause(self, request: Request) -> tuple[Cause, str] | None:
        """Why its longest gap between tokens was long: a pause, a busy host, or what shared
        the step that ended it."""
        if request.worst_gap is None:
            return None
        gap, number = request.worst_gap
        step = next((s for s in reversed(self.step_log) if s.step == number), None)
        if step is None:
            return None
        start = step.end - gap
        i = bisect.bisect_right([m.ts for m in self.mode_log], start) - 1
        held = any(m.held for m in list(self.mode_log)[max(i, 0):] if m.ts < step.end)
        if held:
            return Cause.PAUSED, "the operator paused the engine"
        if step.contended:
            took, theirs = host_taken(step.others_cpus, step.others_gpu)
            return Cause.HOST_BUSY, f"{took} ({theirs})"
        took = human_duration(step.end - step.start)
        if step.prefills:
            return Cause.DECODE_STALL, (f"{len(step.prefills)} prefill chunk"
                                        f"{'s' if len(step.prefills) > 1 else ''} shared its "
                                        f"step of {took}")
        return Cause.DECODE_STALL, f"its step took {took}"

    def clear(self) -> None:
        """An engine restart: the requests it flagged are resumed afresh."""
        self.flagged.clear()
        self.sampled_out.clear()
