"""One chunk of a prefill plan (engine.budget.plan), kept on its request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannedChunk:
    start: int
    tokens: int
    predicted_s: float
    wait_s: float = 0.0
    wait_steps: int = 0
    decodes: int = 0
    other_prefill_tokens: int = 0

    @property
    def budget_s(self) -> float:
        return self.wait_s + self.predicted_s
