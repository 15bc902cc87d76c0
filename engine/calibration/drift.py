"""Drift: noticing, without thrashing, that the calibrated predictor no longer fits the device."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.budget.predictor import StepTimePredictor
from engine.calibration.calibrate import (
    Calibration,
    CalibrationResult,
    Progress,
    SweepPlan,
    compare,
    plan_for,
)
from engine.config import ConfigError
from engine.core.engine_core import EngineCore
from engine.events import CalibrationProgress, ChunkComplete, Drift, Event

log = logging.getLogger(__name__)

CHUNK_TOLERANCE = 0.15  # a chunk this far off its prediction is logged as a warning
DRIFT_THRESHOLD = 0.10
DEFAULT_INTERVAL_S = 3600.0
LIVE_THRESHOLD = 0.25
DEFAULT_PERSIST_S = 30.0
DEFAULT_MIN_INTERVAL_S = 300.0

Job = Callable[[EngineCore], object]


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
    """Subscribe `observe` to the engine's bus; sweeps run a unit at a time via `schedule`."""

    def __init__(self, engine: EngineCore, schedule: Callable[[Job], object], *,
                 reference: StepTimePredictor | None = None, plan: SweepPlan | None = None,
                 quick: bool = True, interval_s: float = DEFAULT_INTERVAL_S,
                 persist_s: float = DEFAULT_PERSIST_S,
                 min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
                 live_threshold: float = LIVE_THRESHOLD, tolerance: float = CHUNK_TOLERANCE,
                 threshold: float = DRIFT_THRESHOLD,
                 on_result: Callable[[CalibrationResult, str], object] | None = None,
                 progress: Progress | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("interval_s", interval_s), ("persist_s", persist_s),
                            ("live_threshold", live_threshold), ("tolerance", tolerance),
                            ("threshold", threshold)):
            if not value > 0:
                raise ConfigError(name, f"must be > 0, got {value}")
        if min_interval_s < 0:
            raise ConfigError("min_interval_s", f"must be >= 0, got {min_interval_s}")
        self.engine = engine
        self.schedule = schedule
        self.reference = reference
        self.plan = plan or plan_for(engine.runner.device, quick)
        self.quick = quick
        self.interval_s = interval_s
        self.persist_s = persist_s
        self.min_interval_s = min_interval_s
        self.live_threshold = live_threshold
        self.tolerance = tolerance
        self.threshold = threshold
        self.on_result = on_result
        self.progress = progress
        self.clock = clock
        self.off_prediction_total = 0
        self.recalibrations = 0
        self.pending_reason: str | None = None
        # why a due recalibration waits (other processes hold the CPUs), or None
        self.waiting: str | None = None
        self._beyond_since: float | None = None
        self._last_calibrated = clock()
        self._calibration: Calibration | None = None

    def observe(self, event: Event) -> None:
        """Bus subscriber: log off-prediction chunks, start a sweep when one is due."""
        now = self.clock()
        if isinstance(event, ChunkComplete) and event.predicted_s > 0:
            off = event.duration_s / event.predicted_s - 1
            if abs(off) > self.tolerance:
                self.off_prediction_total += 1
                log.warning("chunk %d of %s took %.1f ms, %+.0f%% off its predicted %.1f ms",
                            event.chunk_index, event.request_id, event.duration_s * 1e3,
                            off * 100, event.predicted_s * 1e3)
        if self.pending_reason is not None:
            if self.waiting is not None and not self.engine.host.latest.contended:
                self.waiting = None  # the host is quiet again: the sweep may measure it
                self.schedule(self._run_unit)
            return
        ratio = self.engine.step_ratio
        drift = ratio.value - 1
        # a ratio over less than the persistence time is too young to be believed
        if abs(drift) > self.live_threshold and ratio.span_s >= self.persist_s:
            self._beyond_since = now if self._beyond_since is None else self._beyond_since
        else:
            self._beyond_since = None
        since_last = now - self._last_calibrated
        if (self._beyond_since is not None and now - self._beyond_since >= self.persist_s
                and since_last >= self.min_interval_s):
            self.request(f"steps {drift:+.0%} off the predictor (median over the last "
                         f"{ratio.span_s:.0f} s) for {now - self._beyond_since:.0f} s")
        elif since_last >= self.interval_s:
            self.request(f"periodic recalibration (every {self.interval_s:.0f} s)")

    def request(self, reason: str = "on demand") -> bool:
        """Schedule a recalibration; False if one is already under way."""
        if self.pending_reason is not None:
            return False
        self.pending_reason = reason
        self._beyond_since = None
        log.info("recalibrating: %s", reason)
        self.schedule(self._run_unit)
        return True

    def _run_unit(self, engine: EngineCore) -> None:
        host = engine.host.mark(engine.clock())
        # a sweep now would time the neighbours' load into the predictor (the first one runs:
        # the engine has no plan without it, and a quiet host's sweep replaces it)
        if host.contended and engine.calibrated:
            self._calibration = None
            if self.waiting is None:
                gpu = (f", the GPU {host.others_gpu:.0%} ({host.gpu_others})"
                       if host.others_gpu else "")
                self.waiting = (f"recalibration waits: other processes use "
                                f"{host.others_cpus:.1f} CPUs, steal {host.steal:.0%}{gpu}")
                log.info("%s", self.waiting)
                self._progress(0.0, self.waiting)
            return  # observe() schedules it again once a step finds the host quiet
        if self._calibration is None:
            self._calibration = Calibration(engine, self.plan, quick=self.quick,
                                            progress=self._progress)
        if not self._calibration.advance():
            self.schedule(self._run_unit)
            return
        result, self._calibration = self._calibration.finish(), None
        self._conclude(engine, result)

    def _progress(self, fraction: float, note: str) -> None:
        assert self.pending_reason is not None
        self.engine.bus.publish(CalibrationProgress(fraction=fraction, note=note,
                                                    reason=self.pending_reason))
        if self.progress is not None:
            self.progress(fraction, note)

    def _conclude(self, engine: EngineCore, result: CalibrationResult) -> None:
        reason = self.pending_reason or "on demand"
        first = not engine.calibrated
        if result.contended and not first:  # refused: the host got busy during the sweep
            self.waiting = f"recalibration refused: measured while {result.load_words()}"
            log.info("%s", self.waiting)
            self._progress(0.0, self.waiting)
            return  # still pending: observe() runs it again on a quiet host
        if self.reference is not None:
            event = drift_event(self.reference, result, self.threshold)
            if event is not None:
                log.warning("drift: %s", event.detail)
                engine.bus.publish(event)
        engine.apply_calibration(result.predictor)
        self.reference = result.predictor
        self.recalibrations += 1
        self.pending_reason = None
        self._last_calibrated = self.clock()
        self._progress_done(reason, result)
        if self.on_result is not None:
            self.on_result(result, reason)
        if first and result.contended:  # replaced once a sweep finds the host quiet
            self.request(f"replacing a first calibration measured while "
                         f"{result.load_words()}")

    def _progress_done(self, reason: str, result: CalibrationResult) -> None:
        self.engine.bus.publish(CalibrationProgress(
            fraction=1.0, reason=reason, note=f"applied: held-out step error "
            f"{result.heldout_median_abs_error:.0%}"))
