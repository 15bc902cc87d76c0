"""Engine configuration and sampling parameters: the contracts every other module reads."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError


class ConfigError(EngineError, ValueError):
    """A configuration value is invalid; `field` names it so UIs can point at it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # survives the console's pipe
        return ConfigError, (self.field, self.message)


MIN_TEMPERATURE = 1e-5
# The sampler works in float32: a smaller top_p masks every token, a larger temperature overflows.
FLOAT32_TINY = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes
INT64_MAX = 2**63 - 1  # the journal's INTEGER columns; larger values cannot be stored
MAX_TOP_K = 2**31 - 1
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters, validated on construction: every entry point refuses the same values."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # stop tokens, EOS and stop strings wait until this many are out
    structured_output: str | None = None  # an llguidance grammar the output must match
    skip_special_tokens: bool = True  # the output text, stop strings matched in it included

    @property
    def prefill_only(self) -> bool:
        """A scoring request: its prompt is prefilled (and scored) and nothing generated."""
        return self.max_tokens == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    def __post_init__(self) -> None:
        max_tokens = _integer("max_tokens", self.max_tokens)
        if not 0 <= max_tokens <= INT64_MAX:
            raise ConfigError("max_tokens", f"must be in [0, {INT64_MAX}] (0 only scores "
                                            "the prompt)")
        temperature = _real("temperature", self.temperature)
        if not 0 <= temperature <= FLOAT32_MAX:
            raise ConfigError("temperature", f"must be in [0, {FLOAT32_MAX:.4g}] (0 is greedy)")
        if 0 < temperature < MIN_TEMPERATURE:  # logits / t overflows to inf, then NaN
            raise ConfigError("temperature", f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ConfigError("top_p", "must be in (0, 1]")
        if top_p < FLOAT32_TINY:
            raise ConfigError("top_p", f"must be at least {FLOAT32_TINY:.4g}: smaller rounds to 0 "
                                       "in float32 and masks every token")
        top_k = _integer("top_k", self.top_k)
        if not 0 <= top_k <= MAX_TOP_K:
            raise ConfigError("top_k", f"must be in [0, {MAX_TOP_K}] (0 disables top-k)")
        if self.seed is not None:
            seed = _integer("seed", self.seed)
            if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
                raise ConfigError("seed", "must be in [-2**63, 2**64)")
            object.__setattr__(self, "seed", seed)
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        if isinstance(self.stop_token_ids, str | bytes):
            raise ConfigError("stop_token_ids", "must be a sequence of token ids")
        try:
            stop_ids = tuple(_integer("stop_token_ids", t) for t in self.stop_token_ids)
        except TypeError:
            raise ConfigError("stop_token_ids", "must be a sequence of token ids") from None
        bad = next((t for t in stop_ids if not 0 <= t <= INT64_MAX), None)
        if bad is not None:
            raise ConfigError("stop_token_ids", f"token id {bad} is negative or too large")
        for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                            ("top_p", top_p), ("top_k", top_k), ("stop_token_ids", stop_ids),
                            *self._checked_extras()):
            object.__setattr__(self, name, value)

    def _checked_extras(self) -> list[tuple[str, Any]]:
        """The penalties, biases, stop strings and logprob counts, checked as vLLM bounds them."""
        values: list[tuple[str, Any]] = []
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ConfigError(name, "must be in [-2, 2]")
            values.append((name, value))
        repetition = _real("repetition_penalty", self.repetition_penalty)
        if not 0 < repetition <= FLOAT32_MAX:
            raise ConfigError("repetition_penalty", "must be greater than 0 (1 disables it)")
        min_p = _real("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ConfigError("min_p", "must be in [0, 1] (0 disables it)")
        values += [("repetition_penalty", repetition), ("min_p", min_p)]
        try:
            bias = tuple((_integer("logit_bias", token), _real("logit_bias", value))
                         for token, value in self.logit_bias)
        except (TypeError, ValueError):
            raise ConfigError("logit_bias", "must map token ids to numbers") from None
        bad = next((t for t, _ in bias if not 0 <= t <= INT64_MAX), None)
        if bad is not None:
            raise ConfigError("logit_bias", f"token id {bad} is negative or too large")
        if any(not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for _, v in bias):
            raise ConfigError("logit_bias", f"values must be in [-{MAX_LOGIT_BIAS:g}, "
                                            f"{MAX_LOGIT_BIAS:g}]")
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise ConfigError("stop", "must be a list of strings")
        if any(not s for s in self.stop):
            raise ConfigError("stop", "must not hold an empty string")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ConfigError("include_stop_str_in_output", "must be true or false")
        values += [("logit_bias", bias), ("stop", tuple(self.stop))]
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None:
                count = _integer(name, count)
                if not 0 <= count <= MAX_LOGPROBS:
                    raise ConfigError(name, f"must be in [0, {MAX_LOGPROBS}]")
            values.append((name, count))
        min_tokens = _integer("min_tokens", self.min_tokens)
        if not 0 <= min_tokens <= _integer("max_tokens", self.max_tokens):
            raise ConfigError("min_tokens", "must be in [0, max_tokens]")
        if self.structured_output is not None and not isinstance(self.structured_output, str):
            raise ConfigError("structured_output", "must be an llguidance grammar (text)")
        if not isinstance(self.skip_special_tokens, bool):
            raise ConfigError("skip_special_tokens", "must be true or false")
        values.append(("min_tokens", min_tokens))
        return values

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ConfigError unless every token id and top_k fit a vocabulary of this size."""
        bad = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        if bad is not None:
            raise ConfigError("stop_token_ids",
                              f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        bad = next((t for t, _ in self.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise ConfigError("logit_bias",
                              f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        if self.top_k > vocab_size:
            raise ConfigError("top_k", f"must be at most the vocabulary size {vocab_size} "
                                       "(0 disables top-k)")


def _integer(name: str, value: Any) -> int:
    """An int (numpy's too, through __index__), never a bool or a float."""
    if isinstance(value, bool):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(name, f"must be an integer, got {value!r}") from None


def _real(name: str, value: Any) -> float:
    """A finite float from an int or float; NaN would silently mean greedy, inf poisons."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(name, f"must be a number, got {value!r}")
    try:
        result = float(value)
    except OverflowError:
        raise ConfigError(name, "must be a finite number") from None
    if not math.isfinite(result):
        raise ConfigError(name, "must be a finite number")
    return result


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; docs/contracts.md says what each field means."""

    # --- fixed at start -----------------------------------------------------------------
    model: str = "synthetic:tiny"
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # the live budget's ceiling (budget_ceiling): a GPU's pool leaves room for such a step
    max_num_batched_tokens_cap: int = 16384
    attention_backend: str = "auto"
    logprobs_mode: str = "raw_logprobs"
    cpu_threads: int = 0
    stats_window_s: float = 60.0
    compile: bool | None = None
    cpu_graphs: bool | None = None
    # --- live-tunable ---------------------------------------------------------------------
    max_num_batched_tokens: int = 256
    chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    auto_budget: bool = False
    auto_tpot_ms: float = 0.0
    chunk_tile: int = 16
    max_prefill_chunks: int = 4
    long_prefill_threshold: int = 0
    # prompt tokens a step that holds decodes may take after them (0: the budget's rest), so a
    # long prompt's chunks never make a running decode's step a prefill's (Sarathi-Serve)
    mixed_step_prefill_tokens: int = 0
    # the decode cadence (engine/core/cadence.py): a step with this many decodes starts new
    # prefills only with a step's worth waiting or the oldest waiting this long; 0: off
    cadence_min_decodes: int = 0
    cadence_max_wait_ms: float = 250.0
    cache_high_watermark: float = 0.85
    cache_low_watermark: float = 0.70
    bandwidth_throttle_2: float = 0.90
    bandwidth_throttle_1: float = 0.95
    bandwidth_pause: float = 0.98
    bandwidth_pause_s: float = 10.0
    slow_query_threshold: float = 1.5
    slow_query_min_overrun_ms: float = 5.0
    # the operator's SLO (0: none): a request past either is stored as a slow query too
    slo_ttft_ms: float = 0.0
    slo_itl_ms: float = 0.0
    max_prefill_tokens: int = 0
    chunk_timeout_base_ms: float = 0.0
    guard_window_s: float = 10.0
    defrag_threshold: float = 0.30
    defrag_interval_s: float = 300.0
    degraded_path: bool = True
    preempt_protect_after: int = 3
    tenant_shares: dict[str, float] = field(default_factory=dict)
    tenant_priorities: dict[str, int] = field(default_factory=dict)

    def replace(self, **changes: Any) -> EngineConfig:
        """A validated copy with `changes`; raises ConfigError naming the first bad field."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            name = sorted(unknown)[0]
            raise ConfigError(name, "unknown configuration field; the fields a running engine "
                                    f"takes: {', '.join(sorted(LIVE_FIELDS))}")
        fixed = set(changes) - LIVE_FIELDS
        if fixed:
            name = sorted(fixed)[0]
            raise ConfigError(name, "fixed at start; restart the engine to change it")
        typed = {name: _coerce(name, value) for name, value in changes.items()}
        candidate = dataclasses.replace(self, **typed)
        candidate.validate()
        return candidate

    def context_length(self, model_positions: int) -> int:
        """The longest prompt plus output served: `max_model_len`, or the model's positions
        where unset. Past them is refused, as vLLM refuses it: the model never saw those
        positions (vLLM's override is VLLM_ALLOW_LONG_MAX_MODEL_LEN; this engine has none)."""
        if self.max_model_len is not None and self.max_model_len > model_positions:
            raise ConfigError("max_model_len", (
                f"{self.max_model_len:,} is past the model's {model_positions:,} positions "
                f"(max_position_embeddings in its config); pass --max-model-len "
                f"{model_positions} or less, or leave it unset"))
        return model_positions if self.max_model_len is None else self.max_model_len

    def validate(self) -> None:
        _check(self.block_size >= 1, "block_size", "must be >= 1")
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        _check(self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be > 0")
        _check(self.chunk_tile >= 1, "chunk_tile", "must be >= 1")
        _check(self.max_num_batched_tokens_cap >= 1, "max_num_batched_tokens_cap", "must be >= 1")
        _check(
            self.max_num_batched_tokens >= self.chunk_tile,
            "max_num_batched_tokens",
            f"must be at least chunk_tile ({self.chunk_tile})",
        )
        _check(self.max_prefill_chunks >= 1, "max_prefill_chunks", "must be >= 1")
        _check(self.long_prefill_threshold >= 0, "long_prefill_threshold", "must be >= 0")
        _check(self.mixed_step_prefill_tokens == 0
               or self.mixed_step_prefill_tokens >= self.chunk_tile, "mixed_step_prefill_tokens",
               f"must be 0 (off) or at least chunk_tile ({self.chunk_tile})")
        _check(self.cadence_min_decodes >= 0, "cadence_min_decodes", "must be >= 0 (0: off)")
        _check_period(self.cadence_max_wait_ms * 1e-3, "cadence_max_wait_ms")
        _check(
            0 < self.cache_low_watermark < self.cache_high_watermark < 1,
            "cache_low_watermark" if self.cache_low_watermark <= 0 else "cache_high_watermark",
            "need 0 < cache_low_watermark < cache_high_watermark < 1",
        )
        _check(
            0 < self.bandwidth_throttle_2 < self.bandwidth_throttle_1 < self.bandwidth_pause <= 1,
            "bandwidth_throttle_2",
            "need 0 < bandwidth_throttle_2 < bandwidth_throttle_1 < bandwidth_pause <= 1",
        )
        _check_period(self.bandwidth_pause_s, "bandwidth_pause_s")
        _check(0 < self.slow_query_threshold < float("inf"), "slow_query_threshold",
               "must be a finite number > 0")
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            _check_period(getattr(self, name) * 1e-3, name, "no SLO")
        _check_period(self.slow_query_min_overrun_ms * 1e-3, "slow_query_min_overrun_ms",
                      "the ratio alone decides")
        _check_period(self.stats_window_s, "stats_window_s", zero=False)
        _check(self.max_prefill_tokens >= 0, "max_prefill_tokens", "must be >= 0")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
               "must be a number of tokens >= 1, or unset for the model's length")
        _check_period(self.chunk_timeout_base_ms * 1e-3, "chunk_timeout_base_ms", "no timeout")
        _check_period(self.guard_window_s, "guard_window_s", zero=False)
        _check(0 < self.defrag_threshold <= 1, "defrag_threshold", "must be in (0, 1]")
        _check_period(self.defrag_interval_s, "defrag_interval_s", "no limit")
        _check(self.preempt_protect_after >= 1, "preempt_protect_after", "must be >= 1")
        for tenant, share in self.tenant_shares.items():
            _check(0 < share <= 1, "tenant_shares", f"share of {tenant!r} must be in (0, 1]")
        for tenant, rank in self.tenant_priorities.items():
            _check(isinstance(rank, int) and not isinstance(rank, bool), "tenant_priorities",
                   f"priority of {tenant!r} must be an integer, got {rank!r}")
        _check_period(self.auto_tpot_ms * 1e-3, "auto_tpot_ms", "C* alone")
        _check(self.cpu_threads >= 0, "cpu_threads", "must be >= 0 (0 = all cores but one)")
        _check(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode",
               "must be raw_logprobs or processed_logprobs (vLLM's raw_logits and "
               "processed_logits modes are not built)")
        _check(self.attention_backend in ("auto", "torch", "flash", "flex", "paged"),
               "attention_backend", "must be auto, torch, flash, flex or paged")
        _check(not (self.cpu_graphs and self.attention_backend in ("torch", "flash", "flex")),
               "cpu_graphs", "replays the CPU kernels' calls; it needs attention_backend "
                             "auto or paged (or drop cpu_graphs)")

    def budget_ceiling(self) -> int:
        """The most tokens a live change may give a step: the cap, or the start's budget where
        that is larger. A GPU's KV pool leaves room for a step this large."""
        return max(self.max_num_batched_tokens_cap, self.max_num_batched_tokens)

    def live_values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in sorted(LIVE_FIELDS)}

    def slo_breaches(self, ttft_s: float | None, worst_itl_s: float | None) -> tuple[str, ...]:
        """Which of the operator's SLOs a request's TTFT and worst gap between tokens broke."""
        rules = []
        if self.slo_ttft_ms and ttft_s is not None and ttft_s * 1e3 > self.slo_ttft_ms:
            rules.append(SLO_TTFT_RULE)
        if self.slo_itl_ms and worst_itl_s is not None and worst_itl_s * 1e3 > self.slo_itl_ms:
            rules.append(SLO_ITL_RULE)
        return tuple(rules)

    def is_slow_query(self, prefill_s: float, budget_s: float) -> bool:
        """Whether a prefill of `prefill_s` against a plan of `budget_s` is a slow query."""
        return (prefill_s / budget_s > self.slow_query_threshold
                and (prefill_s - budget_s) * 1e3 >= self.slow_query_min_overrun_ms)


# The rules that store a slow query, as its record names them.
BUDGET_RULE = "budget_score"
SLO_TTFT_RULE = "ttft_slo"
SLO_ITL_RULE = "itl_slo"

LIVE_FIELDS = frozenset(
    f.name
    for f in dataclasses.fields(EngineConfig)
    if f.name not in {"model", "device", "dtype", "seed", "block_size", "kv_cache_bytes",
                      "gpu_memory_utilization", "max_model_len", "max_num_seqs",
                      "max_num_batched_tokens_cap",
                      "attention_backend", "cpu_threads", "stats_window_s", "compile",
                      "cpu_graphs", "logprobs_mode"}
)

# The defaults as one value: widgets fall back to it for fields an older snapshot lacks.
DEFAULTS = EngineConfig()


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(field_name, message)


# The longest window, interval, timeout, pause or latency target a setting may name: past a
# day none acts within a run, and inf left a pause that never ended and a window never trimmed.
MAX_PERIOD_S = 86_400.0


def _check_period(seconds: float, field_name: str, off: str = "", zero: bool = True) -> None:
    """`seconds` (the field's value, converted from ms where its name ends _ms) within [0, a
    day], or (0, a day] when not `zero`; `off` says what 0 means."""
    if not ((seconds >= 0 if zero else seconds > 0) and seconds <= MAX_PERIOD_S):  # nan: never
        unit, scale = ("milliseconds", 1e3) if field_name.endswith("_ms") else ("seconds", 1)
        raise ConfigError(field_name, f"must be a number of {unit} in {'[' if zero else '('}0, "
                          f"{MAX_PERIOD_S * scale:,.0f}], a day at most"
                          + (f" (0: {off})" if off else ""))


def _coerce(name: str, value: Any) -> Any:
    """Accept values from forms and JSON ("512", 0.9) but reject nonsense with the field named."""
    target = {f.name: f.type for f in dataclasses.fields(EngineConfig)}[name]
    try:
        if target == "int" and not isinstance(value, bool):
            return _whole(value)
        if target == "float" and not isinstance(value, bool):
            return float(value)
        if target.startswith("dict") and isinstance(value, dict):
            return dict(value)
        if target == "bool" and isinstance(value, bool | int | str):
            return _as_bool(value)
    except (TypeError, ValueError, OverflowError):
        pass
    else:
        if not (target in ("int", "float", "bool") or target.startswith("dict")):
            return value
    raise ConfigError(name, f"expected {target}, got {value!r}")


def _whole(value: Any) -> int:
    """An integer from an int, a decimal string or an integral float, never rounded via a float."""
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            value = float(value)
    if not isinstance(value, float):
        return operator.index(value)
    if not value.is_integer() or abs(value) > 2**53:
        raise ValueError
    return int(value)


def _as_bool(value: bool | int | str) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)
