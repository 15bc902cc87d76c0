"""The latency users are promised: a leaf, so the console and the bench harness read it
without torch."""

from __future__ import annotations

from dataclasses import dataclass

from engine.stats import ms

TPOT_MULTIPLE = 5.0
DELAY_MULTIPLE = 25.0
# A chat service's defaults: MLPerf Inference's Llama-2-70B server scenario.
CHAT_TTFT_MS = 2000.0
CHAT_ITL_MS = 200.0


@dataclass(frozen=True)
class ServiceSLO:
    """Latency users are promised: first token within `ttft_ms`, each next within `itl_ms`."""

    ttft_ms: float = CHAT_TTFT_MS
    itl_ms: float = CHAT_ITL_MS

    def __post_init__(self) -> None:
        for name, value in (("ttft_ms", self.ttft_ms), ("itl_ms", self.itl_ms)):
            if not 0 < value < float("inf"):
                raise ValueError(f"the {name.removesuffix('_ms').upper()} SLO must be a "
                                 f"positive number of milliseconds, got {value}")


@dataclass(frozen=True)
class SLO:
    decode_step_s: float
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
