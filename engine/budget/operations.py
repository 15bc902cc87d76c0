"""A step priced per operation and summed, as the kernels run: one after another.

A forward pass is a sequence of kernels, each bound by its own resource: the GEMMs by the
tensor cores (or by reading the weights, at small batches), prefill attention by its
(query, key) pairs, decode attention by reading the cached KV, norms and activations by
moving each token's activations, the sampler by reading the logits rows, and tensor
parallelism by its all-reduces (small ones latency-bound). Each has its own roofline on the
sustained share of the device's peaks, and the step costs their sum plus a fixed cost (kernel
launches, scheduling, host work), the way Vidur and LLMCompass price a step.

`OperationEfficiency` holds the shares; a GPU profile (engine.sim.profiles) carries the ones
fitted against published measurements, a calibration (engine.harness.calibrate) fits them on
this machine from measured peaks. `StepPrice.predict` is called once a step: arithmetic on a
few numbers per shape, its counts memoised on the shape.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from engine.batch import StepShape
from engine.budget.cost_model import BudgetModel
from engine.budget.peaks import DevicePeaks
from engine.budget.predictor import nonnegative_relative_lstsq
from engine.config import ConfigError

OPERATIONS = ("gemm", "attention_prefill", "attention_decode", "elementwise", "sampler",
              "communication", "step")
# A share of a measured peak may pass 1 (see CALIBRATION_BOUNDS), never by this much.
MAX_SHARE = 20.0
# Logits are sampled in fp32: a row is read and written once by the softmax and top-k/p.
LOGIT_BYTES = 4


@dataclass(frozen=True)
class OperationEfficiency:
    """The share of a datasheet peak each operation sustains, and the fixed costs.

    gemm_flops: dense GEMMs against the tensor-core peak of the weights' precision;
    attention_flops: prefill attention (a flash kernel) against the same peak;
    memory: streaming reads (weights in a GEMM, KV in attention) against the bandwidth;
    elementwise: norms, activations, RoPE and residual adds against the bandwidth;
    overlap: how little an operation near its ridge overlaps compute with memory: its time
      is max(compute, memory) + overlap x min(compute, memory) (0: the ideal roofline, 1:
      no overlap at all), which prices a short prefill's GEMMs between the two;
    gemm_flops_8bit: GEMMs on FP8 or INT8 tensor cores against that peak, which a card
      holds at lower clocks within its power limit than the 16-bit one;
    weight_only_memory: weight-only quantised GEMMs (int8-wo, fp8-wo) streaming their weights,
      against the bandwidth: each weight is dequantised on the CUDA cores on the way in;
    step_s: every step, whatever it runs (scheduling, sampling set-up, the host);
    layer_s: every layer of every step: the floor of its dozen kernels' launches and tails,
      which no roofline term reaches at small shapes;
    chunk_s: every prefill chunk (its attention call, positions and block-table metadata);
    sequence_s: every decoding sequence (its block table, logits row and sampling set-up);
    allreduce_s: one small all-reduce call between tensor-parallel GPUs (its latency).
    """

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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            may_be_zero = f.name.endswith("_s") or f.name == "overlap"
            limit = math.inf if f.name.endswith("_s") else 1.0 if f.name == "overlap" else (
                MAX_SHARE)
            if not (isinstance(value, int | float) and math.isfinite(value)
                    and (value >= 0 if may_be_zero else value > 0) and value <= limit):
                raise ConfigError(f"efficiency.{f.name}", f"must be a share in (0, {MAX_SHARE}] "
                                  "(overlap in [0, 1], a time in seconds >= 0 for *_s), got "
                                  f"{value!r}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OperationEfficiency:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError("efficiency", f"unknown field(s) {', '.join(sorted(unknown))}; "
                              f"known: {', '.join(sorted(known))}")
        return cls(**{k: float(v) for k, v in data.items()})


Bounds = dict[str, tuple[float, float]]
# Where a fit may move each factor: shares of a datasheet peak, the overlap, and seconds. A
# small all-reduce cannot beat NCCL's latency on NVLink, so the per-layer floor cannot absorb it.
FIT_BOUNDS: Bounds = {"gemm_flops": (0.05, 1.0), "attention_flops": (0.05, 1.0),
                      "memory": (0.05, 1.0), "elementwise": (0.05, 1.0), "overlap": (0.0, 1.0),
                      "gemm_flops_8bit": (0.05, 1.0), "weight_only_memory": (0.05, 1.0),
                      "step_s": (0.0, 5e-3), "layer_s": (0.0, 200e-6),
                      "chunk_s": (0.0, 1e-3), "sequence_s": (0.0, 1e-4),
                      "allreduce_s": (10e-6, 60e-6)}
# Against measured peaks a share may pass 1 (weights held in a CPU's caches outrun the copy
# that measured the bandwidth), and a host's fixed cost a step may be larger.
CALIBRATION_BOUNDS: Bounds = {**FIT_BOUNDS, **{name: (0.01, MAX_SHARE) for name in (
    "gemm_flops", "attention_flops", "memory", "elementwise")}, "step_s": (0.0, 0.05),
    "chunk_s": (0.0, 0.01), "sequence_s": (0.0, 0.01)}


def fit_efficiency(loss: Callable[[OperationEfficiency], float], start: OperationEfficiency,
                   fields_to_fit: tuple[str, ...] = tuple(FIT_BOUNDS),
                   bounds: Bounds = FIT_BOUNDS) -> OperationEfficiency:
    """The factors of least `loss`, by coordinate descent: each factor in turn moves by a
    shrinking step while the loss falls, within `bounds` (a few hundred evaluations)."""
    best, best_loss = start, loss(start)
    step = 0.5
    while step > 1e-3:
        improved = False
        for name in fields_to_fit:
            lo, hi = bounds[name]
            for direction in (1 + step, 1 / (1 + step)):
                value = getattr(best, name)
                moved = value * direction if value > 0 else (hi - lo) * step / 10
                candidate = dataclasses.replace(best, **{name: min(hi, max(lo, moved))})
                candidate_loss = loss(candidate)
                if candidate_loss < best_loss - 1e-12:
                    best, best_loss, improved = candidate, candidate_loss, True
        if not improved:
            step /= 2
    return best


@dataclass(frozen=True)
class Link:
    """What one all-reduce between `gpus` tensor-parallel GPUs costs: a latency per call and
    the ring's 2(N-1)/N of the message over one GPU's one-way link bandwidth (NCCL's
    bus-bandwidth formula)."""

    gpus: int = 1
    bandwidth: float = math.inf  # bytes/s one GPU sends one way

    def seconds(self, message_bytes: float, latency_s: float) -> float:
        if self.gpus < 2:
            return 0.0
        return latency_s + 2 * (self.gpus - 1) / self.gpus * message_bytes / self.bandwidth


# How a step's GEMMs hold their weights: 16-bit (BF16/FP16 peak and share), 8-bit (FP8 or
# INT8 tensor cores) or weight-only (1-byte weights dequantised into 16-bit GEMMs).
WEIGHT_KINDS = ("16-bit", "8-bit", "weight-only")


@dataclass(frozen=True)
class StepPrice:
    """Seconds of a step of `model` (its counts: FLOPs per token, bytes per element of the
    weights, KV and activations) on `peaks` (of all tensor-parallel GPUs together), each
    operation on its own roofline at `efficiency`, plus the all-reduces over `link`.
    Attention runs on the activations' precision (`attention_flops`, the BF16 peak) whatever
    the weights' (FP8 or INT8 GEMMs run at `peaks.flops`)."""

    model: BudgetModel
    peaks: DevicePeaks  # FLOP/s at the weights' precision and bytes/s, of all GPUs
    efficiency: OperationEfficiency
    link: Link = Link()
    attention_flops: float | None = None  # None: peaks.flops
    weights: str = "16-bit"  # one of WEIGHT_KINDS
    _rates: tuple[float, float, float, float, float] = field(init=False, repr=False)
    _comm_per_token: float = field(init=False, repr=False)
    _fixed_s: float = field(init=False, repr=False)
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
        c = self.model.config
        # two all-reduces a layer (after attention, after the MLP) of each token's hidden state
        object.__setattr__(self, "_comm_per_token",
                           c.hidden_size * self.model.activation_bytes_per_element)
        object.__setattr__(self, "_fixed_s", e.step_s + c.num_layers * e.layer_s)
        # a shape's price depends on the counts and on every rate: the memo key names both
        object.__setattr__(self, "_key", f"ops {self.model.counting_key} {p!r} {e!r} "
                                         f"{self.link!r} {attention} {self.weights}")

    def operations(self, shape: StepShape) -> dict[str, float]:
        """Seconds of each operation of the step, in OPERATIONS order."""
        if shape.num_tokens == 0:
            return dict.fromkeys(OPERATIONS, 0.0)
        m = self.model
        gemm_rate, attention_rate, weight_rate, memory_rate, elementwise_rate = self._rates
        counts = m.operation_counts(shape)
        layers = 2 * m.config.num_layers
        message = self._comm_per_token * shape.num_tokens
        overlap = self.efficiency.overlap

        def roofline(compute_s: float, memory_s: float) -> float:
            if compute_s > memory_s:
                return compute_s + overlap * memory_s
            return memory_s + overlap * compute_s

        return {
            "gemm": roofline(counts.gemm_flops / gemm_rate, m.weight_bytes / weight_rate),
            "attention_prefill": roofline(counts.prefill_pair_flops / attention_rate,
                                          counts.prefill_kv_bytes / memory_rate),
            "attention_decode": roofline(counts.decode_pair_flops / attention_rate,
                                         counts.decode_kv_bytes / memory_rate),
            "elementwise": counts.activation_bytes / elementwise_rate,
            "sampler": shape.logits_rows * m.config.vocab_size * LOGIT_BYTES / elementwise_rate,
            "communication": layers * self.link.seconds(message, self.efficiency.allreduce_s),
            "step": self._fixed_s + self._per_step(shape),
        }

    def predict(self, shape: StepShape) -> float:
        return shape.counted(self._key, self._predict)

    def _per_step(self, shape: StepShape) -> float:
        e = self.efficiency
        return e.chunk_s * len(shape.prefill) + e.sequence_s * len(shape.decode_contexts)

    def _predict(self, shape: StepShape) -> float:
        """operations() summed, without its dict: the twin's every step calls this."""
        if shape.num_tokens == 0:
            return 0.0
        m = self.model
        gemm_rate, attention_rate, weight_rate, memory_rate, elementwise_rate = self._rates
        c = m.operation_counts(shape)
        overlap = self.efficiency.overlap
        total = self._fixed_s + self._per_step(shape)
        for compute_s, memory_s in (
                (c.gemm_flops / gemm_rate, m.weight_bytes / weight_rate),
                (c.prefill_pair_flops / attention_rate, c.prefill_kv_bytes / memory_rate),
                (c.decode_pair_flops / attention_rate, c.decode_kv_bytes / memory_rate)):
            total += (compute_s + overlap * memory_s if compute_s > memory_s
                      else memory_s + overlap * compute_s)
        total += (c.activation_bytes + shape.logits_rows * m.config.vocab_size * LOGIT_BYTES
                  ) / elementwise_rate
        if self.link.gpus > 1:
            total += 2 * m.config.num_layers * self.link.seconds(
                self._comm_per_token * shape.num_tokens, self.efficiency.allreduce_s)
        return total


