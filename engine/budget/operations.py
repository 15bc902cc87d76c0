"""A step priced per operation and summed, as the kernels run: one after another."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from engine.batch import StepShape
from engine.budget.cost_model import BudgetModel, OperationCounts
from engine.budget.peaks import DevicePeaks
from engine.budget.predictor import nonnegative_relative_lstsq
from engine.config import ConfigError

OPERATIONS = ("gemm", "attention_prefill", "attention_decode", "elementwise", "sampler",
              "communication", "step")
MAX_SHARE = 20.0
# a fixed cost past a second, or a half-efficiency length past a million tokens, is a typo:
# no device's step, launch or all-reduce takes that long, and no model runs that context
MAX_FIXED_S = 1.0
MAX_HALF_TOKENS = 1 << 20
LOGIT_BYTES = 4


@dataclass(frozen=True)
class OperationEfficiency:
    """The share of a datasheet peak each operation sustains, and the fixed costs."""

    gemm_flops: float = 0.7
    attention_flops: float = 0.5
    memory: float = 0.8
    elementwise: float = 0.5
    overlap: float = 0.0
    gemm_flops_8bit: float = 0.6
    weight_only_memory: float = 0.6
    step_s: float = 0.0
    layer_s: float = 0.0
    chunk_s: float = 0.0
    sequence_s: float = 0.0
    allreduce_s: float = 15e-6
    # a GEMM of M rows runs at its share times M / (M + gemm_m_half): tiles and waves a small
    # M leaves idle (0: every M at the full share)
    gemm_m_half: float = 0.0
    # prefill attention over keys reaching L tokens runs at its share times L / (L + this): a
    # short sequence leaves the kernel's tiles and waves idle (0: every length at the share)
    attention_context_half: float = 0.0
    # decode attention's share of the same peak: paged decode kernels gather a few rows per
    # sequence and may run off the tensor cores (0: the prefill's `attention_flops`)
    decode_attention_flops: float = 0.0
    # costs each GPU beyond the first adds: a step's (broadcasting its inputs to the workers,
    # their launches in lock step) and an all-reduce call's (a longer ring)
    tp_step_s: float = 0.0
    tp_allreduce_s: float = 0.0
    # a serving front end's time per request (HTTP, chat template, tokenising), one after
    # another: what a client sending every request at once waits beyond the engine
    request_s: float = 0.0
    # passes over a sampled row's float32 logits (casts, temperature, top-k/top-p filters,
    # softmax, the draw): 1 is a single read
    sampler_passes: float = 1.0
    # the clock a compute-bound tensor-core operation (a GEMM or prefill attention whose math
    # outlasts its reads) runs at, as a share of the clock of one that is not: the first fills
    # every SM and draws the board's power limit, which pulls the clock down (1: no limit)
    saturated_clock: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            may_be_zero, limit, rule = _range(f.name)
            if not (isinstance(value, int | float) and math.isfinite(value)
                    and (value >= 0 if may_be_zero else value > 0) and value <= limit):
                raise ConfigError(f"efficiency.{f.name}", f"must be {rule}, got {value!r}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OperationEfficiency:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError("efficiency", f"unknown field(s) {', '.join(sorted(unknown))}; "
                              f"known: {', '.join(sorted(known))}")
        numbers = {k: v for k, v in data.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        if bad := sorted(set(data) - set(numbers)):
            raise ConfigError("efficiency", f"{bad[0]} must be a number, got "
                              f"{data[bad[0]]!r:.40}")
        return cls(**{k: float(v) for k, v in numbers.items()})


def _range(name: str) -> tuple[bool, float, str]:
    """An efficiency factor's range: whether it may be 0, its largest value, and in words."""
    if name.endswith("_s"):
        return True, MAX_FIXED_S, f"a time in seconds in [0, {MAX_FIXED_S:g}]"
    if name in ("gemm_m_half", "attention_context_half"):
        return True, MAX_HALF_TOKENS, f"a number of tokens in [0, {MAX_HALF_TOKENS}]"
    if name == "overlap":
        return True, 1.0, "a share in [0, 1]"
    if name == "saturated_clock":
        return False, 1.0, "a share in (0, 1]"
    if name == "sampler_passes":
        return False, MAX_SHARE, f"a number of passes in (0, {MAX_SHARE:g}]"
    if name == "decode_attention_flops":
        return True, MAX_SHARE, f"a share in [0, {MAX_SHARE:g}]"
    return False, MAX_SHARE, f"a share in (0, {MAX_SHARE:g}]"


