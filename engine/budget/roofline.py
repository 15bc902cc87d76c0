"""The roofline of one mixed step: compute time against memory time."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from engine.batch import StepShape
from engine.config import ConfigError

_BALANCED_TOLERANCE = 0.02


class StepEstimate(NamedTuple):
    tau_s: float
    compute_s: float
    memory_s: float
    bound: str


@dataclass(frozen=True)
class RooflineRow:
    """One line of the what-if table: a chunk size and what it does to TPOT and TTFT."""

    chunk: int
    tau_ms: float
    bound: str
    tpot_ms: float
    ttft_ms: float
    rounds: int


def step_estimate(compute_s: float, memory_s: float,
                  overhead_s: float = 0.0) -> StepEstimate:
    """The roofline max of the two times; the bound is whichever side sets it."""
    if math.isclose(compute_s, memory_s, rel_tol=_BALANCED_TOLERANCE):
        bound = "balanced"
    else:
        bound = "compute" if compute_s > memory_s else "memory"
    return StepEstimate(max(compute_s, memory_s) + overhead_s, compute_s, memory_s, bound)


@dataclass(frozen=True)
class Roofline:
    """P parameters, F FLOP/s, W bytes/s, k KV bytes per token, weights at `weight_bits`."""

    params: float
    flops: float
    bandwidth: float
    kv_bytes_per_token: float
    weight_bits: int = 16
    sliding_window: int | None = None
    windowed_share: float = 0.0

    def __post_init__(self) -> None:
        for name in ("params", "flops", "bandwidth", "kv_bytes_per_token"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(name, f"must be a positive number, got {value!r}")
        if not 1 <= self.weight_bits <= 32:
            raise ConfigError("weight_bits", f"must be in 1..32, got {self.weight_bits}")
        if not 0 <= self.windowed_share <= 1:
            raise ConfigError("windowed_share", f"must be in [0, 1], got {self.windowed_share}")
        if self.windowed_share and not (self.sliding_window or 0) >= 1:
            raise ConfigError("sliding_window", "windowed layers need a window of at least 1")

    @property
    def machine_balance(self) -> float:
        """R = F/W in FLOP/byte: the roofline's knee."""
        return self.flops / self.bandwidth

    @property
    def weight_bytes(self) -> float:
        """2P bytes at bf16, scaled by weight_bits/16 for quantized weights."""
        return 2 * self.params * self.weight_bits / 16


    def compute_seconds(self, shape: StepShape) -> float:
        return 2 * self.params * shape.num_tokens / self.flops

    def kv_read_tokens(self, context: int) -> float:
        """Cached tokens a sequence reads: all, or at most the window on windowed layers."""
        if not self.windowed_share:
            return context
        assert self.sliding_window is not None
        return ((1 - self.windowed_share) * context
                + self.windowed_share * min(context, self.sliding_window))

    def memory_seconds(self, shape: StepShape) -> float:
        """Weights once plus the KV the step attends to; per-token activations are left out."""
        contexts = [before for _, before in shape.prefill] + list(shape.decode_contexts)
        read = sum(self.kv_read_tokens(context) for context in contexts)
        return (self.weight_bytes + read * self.kv_bytes_per_token) / self.bandwidth


    def step_time(self, chunk: int, decode_seqs: int, context: int) -> StepEstimate:
        shape = StepShape(prefill=((chunk, 0),) if chunk > 0 else (),
                          decode_contexts=(context,) * decode_seqs)
        return step_estimate(self.compute_seconds(shape), self.memory_seconds(shape))

    def balance_chunk(self, decode_seqs: int, context: int) -> float:
        """C* where compute time equals memory time: 2P(C+D)/F = (weights + DSk)/W."""
        kv_bytes = decode_seqs * self.kv_read_tokens(context) * self.kv_bytes_per_token
        return self.machine_balance * (self.weight_bytes + kv_bytes) / (2 * self.params) - (
            decode_seqs
        )

    def rounds(self, prompt: int, chunk: int, hit_rate: float = 0.0) -> int:
        """Prefill steps for a prompt whose `hit_rate` share is cached; at least one."""
        if chunk < 1:
            raise ConfigError("chunk", f"must be >= 1, got {chunk}")
        if not 0 <= hit_rate <= 1:
            raise ConfigError("hit_rate", f"must be in [0, 1], got {hit_rate}")
        return max(1, math.ceil(prompt * (1 - hit_rate) / chunk))

    def ttft(self, prompt: int, chunk: int, decode_seqs: int, context: int,
             hit_rate: float = 0.0) -> float:
        """TTFT ≈ ⌈T(1−h)/C⌉·τ seconds."""
        return self.rounds(prompt, chunk, hit_rate) * self.tpot(chunk, decode_seqs, context)

    def tpot(self, chunk: int, decode_seqs: int, context: int) -> float:
        """TPOT ≈ τ: every decode in the step waits for the whole step."""
        return self.step_time(chunk, decode_seqs, context).tau_s

    def kv_capacity_tokens(self, kv_bytes: float) -> int:
        """S_cap = M_kv / k: the KV entries a pool of `kv_bytes` holds."""
        return int(kv_bytes // self.kv_bytes_per_token)

    def max_concurrency(self, kv_bytes: float, context: int) -> int:
        """B_max = S_cap / S: sequences of length S resident at once, chunking or not."""
        return self.kv_capacity_tokens(kv_bytes) // context

    def preempt_cost_flops(self, context: int) -> float:
        """A RECOMPUTE preemption at length S redoes its prefill: 2P·S FLOPs wasted."""
        return 2 * self.params * context

    def prefill_intensity(self, prompt: int, activation_bytes_per_token: float | None = None,
                          ) -> float:
        """AI = 2PT / (weights + αT); α defaults to k, the KV each prefill token writes."""
        alpha = self.kv_bytes_per_token if activation_bytes_per_token is None else (
            activation_bytes_per_token
        )
        return 2 * self.params * prompt / (self.weight_bytes + alpha * prompt)

    def decode_intensity(self, batch: int, context: int) -> float:
        """AI = 2PB / (weights + BSk), capped by 2P/(Sk) however large the batch."""
        return 2 * self.params * batch / (
            self.weight_bytes + batch * self.kv_read_tokens(context) * self.kv_bytes_per_token
        )

    def table(self, chunks: list[int], prompt: int, decode_seqs: int, context: int,
              hit_rate: float = 0.0) -> list[RooflineRow]:
        rows = []
        for chunk in chunks:
            step = self.step_time(chunk, decode_seqs, context)
            rounds = self.rounds(prompt, chunk, hit_rate)
            rows.append(RooflineRow(chunk=chunk, tau_ms=step.tau_s * 1e3, bound=step.bound,
                                    tpot_ms=step.tau_s * 1e3, ttft_ms=rounds * step.tau_s * 1e3,
                                    rounds=rounds))
        return rows
