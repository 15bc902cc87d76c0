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


def around(history: MetricHistory, at: float, name: str, unit: Any) -> tuple[str, str]:
    """`name` averaged over the AROUND_S before `at` and the AROUND_S after it (over the
    seconds so far, said as "(12s)", while that half is still running); "–" where the
    history holds no sample. A bare "…" read as a cell cut short."""
    def mean(start: float, end: float) -> str:
        value = history.mean_between(name, start, end)
        return "–" if value is None else unit(value)
    after = mean(at, at + AROUND_S)
    newest = history.newest_ts
    if newest is not None and newest < at + AROUND_S and after != "–":
        after += f" ({max(newest - at, 0):.0f}s)"
    return mean(at - AROUND_S, at), after


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