Bounds = dict[str, tuple[float, float]]
FIT_BOUNDS: Bounds = {"gemm_flops": (0.05, 0.9), "attention_flops": (0.2, 1.0),
                      "memory": (0.05, 0.95), "elementwise": (0.05, 1.0), "overlap": (0.0, 1.0),
                      "gemm_flops_8bit": (0.05, 1.0), "weight_only_memory": (0.05, 1.0),
                      "step_s": (0.0, 5e-3), "layer_s": (0.0, 200e-6),
                      "chunk_s": (0.0, 1e-3), "sequence_s": (0.0, 1e-4),
                      "allreduce_s": (10e-6, 60e-6), "gemm_m_half": (0.0, 2048.0),
                      "attention_context_half": (0.0, 4096.0),
                      "decode_attention_flops": (0.01, 1.0),
                      "tp_step_s": (0.0, 5e-3), "tp_allreduce_s": (0.0, 60e-6),
                      "request_s": (0.0, 0.1)}
CALIBRATION_BOUNDS: Bounds = {**FIT_BOUNDS, **{name: (0.01, MAX_SHARE) for name in (
    "gemm_flops", "attention_flops", "memory", "elementwise")}, "step_s": (0.0, 0.05),
    "chunk_s": (0.0, 0.01), "sequence_s": (0.0, 0.01)}


# Coordinate descent crawls along a valley of two factors trading off (the loss falls by parts
# per million a round): the step halves after this many rounds, so a fit takes the same time.
ROUNDS_PER_STEP = 10


def fit_efficiency(loss: Callable[[OperationEfficiency], float], start: OperationEfficiency,
                   fields_to_fit: tuple[str, ...] = tuple(FIT_BOUNDS),
                   bounds: Bounds = FIT_BOUNDS) -> OperationEfficiency:
    """The factors of least `loss`, by coordinate descent within `bounds`."""
    best, best_loss = start, loss(start)
    step, rounds = 0.5, 0
    while step > 1e-3:
        improved = False
        rounds += 1
        for name in fields_to_fit:
            lo, hi = bounds[name]
            for direction in (1 + step, 1 / (1 + step)):
                value = getattr(best, name)
                moved = value * direction if value > 0 else (hi - lo) * step / 10
                candidate = dataclasses.replace(best, **{name: min(hi, max(lo, moved))})
                candidate_loss = loss(candidate)
                if candidate_loss < best_loss - 1e-12:
                    best, best_loss, improved = candidate, candidate_loss, True
        if not improved or rounds >= ROUNDS_PER_STEP:
            step, rounds = step / 2, 0
    return best


@dataclass(frozen=True)
class Link:
    """A tensor-parallel all-reduce: a latency per call plus the ring's 2(N-1)/N of the message."""

    gpus: int = 1
    bandwidth: float = math.inf

    def seconds(self, message_bytes: float, latency_s: float) -> float:
        if self.gpus < 2:
            return 0.0
        return latency_s + 2 * (self.gpus - 1) / self.gpus * message_bytes / self.bandwidth


WEIGHT_KINDS = ("16-bit", "8-bit", "weight-only")


