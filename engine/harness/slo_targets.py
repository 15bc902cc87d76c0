"""The SLO targets as multiples of one decode step (engine.harness.slo says why those). Apart
from the probes that measure them, so the console reads them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from engine.stats import ms

TPOT_MULTIPLE = 5.0
DELAY_MULTIPLE = 25.0


@dataclass(frozen=True)
class SLO:
    decode_step_s: float  # one decode-only step at the reference batch and context
    tpot_s: float
    delay_s: float

    @classmethod
    def from_decode_step(cls, decode_step_s: float) -> SLO:
        return cls(decode_step_s, TPOT_MULTIPLE * decode_step_s, DELAY_MULTIPLE * decode_step_s)

    def ttft_s(self, prefill_s: float) -> float:
        """A request's TTFT SLO, from its own prefill time alone."""
        return prefill_s + self.delay_s

    def to_dict(self) -> dict[str, float]:
        return {"decode_step_ms": ms(self.decode_step_s), "tpot_ms": ms(self.tpot_s),
                "scheduling_delay_ms": ms(self.delay_s)}
