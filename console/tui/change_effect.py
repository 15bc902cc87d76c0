"""A stored change's effect: a figure over the AROUND_S before the change and as long after,
compared only where the two sides saw equal arrivals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from console.tui.history import MetricHistory

AROUND_S = 30.0  # the changes table compares this long before a change with as long after
# Arrival rates this far apart (relative to the higher) make the two sides of a change unequal
# loads; 30 s of Poisson arrivals at a few per second vary by less than this.
ARRIVALS_TOLERANCE = 0.25
IDLE_ARRIVALS = 0.05  # requests/s: below this on both sides, both are idle, hence equal


@dataclass(frozen=True)
class Around:
    """A figure averaged over the AROUND_S before a change and the AROUND_S after it (None
    where the history holds no sample); `running_s`: the seconds of the after half so far,
    while it is still running."""

    before: float | None
    after: float | None
    running_s: float | None = None

    @classmethod
    def of(cls, history: MetricHistory, at: float, name: str) -> Around:
        after = history.mean_between(name, at, at + AROUND_S)
        newest = history.newest_ts
        running = (max(newest - at, 0.0) if newest is not None and newest < at + AROUND_S
                   and after is not None else None)
        return cls(history.mean_between(name, at - AROUND_S, at), after, running)

    def cells(self, unit: Any) -> tuple[str, str]:
        """Both halves in `unit`, "–" where there is no sample; a running half says so as
        "(12s)" (a bare "…" read as a cell cut short)."""
        before = "–" if self.before is None else unit(self.before)
        after = "–" if self.after is None else unit(self.after)
        if self.running_s is not None:
            after += f" ({self.running_s:.0f}s)"
        return before, after


@dataclass(frozen=True)
class Load:
    """The arrival rates (requests/s) over the AROUND_S before a change and after it: a
    change's figures compare only where these are equal within ARRIVALS_TOLERANCE."""

    before: float | None
    after: float | None

    @classmethod
    def around(cls, history: MetricHistory, at: float) -> Load:
        return cls(history.rate_between("arrived", at - AROUND_S, at),
                   history.rate_between("arrived", at, at + AROUND_S))

    @property
    def comparable(self) -> bool | None:
        """Whether the two sides saw equal arrivals; None where a side has no sample."""
        if self.before is None or self.after is None:
            return None
        high = max(self.before, self.after)
        return high < IDLE_ARRIVALS or abs(self.before - self.after) <= ARRIVALS_TOLERANCE * high

    def cell(self, rate_change: bool = False) -> str:
        """The load in a Changes cell; `rate_change`: the change was the arrival rate itself,
        whose two sides differ in load by design."""
        if self.comparable is None:
            return "–"
        if self.comparable and not rate_change:
            return f"equal, {self.before:.2g}/s"
        moved = f"{self.before:.2g}→{self.after:.2g}/s"
        return moved if rate_change else f"{moved} unequal"

    def sentence(self) -> str:
        assert self.before is not None and self.after is not None  # only said when unequal
        return f"arrivals changed ({self.before:.2g}/s → {self.after:.2g}/s): not comparable"

