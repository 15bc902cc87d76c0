"""The token budget a step spends and the price plans put on a step, learnt from step timings."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

from engine.batch import StepShape, StepTiming
from engine.budget.auto import CStar, auto_token_budget
from engine.budget.cost_model import BudgetModel
from engine.budget.predictor import StepTimeRatio
from engine.config import EngineConfig

MAX_STEP_SCALE = 2.0
OVERHEAD_STEPS = 64


class BudgetController:
    """C* and the auto budget, the step-time ratio and the per-step host overhead."""

    def __init__(self, predict: Callable[[StepShape], float], model: BudgetModel) -> None:
        self.predict = predict
        self.model = model
        self.calibrated = False
        self.cstar = CStar()
        self.step_ratio = StepTimeRatio()
        self.step_scale = 1.0
        self.auto_budget: int | None = None
        self.overheads: deque[float] = deque(maxlen=OVERHEAD_STEPS)
        self._busy_until: float | None = None

    def calibrate(self, predict: Callable[[StepShape], float], model: BudgetModel) -> None:
        """Price steps with a calibrated predictor from the next step on."""
        self.predict, self.model, self.calibrated = predict, model, True
        self.step_ratio.reset()
        self.step_scale = 1.0

    def price_with(self, predict: Callable[[StepShape], float]) -> None:
        self.predict = predict

    def forget_steps(self) -> None:
        """An engine restart: the gap since the last step is no host overhead."""
        self._busy_until = None

    def token_budget(self, config: EngineConfig) -> int:
        if config.auto_budget and self.auto_budget is not None:
            return self.auto_budget
        return config.max_num_batched_tokens

    def before_step(self, now: float, decode_load: Callable[[], tuple[int, int]],
                    config: EngineConfig, max_model_len: int) -> None:
        """Smooth C* over the decode load (decodes, their mean context) and, under
        auto_budget, set this step's budget; uncalibrated, the load is never read."""
        if not self.calibrated:
            return
        decodes, context = decode_load()
        chunk = self.cstar.observe(now, decodes, context, self.model, config.chunk_tile,
                                   config.max_num_batched_tokens)
        if config.auto_budget:
            self.auto_budget = auto_token_budget(config, chunk, self.predict, decodes, context,
                                                 max_model_len)

    def recommended_chunk(self, now: float, decodes: int, context: int,
                          config: EngineConfig) -> int | None:
        """C* as the snapshot shows it; before a first step, from the load now."""
        if not self.calibrated:
            return None
        return self.cstar.value or self.cstar.observe(
            now, decodes, context, self.model, config.chunk_tile, config.max_num_batched_tokens)

    def after_step(self, timing: StepTiming, scheduled_at: float, prefills: bool,
                   work_left: bool) -> None:
        """Learn a step's host overhead and, for planned prefills, its error against prediction;
        a contended step (other processes took the CPUs) teaches neither."""
        start = timing.end - timing.duration_s
        since = scheduled_at if self._busy_until is None else self._busy_until
        if not timing.contended:
            self.overheads.append(max(0.0, start - since))
        self._busy_until = timing.end if work_left else None
        if self.calibrated and prefills and not timing.contended:
            self.step_ratio.observe(timing.end, timing.duration_s, timing.predicted_s)
            self.step_scale = min(max(self.step_ratio.value, 1 / MAX_STEP_SCALE), MAX_STEP_SCALE)

    def paused(self) -> None:
        """The operator paused stepping: the time until the next step is no host overhead."""
        self._busy_until = None

    @property
    def step_overhead_s(self) -> float:
        """The median recent overhead, taken when a plan reads it rather than every step."""
        return statistics.median(self.overheads) if self.overheads else 0.0

    def plan_price(self) -> Callable[[StepShape], float]:
        """A step's price in a plan: predicted, scaled as steps ran lately, plus host overhead."""
        predict, scale, overhead = self.predict, self.step_scale, self.step_overhead_s
        return lambda shape: predict(shape) * scale + overhead