@dataclass(frozen=True)
class StepPrice:
    """Seconds of a step of `model` on `peaks`: each operation on its roofline, plus all-reduces."""

    model: BudgetModel
    peaks: DevicePeaks
    efficiency: OperationEfficiency
    link: Link = Link()
    attention_flops: float | None = None
    weights: str = "16-bit"
    _rates: tuple[float, float, float, float, float] = field(init=False, repr=False)
    _decode_attention_rate: float = field(init=False, repr=False)
    _comm_per_token: float = field(init=False, repr=False)
    _fixed_s: float = field(init=False, repr=False)
    _allreduce_s: float = field(init=False, repr=False)
    _limited: float = field(init=False, repr=False)
    _key: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_KINDS:
            raise ConfigError("weights", f"must be one of {', '.join(WEIGHT_KINDS)}, got "
                              f"{self.weights!r}")
        e, p = self.efficiency, self.peaks
        attention = p.flops if self.attention_flops is None else self.attention_flops
        gemm_share = e.gemm_flops_8bit if self.weights == "8-bit" else e.gemm_flops
        weight_share = e.weight_only_memory if self.weights == "weight-only" else e.memory
        object.__setattr__(self, "_rates", (p.flops * gemm_share, attention * e.attention_flops,
                                            p.bandwidth * weight_share, p.bandwidth * e.memory,
                                            p.bandwidth * e.elementwise))
        object.__setattr__(self, "_decode_attention_rate",
                           attention * (e.decode_attention_flops or e.attention_flops))
        c = self.model.config
        object.__setattr__(self, "_comm_per_token",
                           c.hidden_size * self.model.activation_bytes_per_element)
        extra_gpus = max(0, self.link.gpus - 1)
        object.__setattr__(self, "_fixed_s", e.step_s + c.num_layers * e.layer_s
                           + extra_gpus * e.tp_step_s)
        object.__setattr__(self, "_allreduce_s", e.allreduce_s + extra_gpus * e.tp_allreduce_s)
        # the share of the clock a power-limited operation loses
        object.__setattr__(self, "_limited", 1.0 - e.saturated_clock)
        object.__setattr__(self, "_key", f"ops {self.model.counting_key} {p!r} {e!r} "
                                         f"{self.link!r} {attention} {self.weights}")

    def operations(self, shape: StepShape) -> dict[str, float]:
        if shape.num_tokens == 0:
            return dict.fromkeys(OPERATIONS, 0.0)
        m = self.model
        _, _, weight_rate, memory_rate, elementwise_rate = self._rates
        counts = m.operation_counts(shape)
        layers = 2 * m.config.num_layers
        message = self._comm_per_token * shape.num_tokens
        overlap, limited = self.efficiency.overlap, self._limited
        return {
            "gemm": _roofline(self._gemm_compute_s(counts.gemm_flops, shape.num_tokens),
                              m.weight_bytes / weight_rate, overlap, limited),
            "attention_prefill": _roofline(self._prefill_attention_compute_s(shape, counts),
                                           counts.prefill_kv_bytes / memory_rate, overlap,
                                           limited),
            "attention_decode": _roofline(counts.decode_pair_flops / self._decode_attention_rate,
                                          counts.decode_kv_bytes / memory_rate, overlap),
            "elementwise": counts.activation_bytes / elementwise_rate,
            "sampler": self._sampler_bytes(shape) / elementwise_rate,
            "communication": layers * self.link.seconds(message, self._allreduce_s),
            "step": self._fixed_s + self._per_step(shape),
        }

    def predict(self, shape: StepShape) -> float:
        return shape.counted(self._key, self._predict)

    def _per_step(self, shape: StepShape) -> float:
        e = self.efficiency
        return e.chunk_s * len(shape.prefill) + e.sequence_s * len(shape.decode_contexts)

    def _predict(self, shape: StepShape) -> float:
        """operations() summed, without its dict: the twin's every step calls this."""
        tokens = shape.num_tokens
        if tokens == 0:
            return 0.0
        m = self.model
        _, _, weight_rate, memory_rate, elementwise_rate = self._rates
        c = m.operation_counts(shape)
        overlap, limited = self.efficiency.overlap, self._limited
        total = self._fixed_s + self._per_step(shape)
        total += _roofline(self._gemm_compute_s(c.gemm_flops, tokens),
                           m.weight_bytes / weight_rate, overlap, limited)
        total += _roofline(self._prefill_attention_compute_s(shape, c),
                           c.prefill_kv_bytes / memory_rate, overlap, limited)
        total += _roofline(c.decode_pair_flops / self._decode_attention_rate,
                           c.decode_kv_bytes / memory_rate, overlap)
        total += (c.activation_bytes + self._sampler_bytes(shape)) / elementwise_rate
        if self.link.gpus > 1:
            total += 2 * m.config.num_layers * self.link.seconds(
                self._comm_per_token * tokens, self._allreduce_s)
        return total

    def _sampler_bytes(self, shape: StepShape) -> float:
        return (shape.logits_rows * self.model.config.vocab_size * LOGIT_BYTES
                * self.efficiency.sampler_passes)

    def _prefill_attention_compute_s(self, shape: StepShape, counts: OperationCounts) -> float:
        """The chunks' attention, each at the share its key length sustains."""
        seconds = counts.prefill_pair_flops / self._rates[1]
        half = self.efficiency.attention_context_half
        if half == 0.0 or seconds == 0.0:
            return seconds
        return seconds * (1 + half * shape.counted("inverse key length", _inverse_key_length))

    def _gemm_compute_s(self, flops: float, rows: int) -> float:
        """`flops` of GEMMs over `rows` tokens at the share a GEMM of that many rows sustains."""
        return flops / self._rates[0] * (1 + self.efficiency.gemm_m_half / rows)


