"""The calibrated step-time predictor: measured seconds of a step from its shape."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.batch import StepShape
from engine.budget.cost_model import BudgetModel, window_pairs
from engine.budget.peaks import DevicePeaks
from engine.config import ConfigError
from engine.model.config import ModelConfig

FORM = "linear-features"
FEATURES = ("constant", "multi_token", "tokens", "prefill_chunks", "decode_seqs",
            "prefill_pairs", "decode_context")
OUTLIER_MADS = 4.0
OUTLIER_FLOOR = 0.10
DEFAULT_RATIO_WINDOW_S = 60.0
BUCKET_STEPS = 4096
KNEE_STEPS_PER_DOUBLING = 8


def features(shape: StepShape, knee: float = 1.0, sliding_window: int | None = None,
             windowed_share: float = 0.0) -> tuple[float, ...]:
    """A step's regressors in FEATURES order; under `knee` tokens, linear layers cost `knee`."""
    pairs = sum(chunk * before + chunk * (chunk + 1) / 2 for chunk, before in shape.prefill)
    context = float(sum(shape.decode_contexts))
    if sliding_window is not None and windowed_share > 0:
        windowed_pairs = sum(window_pairs(chunk, before, sliding_window)
                             for chunk, before in shape.prefill)
        windowed_context = sum(min(c, sliding_window) for c in shape.decode_contexts)
        pairs += windowed_share * (windowed_pairs - pairs)
        context += windowed_share * (windowed_context - context)
    return (1.0, float(shape.num_tokens > 1), float(max(shape.num_tokens, knee)),
            float(len(shape.prefill)), float(len(shape.decode_contexts)), float(pairs),
            context)


