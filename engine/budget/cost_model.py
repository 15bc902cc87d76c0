"""What a step of a given shape costs, and the three constraints on the tokens one step batches."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Protocol

from engine.batch import StepShape
from engine.budget.peaks import DevicePeaks
from engine.budget.roofline import Roofline, StepEstimate, step_estimate
from engine.config import ConfigError
from engine.model.checkpoint import fused_widths
from engine.model.config import ModelConfig

BANDWIDTH_HEADROOM = 0.15
DEFAULT_STEP_TIME_S = 0.05


class OperationCounts(NamedTuple):
    """What each operation of a step computes and moves (see BudgetModel)."""

    gemm_flops: float
    prefill_pair_flops: float
    prefill_kv_bytes: float
    decode_pair_flops: float
    decode_kv_bytes: float
    activation_bytes: float


@dataclass(frozen=True)
class BudgetModel:
    """Step cost of a decoder-only `config` on a device with `peaks`."""

    config: ModelConfig
    bytes_per_element: int
    peaks: DevicePeaks
    step_overhead_s: float = 0.0
    weight_bytes_per_element: float | None = None
    kv_bytes_per_element: float | None = None
    _linear_flops_per_token: float = field(init=False, repr=False)
    _lm_head_flops_per_row: float = field(init=False, repr=False)
    _attention_flops_per_pair: float = field(init=False, repr=False)
    _full_layers: int = field(init=False, repr=False)
    _window_layers: int = field(init=False, repr=False)
    _kv_bytes_per_layer_token: float = field(init=False, repr=False)
    _weight_bytes: float = field(init=False, repr=False)
    _activation_bytes_per_token: float = field(init=False, repr=False)
    _logits_bytes_per_row: float = field(init=False, repr=False)
    _counts_key: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.bytes_per_element not in (1, 2, 4):
            raise ConfigError("bytes_per_element",
                              f"must be 1, 2 or 4, got {self.bytes_per_element}")
        for name in ("weight_bytes_per_element", "kv_bytes_per_element"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 4:
                raise ConfigError(name, f"must be in (0, 4], got {value}")
        if self.peaks.flops <= 0 or self.peaks.bandwidth <= 0:
            raise ConfigError("peaks", f"flops and bandwidth must be > 0, got {self.peaks}")
        if self.step_overhead_s < 0:
            raise ConfigError("step_overhead_s", "must be >= 0")
        c, b = self.config, self.bytes_per_element
        lm_head_params = c.vocab_size * c.hidden_size
        widths = fused_widths(c)
        q_width = widths["qkv_proj"][0]
        per_layer_elements = (sum(widths["qkv_proj"]) + 3 * c.hidden_size
                              + sum(widths["gate_up_proj"]) + c.intermediate_size)
        weight_b = b if self.weight_bytes_per_element is None else self.weight_bytes_per_element
        derived = {
            "_linear_flops_per_token": 2 * self.params,
            "_lm_head_flops_per_row": 2 * lm_head_params,
            "_attention_flops_per_pair": 4 * q_width,
            "_kv_bytes_per_layer_token": self.kv_bytes_per_token / c.num_layers,
            "_weight_bytes": (self.params + lm_head_params) * weight_b,
            "_activation_bytes_per_token": 2 * c.num_layers * per_layer_elements * b,
            "_logits_bytes_per_row": c.vocab_size * b,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, float(value))
        object.__setattr__(self, "_window_layers", c.windowed_layers)
        object.__setattr__(self, "_full_layers", c.num_layers - c.windowed_layers)
        counting = repr((sorted(derived.items()), c.windowed_layers, c.num_layers,
                         c.sliding_window))
        object.__setattr__(self, "_counts_key", f"counts {counting}")

    @property
    def params(self) -> int:
        """P: parameters every token multiplies through, embeddings and lm_head left out."""
        return self.config.num_params(include_embeddings=False)

    @property
    def weight_bytes(self) -> float:
        return self._weight_bytes

    @property
    def activation_bytes_per_element(self) -> int:
        return self.bytes_per_element

    @property
    def counting_key(self) -> str:
        """Names everything the counts depend on: two models with equal keys count alike."""
        return self._counts_key

    @cached_property
    def kv_bytes_per_token(self) -> float:
        b = self.bytes_per_element if self.kv_bytes_per_element is None else (
            self.kv_bytes_per_element)
        return self.config.kv_bytes_per_token(b)  # type: ignore[arg-type]

    def operation_counts(self, shape: StepShape) -> OperationCounts:
        return shape.counted(self._counts_key, self._count)

    def flops(self, shape: StepShape) -> float:
        c = self.operation_counts(shape)
        return c.gemm_flops + c.prefill_pair_flops + c.decode_pair_flops

    def bytes_moved(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        c = self.operation_counts(shape)
        return (self._weight_bytes + c.prefill_kv_bytes + c.decode_kv_bytes
                + c.activation_bytes + self._logits_bytes_per_row * shape.logits_rows)

    def _count(self, shape: StepShape) -> OperationCounts:
        prefill_pairs = prefill_read = 0
        for chunk, before in shape.prefill:  # one pass, in ints: a step has a chunk or two
            prefill_pairs += chunk * before + chunk * (chunk + 1) // 2
            prefill_read += before
        decodes = len(shape.decode_contexts)
        decode_read = sum(shape.decode_contexts)
        decode_pairs = decode_read + decodes
        full = self._full_layers
        prefill_layer_pairs = full * prefill_pairs
        decode_layer_pairs = full * decode_pairs
        prefill_layer_tokens = full * (prefill_read + shape.prefill_tokens)
        decode_layer_tokens = full * (decode_read + decodes)
        if self._window_layers:
            window = self.config.sliding_window
            assert window is not None
            w = self._window_layers
            prefill_layer_pairs += w * sum(window_pairs(chunk, before, window)
                                           for chunk, before in shape.prefill)
            decode_layer_pairs += w * sum(min(context + 1, window)
                                          for context in shape.decode_contexts)
            prefill_layer_tokens += w * (sum(min(before, window) for _, before in shape.prefill)
                                         + shape.prefill_tokens)
            decode_layer_tokens += w * (sum(min(context, window)
                                            for context in shape.decode_contexts)
                                        + decodes)
        per_pair, per_token = self._attention_flops_per_pair, self._kv_bytes_per_layer_token
        tokens = shape.num_tokens
        return OperationCounts(
            gemm_flops=(self._linear_flops_per_token * tokens
                        + self._lm_head_flops_per_row * shape.logits_rows),
            prefill_pair_flops=per_pair * prefill_layer_pairs,
            prefill_kv_bytes=per_token * prefill_layer_tokens,
            decode_pair_flops=per_pair * decode_layer_pairs,
            decode_kv_bytes=per_token * decode_layer_tokens,
            activation_bytes=self._activation_bytes_per_token * tokens)

    def compute_seconds(self, shape: StepShape) -> float:
        return self.flops(shape) / self.peaks.flops

    def memory_seconds(self, shape: StepShape) -> float:
        return self.bytes_moved(shape) / self.peaks.bandwidth

    def estimate(self, shape: StepShape) -> StepEstimate:
        return step_estimate(self.compute_seconds(shape), self.memory_seconds(shape),
                             self.step_overhead_s)

    def predict(self, shape: StepShape) -> float:
        """Seconds the step should take: the roofline max plus the fixed overhead."""
        return self.estimate(shape).tau_s

    def roofline(self) -> Roofline:
        return Roofline(params=self.params, flops=self.peaks.flops,
                        bandwidth=self.peaks.bandwidth, kv_bytes_per_token=self.kv_bytes_per_token,
                        weight_bits=round(8 * (self.weight_bytes_per_element
                                               or self.bytes_per_element)),
                        sliding_window=self.config.sliding_window,
                        windowed_share=self.config.windowed_share)

    def recommended_chunk(self, decode_seqs: int, context: int) -> int:
        return max(1, round(self.roofline().balance_chunk(decode_seqs, context)))


def window_pairs(chunk: int, before: int, window: int) -> int:
    """(query, key) pairs of a `chunk`-query chunk after `before` cached tokens under `window`."""
    lo, hi = before + 1, before + chunk
    if hi <= window:
        return (lo + hi) * chunk // 2
    if lo > window:
        return chunk * window
    return (lo + window) * (window - lo + 1) // 2 + (hi - window) * window


class StepCostModel(Protocol):
    """What the budget table needs of a cost model: Roofline and BudgetModel both fit."""

    @property
    def kv_bytes_per_token(self) -> float: ...

    def compute_seconds(self, shape: StepShape) -> float: ...

    def memory_seconds(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class BudgetSegment:
    """A range of sequence lengths one constraint governs, and its token cap."""

    lo: int
    hi: int
    governing: str
    max_batched_tokens: int


CONSTRAINTS = ("compute", "bandwidth", "kv_capacity")


def budget_limits(model: StepCostModel, kv_bytes: float, context: int, *, decode_seqs: int = 0,
                  step_time_s: float = DEFAULT_STEP_TIME_S) -> dict[str, int]:
    """The most tokens one step may batch under each constraint, at sequence length S."""
    capacity = int(kv_bytes // model.kv_bytes_per_token)
    decodes = (context,) * decode_seqs

    def shape(chunk: int) -> StepShape:
        return StepShape(prefill=((chunk, context),) if chunk else (), decode_contexts=decodes)

    checks = {
        "compute": lambda s: model.compute_seconds(s) <= step_time_s,
        "bandwidth": lambda s: model.memory_seconds(s) <= (1 - BANDWIDTH_HEADROOM) * step_time_s,
        "kv_capacity": lambda s: s.kv_tokens_after <= capacity,
    }
    limits = {}
    for name, fits in checks.items():
        if not fits(shape(0)):
            limits[name] = 0
            continue
        lo, hi = 0, capacity
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(shape(mid)) else (lo, mid - 1)
        limits[name] = lo + decode_seqs
    return limits


def budget_table(model: StepCostModel, kv_bytes: float, tokens_grid: list[int], *,
                 decode_seqs: int = 0,
                 step_time_s: float = DEFAULT_STEP_TIME_S) -> list[BudgetSegment]:
    """Which of the three constraints governs each range of sequence lengths."""
    if not tokens_grid or any(b <= a for a, b in itertools.pairwise(tokens_grid)):
        raise ConfigError("tokens_grid", "must be a non-empty, strictly increasing list")
    if tokens_grid[0] < 1:
        raise ConfigError("tokens_grid", "sequence lengths must be >= 1")
    if decode_seqs < 0:
        raise ConfigError("decode_seqs", "must be >= 0")
    if step_time_s <= 0 or kv_bytes <= 0:
        raise ConfigError("step_time_s" if step_time_s <= 0 else "kv_bytes", "must be > 0")
    segments: list[BudgetSegment] = []
    for context in tokens_grid:
        limits = budget_limits(model, kv_bytes, context, decode_seqs=decode_seqs,
                               step_time_s=step_time_s)
        governing = min(reversed(CONSTRAINTS), key=lambda name: limits[name])
        tokens = limits[governing]
        if segments and segments[-1].governing == governing:
            tokens = min(tokens, segments[-1].max_batched_tokens)
            segments[-1] = BudgetSegment(segments[-1].lo, context, governing, tokens)
        else:
            segments.append(BudgetSegment(context, context, governing, tokens))
    return segments