def _roofline(compute_s: float, memory_s: float, overlap: float, limited: float = 0.0) -> float:
    """One operation's seconds: the longer of its compute and its reads, plus `overlap` of the
    shorter; compute beyond the reads runs at the clock a power limit leaves (`limited`, the
    share of the clock lost): c / (1 - l (1 - m / c))."""
    if compute_s > memory_s:
        return (compute_s * compute_s / (compute_s - limited * (compute_s - memory_s))
                + overlap * memory_s)
    return memory_s + overlap * compute_s


def _inverse_key_length(shape: StepShape) -> float:
    """1 / L over the prefill chunks' query-key pairs, L the keys a chunk's last row sees."""
    pairs = weighted = 0.0
    for chunk, before in shape.prefill:
        count = chunk * before + chunk * (chunk + 1) / 2
        pairs += count
        weighted += count / (before + chunk)
    return weighted / pairs if pairs else 0.0


OUTLIER_MADS = 4.0
OUTLIER_FLOOR = 0.10
CALIBRATED_FIELDS = ("gemm_flops", "attention_flops", "memory", "elementwise", "overlap",
                     "step_s", "chunk_s", "sequence_s")


def fit_step_price(model: BudgetModel, peaks: DevicePeaks, steps: list[tuple[StepShape, float]],
                   bounds: Bounds = CALIBRATION_BOUNDS,
                   fields_to_fit: tuple[str, ...] = CALIBRATED_FIELDS) -> OperationEfficiency:
    """The factors of least squared log error on measured `steps` (shape, seconds)."""
    start = _summed_solution(model, peaks, steps, bounds)

    def loss_on(kept: list[tuple[StepShape, float]]) -> Callable[[OperationEfficiency], float]:
        def loss(efficiency: OperationEfficiency) -> float:
            price = StepPrice(model, peaks, efficiency)
            return sum(math.log(price.predict(shape) / seconds) ** 2 for shape, seconds in kept)
        return loss

    best = fit_efficiency(loss_on(steps), start, fields_to_fit, bounds)
    price = StepPrice(model, peaks, best)
    residual = [abs(math.log(price.predict(shape) / seconds)) for shape, seconds in steps]
    middle = statistics.median(residual)
    mad = statistics.median(abs(r - middle) for r in residual)
    kept = [step for step, r in zip(steps, residual, strict=True)
            if r <= max(OUTLIER_FLOOR, middle + OUTLIER_MADS * mad)]
    if len(kept) < len(steps) and len(kept) >= len(fields_to_fit):
        best = fit_efficiency(loss_on(kept), best, fields_to_fit, bounds)
    return best


def _summed_solution(model: BudgetModel, peaks: DevicePeaks,
                     steps: list[tuple[StepShape, float]], bounds: Bounds) -> OperationEfficiency:
    """The factors fitting `steps` with no overlap, by least squares on relative error."""
    vocab = model.config.vocab_size
    rows, seconds = [], []
    for shape, measured in steps:
        c = model.operation_counts(shape)
        rows.append((1.0, len(shape.prefill), len(shape.decode_contexts),
                     c.gemm_flops / peaks.flops,
                     c.prefill_pair_flops / peaks.flops + c.decode_pair_flops / peaks.flops,
                     (model.weight_bytes + c.prefill_kv_bytes + c.decode_kv_bytes)
                     / peaks.bandwidth,
                     (c.activation_bytes + shape.logits_rows * vocab * LOGIT_BYTES)
                     / peaks.bandwidth))
        seconds.append(measured)
    coef = nonnegative_relative_lstsq(np.asarray(rows, dtype=np.float64),
                                      np.asarray(seconds, dtype=np.float64))

    def clip(name: str, value: float) -> float:
        lo, hi = bounds[name]
        return min(hi, max(lo, value))

    shares = {name: clip(name, 1 / inverse if inverse > 0 else bounds[name][1])
              for name, inverse in zip(("gemm_flops", "attention_flops", "memory",
                                        "elementwise"), coef[3:], strict=True)}
    return OperationEfficiency(**shares, overlap=1.0, step_s=clip("step_s", coef[0]),
                               chunk_s=clip("chunk_s", coef[1]),
                               sequence_s=clip("sequence_s", coef[2]))