@dataclass(frozen=True)
class StepTimePredictor:
    """Seconds per step = Σ coefficient × feature; coefficients in FEATURES order."""

    constant_s: float
    multi_token_s: float
    per_token_s: float
    per_prefill_chunk_s: float
    per_decode_seq_s: float
    per_prefill_pair_s: float
    per_decode_context_s: float
    points: int
    source: str
    token_knee: float = 1.0
    sliding_window: int | None = None
    windowed_share: float = 0.0

    def __post_init__(self) -> None:
        for name, value in zip(FEATURES, self.coefficients, strict=True):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"predictor.{name}", f"must be finite and >= 0, got {value}")
        if not (math.isfinite(self.token_knee) and self.token_knee >= 1):
            raise ConfigError("predictor.token_knee", f"must be finite and >= 1, got "
                              f"{self.token_knee}")
        if not 0.0 <= self.windowed_share <= 1.0 or (
                self.windowed_share > 0 and (self.sliding_window or 0) < 1):
            raise ConfigError("predictor.windowed_share", "must be in [0, 1], with a "
                              f"sliding_window >= 1 when above 0; got {self.windowed_share} "
                              f"and {self.sliding_window}")

    @property
    def coefficients(self) -> tuple[float, ...]:
        return (self.constant_s, self.multi_token_s, self.per_token_s, self.per_prefill_chunk_s,
                self.per_decode_seq_s, self.per_prefill_pair_s, self.per_decode_context_s)

    def predict(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        return sum(c * x for c, x in zip(
            self.coefficients,
            features(shape, self.token_knee, self.sliding_window, self.windowed_share),
            strict=True))

    @classmethod
    def fit(cls, shapes: Sequence[StepShape], seconds: Sequence[float],
            source: str = "least squares", sliding_window: int | None = None,
            windowed_share: float = 0.0) -> StepTimePredictor:
        """Non-negative least squares on relative error, the knee searched, one outlier pass."""
        if len(shapes) != len(seconds):
            raise ConfigError("seconds", f"{len(seconds)} times for {len(shapes)} shapes")
        if len(shapes) < len(FEATURES):
            raise ConfigError("shapes", f"need at least {len(FEATURES)} timed steps to fit "
                              f"{len(FEATURES)} coefficients, got {len(shapes)}")
        y = np.asarray(seconds, dtype=np.float64)
        if not np.all(np.isfinite(y) & (y > 0)):
            raise ConfigError("seconds", "every measured time must be finite and > 0")
        x = np.asarray([features(s, 1.0, sliding_window, windowed_share) for s in shapes],
                       dtype=np.float64)
        tokens = x[:, FEATURES.index("tokens")].copy()
        knee, coef = _best_knee(x, tokens, y)
        residual = np.abs(_with_knee(x, tokens, knee) @ coef / y - 1)
        mad = float(np.median(np.abs(residual - np.median(residual))))
        keep = residual <= max(OUTLIER_FLOOR, float(np.median(residual)) + OUTLIER_MADS * mad)
        if keep.sum() >= len(FEATURES) and not keep.all():
            knee, coef = _best_knee(x[keep], tokens[keep], y[keep])
        return cls(*(float(c) for c in coef), points=int(keep.sum()), source=source,
                   token_knee=knee, sliding_window=sliding_window,
                   windowed_share=windowed_share if sliding_window is not None else 0.0)


    def effective_peaks(self, config: ModelConfig, bytes_per_element: int,
                        fallback: DevicePeaks) -> DevicePeaks:
        """The FLOP/s and bytes/s this box achieves running `config`, read off the fit."""
        base = BudgetModel(config, bytes_per_element, fallback)
        flops = 2 * base.params / self.per_token_s if self.per_token_s > 0 else fallback.flops
        bandwidth = (base.kv_bytes_per_token / self.per_decode_context_s
                     if self.per_decode_context_s > 0 else fallback.bandwidth)
        return DevicePeaks(name=fallback.name, flops=flops, bandwidth=bandwidth,
                           source=f"calibrated ({self.source}, {self.points} steps)")

    def budget_model(self, config: ModelConfig, bytes_per_element: int,
                     fallback: DevicePeaks) -> BudgetModel:
        """A BudgetModel on the calibrated peaks, so its C* uses the calibrated R, P and k."""
        return BudgetModel(config, bytes_per_element,
                           self.effective_peaks(config, bytes_per_element, fallback),
                           step_overhead_s=self.constant_s)


    def to_dict(self) -> dict[str, float | int | str | None]:
        return {"form": FORM, "constant_s": self.constant_s, "multi_token_s": self.multi_token_s,
                "per_token_s": self.per_token_s, "token_knee": self.token_knee,
                "per_prefill_chunk_s": self.per_prefill_chunk_s,
                "per_decode_seq_s": self.per_decode_seq_s,
                "per_prefill_pair_s": self.per_prefill_pair_s,
                "per_decode_context_s": self.per_decode_context_s,
                "sliding_window": self.sliding_window, "windowed_share": self.windowed_share,
                "points": self.points, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> StepTimePredictor:
        """A stored predictor; older ones get knee 1 and no windows, as they were fitted."""
        stored = {"token_knee": 1.0, "sliding_window": None, "windowed_share": 0.0, **data}
        form = stored.get("form", FORM)
        if form != FORM:
            raise ConfigError("predictor", f"stored predictor of form {form!r}, which this "
                              f"version does not read (it reads {FORM!r}); recalibrate with "
                              "`tokenflow calibrate`")
        try:
            return cls(**{name: stored[name] for name in cls.__dataclass_fields__})
        except KeyError as exc:
            raise ConfigError("predictor", f"stored predictor lacks {exc.args[0]!r}; "
                              "recalibrate with `tokenflow calibrate`") from None


def _with_knee(x: np.ndarray, tokens: np.ndarray, knee: float) -> np.ndarray:
    priced = x.copy()
    priced[:, FEATURES.index("tokens")] = np.maximum(tokens, knee)
    return priced


def _best_knee(x: np.ndarray, tokens: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """The knee of least relative squared error on a geometric grid; the smallest among equals."""
    top = float(tokens.max())
    grid = np.exp2(np.arange(0, math.log2(max(top, 1.0)) * KNEE_STEPS_PER_DOUBLING + 1)
                   / KNEE_STEPS_PER_DOUBLING)
    best: tuple[float, float, np.ndarray] | None = None
    for knee in np.unique(np.concatenate([[1.0], tokens, grid[grid <= top]])):
        priced = _with_knee(x, tokens, float(knee))
        coef = nonnegative_relative_lstsq(priced, y)
        error = float(np.sum((priced @ coef / y - 1) ** 2))
        if best is None or error < best[0] * (1 - 1e-9) - 1e-15:
            best = (error, float(knee), coef)
    assert best is not None
    return best[1], best[2]


def nonnegative_relative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ‖(x·c − y)/y‖ with c ≥ 0, by active-set descent."""
    rows = x / y[:, None]
    ones = np.ones_like(y)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(rows[:, active], ones, rcond=None)
        if solution.min() >= 0:
            coef[active] = solution
            return coef
        active.pop(int(np.argmin(solution)))
    return coef


class StepTimeRatio:
    """Measured over predicted step time, as the engine runs: the median over `window_s`."""

    def __init__(self, window_s: float = DEFAULT_RATIO_WINDOW_S, bucket_s: float = 1.0) -> None:
        if not 0 < bucket_s <= window_s:
            raise ConfigError("window_s", f"must be >= bucket_s > 0, got {window_s}, {bucket_s}")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._buckets: deque[tuple[float, float, float, int]] = deque(
            maxlen=math.ceil(window_s / bucket_s) + 1)
        self._current: list[float] = []
        self._current_start: float | None = None
        self._current_last = 0.0
        self.value = 1.0

    def observe(self, now: float, measured_s: float, predicted_s: float) -> None:
        if not (predicted_s > 0 and math.isfinite(measured_s) and measured_s >= 0):
            return
        if self._current_start is not None and (now - self._current_start >= self.bucket_s
                                                or len(self._current) >= BUCKET_STEPS):
            self._buckets.append((self._current_start, self._current_last,
                                  statistics.median(self._current), len(self._current)))
            self._current, self._current_start = [], None
        if self._current_start is None:
            self._current_start = now
        self._current_last = now
        self._current.append(measured_s / predicted_s)
        self._expire(now)

    def _expire(self, now: float) -> None:
        """Drop the buckets whose last step left the window, and take the median of the rest."""
        while self._buckets and self._buckets[0][1] < now - self.window_s:
            self._buckets.popleft()
        self.value = statistics.median(b[2] for b in self._buckets) if self._buckets else 1.0

    @property
    def steps(self) -> int:
        return sum(b[3] for b in self._buckets)

    @property
    def span_s(self) -> float:
        """Seconds of steps the value summarises (0 with no complete bucket in the window)."""
        if not self._buckets:
            return 0.0
        return self._buckets[-1][1] - self._buckets[0][0]

    def reset(self) -> None:
        """A new predictor: what was measured against the old one says nothing of it."""
        self._buckets.clear()
        self._current, self._current_start = [], None
        self.value = 1.0
