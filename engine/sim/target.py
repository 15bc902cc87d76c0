"""What a simulated engine stands for, resolved from a `--simulate` spec (see docs/twin.md)."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.batch import StepShape
from engine.budget.cost_model import BudgetModel
from engine.budget.operations import Link, StepPrice
from engine.budget.peaks import DevicePeaks
from engine.budget.predictor import StepTimePredictor
from engine.calibration.served import ServedCosts
from engine.config import ConfigError, EngineConfig
from engine.model.config import ModelConfig
from engine.model.loader import model_config_for
from engine.sim.profiles import (
    GIB,
    KV_BYTES,
    PROFILES,
    WEIGHT_BYTES,
    GpuProfile,
    profile,
    profile_for_device_name,
    weight_kind,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from engine.store.calibration import CalibrationRecord

# vLLM's KV pool (V1, v0.11: vllm/v1/worker/gpu_worker.py, determine_available_memory) is each
# GPU's memory times gpu_memory_utilization, less what its profile run measured: the weights,
# the activation peak and the memory outside torch's allocator (NON_TORCH_BYTES, the figure
# vLLM logged in vllm-project/vllm#13061). The CUDA context and the CUDA graphs, captured after
# the pool is sized, live in the share the utilisation leaves.
NON_TORCH_BYTES = 256 << 20
# The profile run's sampler (gpu_model_runner._dummy_sampler_run) holds one row of logits per
# sequence in bf16, then at float32 the logits, the probabilities and the exponential draw
# it divides them by in place (v1/sample/sampler.py, ops/topk_topp_sampler.py), on every GPU.
SAMPLER_BYTES_PER_LOGIT = 2 + 3 * 4
GPU_DTYPE = "bfloat16"
CALIBRATION_PREFIX = "calibration:"

Predict = Callable[[StepShape], float]


class StepTimeRatios(NamedTuple):
    """Measured over predicted step time, with a prefill chunk and decode-only: they drift apart."""

    prefill: float
    decode: float


@dataclass(frozen=True)
class SimTarget:
    """A simulated device: how it is labelled, how fast it is, how much KV it holds."""

    spec: str
    device: str
    dtype: str
    peaks: DevicePeaks
    kv_cache_bytes: int
    predict: Predict = field(repr=False, compare=False)
    source: str
    calibration: StepTimePredictor | None = None
    served: ServedCosts | None = None
    details: dict[str, Any] = field(default_factory=dict)
    device_type: str = "sim"
    # steps take these times their predictions while the engine predicts the fit's (a drifted host)
    drift: StepTimeRatios | None = None
    kv_bytes_per_element: int | None = None
    # the shape the executor sizes KV and tokens by, where not the engine config's model
    model_config: ModelConfig | None = field(default=None, repr=False, compare=False)

    @property
    def predictor(self) -> str:
        return "roofline" if self.calibration is None else "calibrated"

    @property
    def no_band(self) -> str | None:
        """Why the published cases' errors do not bound this twin: the user's profile file
        changed what the shipped profile priced them with (None: it did not)."""
        own = self.details.get("own_profile")
        if own is None:
            return None
        if self.spec.lower() not in PROFILES:
            return f"{own} defines {self.spec}, a GPU no published case was measured on"
        return f"{own} changes the {self.spec} profile the cases' errors were measured with"

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec, "device": self.device, "predictor": self.predictor,
                "source": self.source, "peak_flops": self.peaks.flops,
                "peak_bandwidth": self.peaks.bandwidth, "kv_cache_bytes": self.kv_cache_bytes,
                "served": None if self.served is None else self.served.to_dict(),
                **({} if self.drift is None else {"drift": self.drift._asdict()}),
                **self.details}


@dataclass(frozen=True)
class Deployment:
    """`config` with `weight_dtype` weights and `kv_dtype` KV, split evenly over `tp` GPUs."""

    config: ModelConfig
    gpu: GpuProfile
    tp: int = 1
    weight_dtype: str = GPU_DTYPE
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        c = self.config
        if self.tp < 1 or c.num_heads % self.tp or c.num_kv_heads % self.tp:
            raise ConfigError("tp", f"must be >= 1 and divide the model's {c.num_heads} "
                              f"attention and {c.num_kv_heads} KV heads, got {self.tp}")
        if self.weight_dtype not in WEIGHT_BYTES:
            raise ConfigError("dtype", f"{self.weight_dtype!r} is not supported on a simulated "
                              f"GPU; choose {', '.join(WEIGHT_BYTES)}")
        if self.kv_dtype not in KV_BYTES:
            raise ConfigError("kv_cache_dtype", f"{self.kv_dtype!r} is not supported; choose "
                              f"{', '.join(KV_BYTES)}")
        self.gpu.peak_flops(self.weight_dtype)

    @property
    def activation_bytes(self) -> int:
        """Activations run at bf16 whatever the weights (fp32 runs in fp32)."""
        return 4 if self.weight_dtype == "float32" else 2

    @property
    def kv_bytes_per_element(self) -> int:
        return KV_BYTES[self.kv_dtype] or self.activation_bytes

    @property
    def budget(self) -> BudgetModel:
        return BudgetModel(self.config, self.activation_bytes, self.peaks,
                           weight_bytes_per_element=WEIGHT_BYTES[self.weight_dtype],
                           kv_bytes_per_element=self.kv_bytes_per_element)

    @property
    def weight_bytes(self) -> int:
        """Every weight, the embeddings included: what the GPUs' memory holds."""
        return self.config.num_params(include_embeddings=True) * WEIGHT_BYTES[self.weight_dtype]

    @property
    def peaks(self) -> DevicePeaks:
        one = self.gpu.peaks(self.weight_dtype)
        return DevicePeaks(f"{one.name}x{self.tp}" if self.tp > 1 else one.name,
                           one.flops * self.tp, one.bandwidth * self.tp, one.source)

    def activation_peak_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Each GPU's peak in vLLM's profile run: a forward over `max_num_batched_tokens`
        (the residual stream, QKV, the MLP's gate-up and its activation live at once), or the
        sampler over min(tokens, seqs) rows of logits, whichever is larger."""
        c, tp = self.config, self.tp
        width = (2 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim // tp
                 + 3 * c.intermediate_size // tp)
        forward = max_num_batched_tokens * width * self.activation_bytes
        rows = min(max_num_batched_tokens, max_num_seqs)
        return max(forward, rows * c.vocab_size * SAMPLER_BYTES_PER_LOGIT)

    def kv_cache_bytes(self, memory_utilization: float, max_num_batched_tokens: int,
                       max_num_seqs: int) -> int:
        """KV over all GPUs, sized as vLLM sizes it (NON_TORCH_BYTES says where from)."""
        share = self.gpu.memory_bytes * memory_utilization
        weights = self.weight_bytes / self.tp
        activations = self.activation_peak_bytes(max_num_batched_tokens, max_num_seqs)
        free = share - weights - activations - NON_TORCH_BYTES
        if free <= 0:
            # the weights alone may fit: then the profile run's activations are the fix's
            too_big = weights + NON_TORCH_BYTES >= share
            fix = ("raise --tp" if too_big else
                   f"lower --max-num-batched-tokens ({max_num_batched_tokens:,}), or raise --tp")
            # a share the user lowered is the first fix where the whole GPU would hold them
            if self.gpu.memory_bytes - weights - activations - NON_TORCH_BYTES > 0:
                fix = (f"raise --gpu-memory-utilization ({memory_utilization:g}), "
                       f"{'or ' if too_big else ''}{fix}")
            raise ConfigError("tp" if too_big else "max_num_batched_tokens",
                              f"{self.weight_bytes / 1e9:.1f} GB of weights and "
                              f"{activations / 1e9:,.1f} GB of activations a GPU do not fit in "
                              f"{memory_utilization:.0%} of {self.tp} x {self.gpu.name} "
                              f"({self.gpu.memory_bytes / 1e9:.0f} GB each); {fix}")
        return int(free) * self.tp

    def step_price(self) -> StepPrice:
        attention = self.gpu.peak_flops(
            "float32" if self.weight_dtype == "float32" else "bfloat16") * self.tp
        return StepPrice(self.budget, self.peaks, self.gpu.efficiency,
                         Link(self.tp, self.gpu.interconnect.bandwidth), attention,
                         weight_kind(self.weight_dtype))

    def predictor(self) -> Predict:
        """Step seconds: each operation on its own roofline, summed, plus the fixed cost."""
        return self.step_price().predict


def needs_store(spec: str) -> bool:
    """Whether `spec` names a stored calibration (a named GPU needs no store)."""
    spec = spec.strip()
    return spec == "this" or spec.startswith(CALIBRATION_PREFIX)


def resolve_target(spec: str, config: EngineConfig, *, tp: int = 1,
                   session: Session | None = None, kv_cache_dtype: str = "auto",
                   gpu_profile: Path | None = None) -> SimTarget:
    """The SimTarget a `--simulate` spec names, with `gpu_profile` over a named GPU's profile."""
    spec = spec.strip()
    if needs_store(spec):
        _require_single(tp, spec)
        if kv_cache_dtype != "auto" or gpu_profile is not None:
            raise ConfigError("simulate", f"--kv-cache-dtype and --gpu-profile apply to a "
                              f"named GPU, not {spec!r}: the calibration measured its own")
        session = _need(session, spec)
        return _this(config, session) if spec == "this" else _stored(spec, config, session)
    return _gpu_roofline(spec, config, tp, kv_cache_dtype, gpu_profile)


def _gpu_roofline(spec: str, config: EngineConfig, tp: int, kv_dtype: str,
                  profile_file: Path | None) -> SimTarget:
    dtype = GPU_DTYPE if config.dtype == "auto" else config.dtype
    gpu = profile(spec, profile_file)
    deployment = Deployment(model_config_for(config.model), gpu, tp, dtype, kv_dtype)
    target = deployment_target(deployment, config, spec)
    _require_one_longest_request(deployment, config, target.kv_cache_bytes)
    shipped = PROFILES.get(spec.lower())
    if profile_file is not None and (shipped is None or _priced(gpu) != _priced(shipped)):
        target.details["own_profile"] = str(profile_file)
    return target


def _require_one_longest_request(deployment: Deployment, config: EngineConfig,
                                 kv_bytes: int) -> None:
    """vLLM will not start a server whose KV pool cannot hold one request of its context
    length (v0.11, vllm/v1/core/kv_cache_utils.py, check_enough_kv_cache_memory): nor does
    a named GPU's twin, which would otherwise simulate a server nobody can run."""
    per_token = deployment.budget.kv_bytes_per_token
    per_block = per_token * config.block_size
    holds = kv_bytes // per_block * config.block_size
    longest = config.context_length(deployment.config.max_position_embeddings)
    if longest <= holds:
        return
    given = ("--max-model-len" if config.max_model_len else
             "the model's max_position_embeddings, with no --max-model-len")
    if config.kv_cache_bytes:
        pool = f"--kv-cache-bytes {config.kv_cache_bytes:,} hold {kv_bytes / GIB:.2f} GiB"
        fixes = ["raise --kv-cache-bytes"]
    else:
        pool = (f"{deployment.tp} x {deployment.gpu.name} at gpu_memory_utilization "
                f"{config.gpu_memory_utilization:g} leave {kv_bytes / GIB:.2f} GiB after the "
                f"weights and activations")
        fixes = ["raise --gpu-memory-utilization", "raise --tp"]
    if holds:  # no length fits a pool of no block
        fixes.insert(0, f"pass --max-model-len {holds} or less")
    *others, last = fixes
    said = f"{', '.join(others)}, or {last}" if others else last
    raise ConfigError("max_model_len", (
        f"one request of {longest:,} tokens ({given}) needs {longest * per_token / GIB:.2f} GiB "
        f"of KV; {pool}, {holds:,} tokens, and vLLM would not start. {said[0].upper()}{said[1:]}"))


def _priced(gpu: GpuProfile) -> dict[str, Any]:
    """What of a profile sets a step's price (not its name or its sources' words)."""
    data = gpu.to_dict()
    return {k: data[k] for k in ("memory_bytes", "bandwidth", "flops", "efficiency")} | {
        "link": data["interconnect"]["bandwidth"]}


def deployment_target(deployment: Deployment, config: EngineConfig, spec: str) -> SimTarget:
    """The simulated GPU(s) of `deployment`, its KV pool sized as `config` asks."""
    gpu, tp, dtype, kv_dtype = (deployment.gpu, deployment.tp, deployment.weight_dtype,
                                deployment.kv_dtype)
    kv = config.kv_cache_bytes or deployment.kv_cache_bytes(
        config.gpu_memory_utilization, config.max_num_batched_tokens, config.max_num_seqs)
    details: dict[str, Any] = {
        "gpu": gpu.name, "tp": tp, "gpu_memory_bytes": gpu.memory_bytes,
        "weight_dtype": dtype, "kv_cache_dtype": kv_dtype,
        "weight_bytes": deployment.weight_bytes,
        "kv_bytes_per_token": deployment.budget.kv_bytes_per_token,
        "efficiency": gpu.efficiency.to_dict(), "efficiency_source": gpu.efficiency_source,
    }
    if tp > 1:
        link = gpu.interconnect
        details["interconnect"] = {"name": link.name, "bandwidth": link.bandwidth,
                                   "allreduce_latency_s": gpu.efficiency.allreduce_s,
                                   "source": link.source, "allreduces_per_layer": 2}
    label = f"sim:{gpu.key}" + (f"x{tp}" if tp > 1 else "")
    e = gpu.efficiency
    return SimTarget(spec=spec, device=label, dtype=dtype, peaks=deployment.peaks,
                     kv_cache_bytes=kv, predict=deployment.predictor(),
                     source=(f"{deployment.peaks.source} peaks per operation (GEMMs "
                             f"{e.gemm_flops:.0%} FLOP/s, attention {e.attention_flops:.0%}, "
                             f"streaming {e.memory:.0%} bandwidth, elementwise "
                             f"{e.elementwise:.0%}, {e.step_s * 1e3:.2f} ms a step; "
                             f"{gpu.efficiency_source}) for {config.model}"),
                     details=details, kv_bytes_per_element=deployment.kv_bytes_per_element,
                     model_config=deployment.config)


def _this(config: EngineConfig, session: Session) -> SimTarget:
    # the model runner and the store: only a calibrated twin needs them
    from engine.calibration.calibrate import device_key, latest_stored
    from engine.core.model_runner import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    dtype = str(resolve_dtype(config.dtype, device)).removeprefix("torch.")
    # stored as calibrate stores it: on CUDA by the GPU's model, which "cuda:0" never matched
    key = device_key(device)
    record = latest_stored(session, model=config.model, device=key, dtype=dtype)
    if record is None:
        raise ConfigError("simulate", f"no calibration stored for {config.model} on {key} "
                          f"({dtype}); run `tokenflow calibrate --model {config.model}` first")
    return _calibrated("this", record, config)


def _stored(spec: str, config: EngineConfig, session: Session) -> SimTarget:
    from engine.store.calibration import calibration_history

    text = spec.removeprefix(CALIBRATION_PREFIX)
    if not text.isdigit():
        raise ConfigError("simulate", f"{spec!r}: expected calibration:ID with a numeric id "
                          "(`tokenflow calibrate --history` lists them)")
    record = next((r for r in calibration_history(session) if r.id == int(text)), None)
    if record is None:
        raise ConfigError("simulate", f"no stored calibration with id {text} "
                          "(`tokenflow calibrate --history` lists them)")
    if record.model != config.model:
        raise ConfigError("simulate", f"calibration {text} was measured on {record.model}, "
                          f"not {config.model}; pass --model {record.model}")
    return _calibrated(spec, record, config)


def _calibrated(spec: str, record: CalibrationRecord, config: EngineConfig) -> SimTarget:
    """The twin a stored calibration makes, whether `this` or its id names it: its predictor
    prices each step, against the peaks it measured, on the device it ran on."""
    predictor = StepTimePredictor.from_dict(record.params)
    info = record.info
    peaks = DevicePeaks(**info["peaks"])
    known = profile_for_device_name(peaks.name)
    if config.kv_cache_bytes is not None:
        kv = config.kv_cache_bytes
    elif known is not None:
        deployment = Deployment(model_config_for(config.model), known,
                                weight_dtype=info["dtype"])
        kv = deployment.kv_cache_bytes(config.gpu_memory_utilization,
                                       config.max_num_batched_tokens, config.max_num_seqs)
    else:
        kv = int(info["kv"]["capacity_bytes"])
    return SimTarget(spec=spec, device=f"sim:{record.device}", dtype=info["dtype"], peaks=peaks,
                     kv_cache_bytes=kv, predict=predictor.predict, calibration=predictor,
                     served=_served(info),
                     source=_calibration_source(record.id, record.created_at, predictor),
                     details={"calibration_id": record.id, "calibrated_device": peaks.name},
                     # a CPU's twin takes a CPU run's defaults (its workloads' lengths)
                     device_type="cpu" if record.device == "cpu" else "sim")


def _served(info: dict[str, Any]) -> ServedCosts | None:
    """A calibration's served costs; none where it served no probe."""
    served = info.get("served")
    return None if served is None else ServedCosts.from_dict(served)


def _calibration_source(record_id: int, created_at: float, predictor: StepTimePredictor,
                        ) -> str:
    when = datetime.datetime.fromtimestamp(created_at, datetime.UTC).strftime("%Y-%m-%d %H:%M")
    return (f"calibration {record_id} stored {when} UTC ({predictor.source}, "
            f"{predictor.points} steps)")


def _require_single(tp: int, spec: str) -> None:
    if tp != 1:
        raise ConfigError("tp", f"--tp applies to a named GPU's roofline, not {spec!r}; "
                          "drop --tp or simulate a named GPU (e.g. h100)")


def _need(session: Session | None, spec: str) -> Session:
    if session is None:
        raise ConfigError("simulate", f"{spec!r} reads a stored calibration; give a --db")
    return session
