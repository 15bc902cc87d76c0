"""The scheduler's modes: KV cache pressure with hysteresis and the bandwidth throttle levels."""

from __future__ import annotations

from collections.abc import Callable

from engine.batch import SchedulerMode
from engine.config import EngineConfig
from engine.core.equipment import BandwidthReading, BandwidthSource
from engine.events import Event, ModeChanged

# throttle level -> chunk concurrency cap (level 3 also pauses new prefills)
THROTTLE_CONCURRENCY = {0: None, 1: 2, 2: 1, 3: 1}


def throttle_off_reason(reading: BandwidthReading, live: int, prefills: int) -> str:
    """Why the bandwidth throttle may not act now, or "" when it may: it acts only on a
    measured figure, and only where holding prefills back leaves the decodes their batch (a
    lone request, or decodes alone, are memory-bound by nature: a cap cannot help them)."""
    if not reading.measured:
        return ("throttle off: the bandwidth figure is modelled, not measured (on a GPU, "
                "NVML measures it)")
    if live <= 1:
        return "throttle off: one request is running; limiting concurrency cannot help it"
    if prefills == 0:
        return "throttle off: decodes alone; limiting prefill concurrency cannot help them"
    return ""


class Modes:
    """NORMAL, CACHE_PRESSURE_WAIT or BANDWIDTH_THROTTLE, re-read before every step."""

    def __init__(self, bandwidth: BandwidthSource, publish: Callable[[Event], None],
                 clock: Callable[[], float]) -> None:
        self.bandwidth = bandwidth
        self.publish = publish
        self.clock = clock
        self.mode = SchedulerMode.NORMAL
        self.throttle_level = 0
        self.cache_pressure = False
        self.bandwidth_util = 0.0
        self.throttle_note = ""  # why the throttle may not act, when it may not
        self._above_pause_since: float | None = None

    def update(self, cfg: EngineConfig, usage: float, live: int = 0, prefills: int = 0) -> None:
        """`live`: requests running or waiting; `prefills`: those with prompt left."""
        if self.cache_pressure and usage < cfg.cache_low_watermark:
            self.cache_pressure = False
        elif not self.cache_pressure and usage >= cfg.cache_high_watermark:
            self.cache_pressure = True
        now = self.clock()
        reading = self.bandwidth.reading()
        util = reading.util_5s
        self.bandwidth_util = util
        self.throttle_note = throttle_off_reason(reading, live, prefills)
        if not reading.measured:
            util = 0.0  # a modelled figure is no reading at all
        # how long the bandwidth has stayed high is a fact of the reading, kept while a lone
        # request or decodes alone hold the throttle off, so a spike that outlasts them acts
        if util > cfg.bandwidth_pause:
            self._above_pause_since = self._above_pause_since or now
        else:
            self._above_pause_since = None
        level = 0
        if not self.throttle_note:  # else no level: a cap cannot help
            if self._above_pause_since is not None and now - self._above_pause_since >= \
                    cfg.bandwidth_pause_s:
                level = 3
            elif util > cfg.bandwidth_throttle_1:
                level = 2
            elif util > cfg.bandwidth_throttle_2:
                level = 1
        if self.cache_pressure:
            mode = SchedulerMode.CACHE_PRESSURE_WAIT
        elif level:
            mode = SchedulerMode.BANDWIDTH_THROTTLE
        else:
            mode = SchedulerMode.NORMAL
        if mode is not self.mode or level != self.throttle_level:
            reason = (f"kv usage {usage:.2f}, bandwidth 5s avg {util:.2f}, "
                      f"throttle level {level}")
            self.publish(ModeChanged(old=self.mode.value, new=mode.value, reason=reason))
            self.mode, self.throttle_level = mode, level