# A step this many median absolute deviations off the first fit is a timing outlier (another
# process took the CPU), dropped before the final fit; never under 10%, as the linear form's.
OUTLIER_MADS = 4.0
OUTLIER_FLOOR = 0.10
# What a calibration fits: one device, so no all-reduce; one precision, so no 8-bit or
# weight-only shares; one model, so its per-layer floor is the per-step one.
CALIBRATED_FIELDS = ("gemm_flops", "attention_flops", "memory", "elementwise", "overlap",
                     "step_s", "chunk_s", "sequence_s")


def fit_step_price(model: BudgetModel, peaks: DevicePeaks, steps: list[tuple[StepShape, float]],
                   bounds: Bounds = CALIBRATION_BOUNDS,
                   fields_to_fit: tuple[str, ...] = CALIBRATED_FIELDS) -> OperationEfficiency:
    """The factors of least squared log error on measured `steps` (shape, seconds).

    With every operation summed (overlap 1) a step is linear in each share's inverse and in
    each fixed cost, so a non-negative least-squares solve starts the descent near the
    optimum instead of at mid-range, where coordinate steps on seven coupled factors stall."""
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
    """The factors that fit `steps` best with no overlap anywhere, by least squares on
    relative error: columns are each share's work at the full peak and each fixed cost's
    count; a coefficient is a share's inverse or a cost."""
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
