"""Drift: noticing that the calibrated step-time predictor no longer matches the device.

Two signals start a recalibration (seed 000 §4): chunks whose measured step time is more than
15% off its prediction (each one logs a warning; `trigger_count` of them within `window_s`
start one), and a fixed interval, an hour by default. `request()` starts one on demand. The
new sweep is compared with the predictor in use over fixed reference shapes
(engine.budget.calibrate.compare); more than 10% apart is a Drift event on the bus, which the
store writer records and the console shows.

A sweep runs the model, which belongs to the engine thread, so the monitor never runs one
itself: it hands a job to `schedule` (EngineLoop.call fits), and the job runs one unit of
the sweep (a warm-up or a single timed step) and schedules itself again, so the loop keeps
serving between units. The interval is checked as events arrive: an idle engine, which
has nothing to mispredict, does not recalibrate.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from engine.budget.calibrate import (
    Calibration,
    CalibrationResult,
    Progress,
    SweepPlan,
    apply,
    compare,
    plan_for,
)
from engine.budget.predictor import StepTimePredictor
from engine.config import ConfigError
from engine.core.engine import Engine
from engine.events import ChunkComplete, Drift, Event

log = logging.getLogger(__name__)

CHUNK_TOLERANCE = 0.15  # a chunk this far off its prediction is a warning (seed 000 §4)
DRIFT_THRESHOLD = 0.10  # a recalibration this far off the stored one is a drift event
DEFAULT_INTERVAL_S = 3600.0
DEFAULT_TRIGGER_COUNT = 20  # off-prediction chunks within the window that start a sweep
DEFAULT_WINDOW_S = 60.0

Job = Callable[[Engine], object]


def drift_event(reference: StepTimePredictor, result: CalibrationResult,
                threshold: float = DRIFT_THRESHOLD) -> Drift | None:
    """A Drift event if `result` predicts step times more than `threshold` off `reference`."""
    deviation = compare(reference, result.predictor)
    if abs(deviation) <= threshold:
        return None
    return Drift(deviation=deviation, detail=(
        f"step times {deviation:+.0%} against the stored calibration over the reference "
        f"shapes ({result.model} on {result.device}, {len(result.points)} shapes timed, "
        f"held-out error {result.heldout_median_abs_error:.1%})"))


class DriftMonitor:
    """Subscribe `observe` to the engine's bus; see the module docstring."""

    def __init__(self, engine: Engine, schedule: Callable[[Job], object], *,
                 reference: StepTimePredictor | None = None, plan: SweepPlan | None = None,
                 quick: bool = True, interval_s: float = DEFAULT_INTERVAL_S,
                 trigger_count: int = DEFAULT_TRIGGER_COUNT,
                 window_s: float = DEFAULT_WINDOW_S, tolerance: float = CHUNK_TOLERANCE,
                 threshold: float = DRIFT_THRESHOLD,
                 on_result: Callable[[CalibrationResult], object] | None = None,
                 progress: Progress | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("interval_s", interval_s), ("window_s", window_s),
                            ("tolerance", tolerance), ("threshold", threshold)):
            if not value > 0:
                raise ConfigError(name, f"must be > 0, got {value}")
        if trigger_count < 1:
            raise ConfigError("trigger_count", f"must be >= 1, got {trigger_count}")
        self.engine = engine
        self.schedule = schedule
        self.reference = reference  # the predictor in use; None until one is calibrated
        self.plan = plan or plan_for(engine.runner.device, quick)
        self.quick = quick
        self.interval_s = interval_s
        self.trigger_count = trigger_count
        self.window_s = window_s
        self.tolerance = tolerance
        self.threshold = threshold
        self.on_result = on_result  # e.g. store the run
        self.progress = progress
        self.clock = clock
        self.off_prediction_total = 0
        self.recalibrations = 0
        self.pending_reason: str | None = None  # a sweep is scheduled or running
        self._off: deque[float] = deque()  # when recent off-prediction chunks completed
        self._last_calibrated = clock()
        self._calibration: Calibration | None = None

    def observe(self, event: Event) -> None:
        """Bus subscriber: count off-prediction chunks, start a sweep when one is due."""
        now = self.clock()
        if isinstance(event, ChunkComplete) and event.predicted_s > 0:
            off = event.duration_s / event.predicted_s - 1
            if abs(off) > self.tolerance:
                self.off_prediction_total += 1
                log.warning("chunk %d of %s took %.1f ms, %+.0f%% off its predicted %.1f ms",
                            event.chunk_index, event.request_id, event.duration_s * 1e3,
                            off * 100, event.predicted_s * 1e3)
                if self.pending_reason is None:
                    self._off.append(now)
        while self._off and self._off[0] < now - self.window_s:
            self._off.popleft()
        if len(self._off) >= self.trigger_count:
            self.request(f"{len(self._off)} chunks more than {self.tolerance:.0%} off their "
                         f"prediction within {self.window_s:.0f} s")
        elif now - self._last_calibrated >= self.interval_s:
            self.request(f"periodic recalibration (every {self.interval_s:.0f} s)")

    def request(self, reason: str = "on demand") -> bool:
        """Schedule a recalibration; False if one is already under way."""
        if self.pending_reason is not None:
            return False
        self.pending_reason = reason
        self._off.clear()
        log.info("recalibrating: %s", reason)
        self.schedule(self._run_unit)
        return True

    def _run_unit(self, engine: Engine) -> None:
        """One unit of the sweep on the engine thread; schedules the next or concludes."""
        if self._calibration is None:
            self._calibration = Calibration(engine, self.plan, quick=self.quick,
                                            progress=self.progress)
        if not self._calibration.advance():
            self.schedule(self._run_unit)
            return
        result, self._calibration = self._calibration.finish(), None
        self._conclude(engine, result)

    def _conclude(self, engine: Engine, result: CalibrationResult) -> None:
        if self.reference is not None:
            event = drift_event(self.reference, result, self.threshold)
            if event is not None:
                log.warning("drift: %s", event.detail)
                engine.bus.publish(event)
        apply(engine, result.predictor)
        self.reference = result.predictor
        self.recalibrations += 1
        self.pending_reason = None
        self._last_calibrated = self.clock()
        if self.on_result is not None:
            self.on_result(result)
