"""The slow-query watch: prefills that overran their plan, classed while the logs cover them."""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import asdict

from engine.config import EngineConfig
from engine.core.request import Request, RequestState
from engine.events import Event, SlowQuery
from engine.ops.timeline import ModeRecord, PrefillGaps, StepRecord, classify_prefill, explain

STEP_LOG = 65536
MODE_LOG = 4096


class SlowQueryWatch:
    def __init__(self, publish: Callable[[Event], None]) -> None:
        self.publish = publish
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG)
        self.mode_log: deque[ModeRecord] = deque(maxlen=MODE_LOG)
        self.flagged: dict[str, PrefillGaps] = {}

    def mode(self, ts: float, mode: str, throttle_level: int, paused: bool) -> None:
        if not self.mode_log or self.mode_log[-1][1:] != (mode, throttle_level, paused):
            self.mode_log.append(ModeRecord(ts, mode, throttle_level, paused))

    def step(self, start: float, end: float, step: int, mode: str, throttle_level: int,
             paused: bool, prefills: tuple[str, ...], decodes: int) -> None:
        self.step_log.append(StepRecord(start, end, step, mode, throttle_level, paused,
                                        prefills, decodes))

    def prefill_ended(self, request: Request, end: float, config: EngineConfig,
                      step_overhead_s: float) -> None:
        """Flag a request whose prefill overran its budget; keep its decode gaps from now on."""
        budget = request.budgeted_prefill_s
        if not budget or request.prefill_started is None:
            return
        if not config.is_slow_query(end - request.prefill_started, budget):
            return
        steps = []
        for step in reversed(self.step_log):
            steps.append(step)
            if step.start <= request.arrival:
                break
        steps.reverse()
        request.decode_gaps = array("d")
        self.flagged[request.id] = classify_prefill(request, steps, list(self.mode_log), end,
                                                    step_overhead_s)

    def ended(self, request: Request, config: EngineConfig) -> None:
        gaps = self.flagged.pop(request.id, None)
        if gaps is None:
            return
        timeline = explain(request, gaps)
        verdict = timeline.verdict()
        if request.state is RequestState.FAILED:
            verdict += f"; then failed: {request.reason}"
        self.publish(SlowQuery(
            request_id=request.id, tenant=request.tenant,
            budget_score=timeline.prefill_s / timeline.budgeted_s,
            prompt_tokens=request.num_prompt_tokens, prefill_s=timeline.prefill_s,
            budgeted_s=timeline.budgeted_s, chunks=tuple(asdict(c) for c in timeline.chunks),
            config=config.live_values(), tag=request.tag,
            timeline={k: v for k, v in timeline.to_dict().items() if k != "chunks"},
            cause=timeline.cause.value, cause_share=timeline.cause_share, verdict=verdict,
            cached_tokens=request.cached_tokens, resumed_tokens=request.resumed_tokens))

    def clear(self) -> None:
        """An engine restart: the requests it flagged are resumed afresh."""
        self.flagged.clear()
