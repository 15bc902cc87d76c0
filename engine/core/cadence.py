"""When a step that holds many decodes may start new prefills (the decode cadence policy)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig


@dataclass(frozen=True)
class DecodeCadence:
    """Hold new prefills off a step that holds at least `min_decodes` decodes until they are
    worth that step: enough prompt tokens waiting to fill its prefill room, or the oldest one
    waiting `max_wait_s`. Every prefill step slows each decode in it; held prompts go in
    together, so most steps stay decode-only (on a CPU, replayed as a CPU graph) and mean TPOT
    falls, paid for in TTFT, at most `max_wait_s`. Prefills already under way are never held,
    and a step that carries one may start more, since its decodes pay for a prefill either
    way. `min_decodes` 0 turns the policy off."""

    min_decodes: int
    max_wait_s: float

    @classmethod
    def of(cls, config: EngineConfig) -> DecodeCadence:
        return cls(config.cadence_min_decodes, config.cadence_max_wait_ms / 1e3)

    def holds(self, decodes: int, prefilling: bool) -> bool:
        """Whether a step with `decodes` decodes (`prefilling`: one prefill under way) holds
        new prefills until `admits` says they are worth it."""
        return bool(self.min_decodes) and decodes >= self.min_decodes and not prefilling

    def admits(self, waiting_tokens: int, room: int, oldest_wait_s: float) -> bool:
        """Whether a holding step may start new prefills: `waiting_tokens` the queued prompts'
        tokens, `room` what the budget leaves after the decodes, `oldest_wait_s` how long the
        queue's head has waited."""
        return waiting_tokens >= room or oldest_wait_s >= self.max_wait_s
