"""The snapshot: one immutable picture of the engine, plain data that round-trips through JSON;
and the one wording of a request's prompt that every view of it uses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestView:
    id: str
    tenant: str
    state: str
    reason: str
    prompt_tokens: int
    prefilled_tokens: int
    chunks_done: int
    chunks_total: int
    generated_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    budget_score: float | None
    arrival_s: float
    cached_tokens: int = 0
    kind: str = "generate"
    resumed_tokens: int | None = None  # output tokens it had when resumed; None: never was

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prompt_words(prompt_tokens: int, cached_tokens: int | None,
                 resumed_tokens: int | None = None) -> str:
    """A request's prompt in the one wording every view uses: its tokens, those cached (None:
    unknown) and the output tokens a journal resume brought back (None: not resumed)."""
    words = f"{prompt_tokens} prompt tokens"
    if cached_tokens == 0:
        words += ", none found in the prefix cache"
    elif cached_tokens is not None:
        share = cached_tokens / prompt_tokens if prompt_tokens else 0.0
        words += f", {cached_tokens} ({share:.0%}) found in the prefix cache, never prefilled"
    if resumed_tokens is not None:
        words += "; resumed from the journal after a restart"
        if resumed_tokens:
            words += (f" with {resumed_tokens} output tokens already generated, prefilled "
                      "again with its prompt")
    return words


@dataclass(frozen=True)
class Percentiles:
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


@dataclass(frozen=True)
class Snapshot:
    """docs/contracts.md says what each field means."""

    ts: float = 0.0
    wall_offset: float | None = None
    model: str = ""
    device: str = ""
    mode: str = "NORMAL"
    mode_reason: str = ""
    paused: bool = False
    engine_restarts: int = 0
    engine_fault: str = ""
    workload_rate: float | None = None
    step: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    requests: tuple[RequestView, ...] = ()
    num_running: int = 0
    num_waiting: int = 0
    chunk_queue_length: int = 0
    kv_usage: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_fragmentation: float = 0.0
    kv_compactions_total: int = 0
    kv_blocks_moved_total: int = 0
    bandwidth_util_5s: float = 0.0
    bandwidth_source: str = "model"
    throttle_level: int = 0  # 0 none, 1 concurrency 2, 2 concurrency 1, 3 prefills paused
    throttle_note: str = ""  # why the throttle may not act now ("" when it may)
    # the host around the last step: other processes' CPUs, steal, this process's CPUs
    host_contended: bool = False
    host_others_cpus: float = 0.0
    host_steal: float = 0.0
    host_own_cpus: float = 0.0
    host_measured: bool = False  # False: no reading yet, or a simulated device
    host_others_gpu: float = 0.0  # other processes' share of the GPU's SM time (NVML)
    host_gpu_others: str = ""  # who else computes on the GPU; "": not read (no GPU, no NVML)
    tokens_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    stats_window_s: float = 60.0
    ttft_ms: Percentiles = Percentiles()
    tpot_ms: Percentiles = Percentiles()
    itl_ms: Percentiles = Percentiles()
    queue_wait_ms: Percentiles = Percentiles()
    step_ms: Percentiles = Percentiles()
    calibration: str = ""
    # a calibration copied from another store, with where it was measured ("" otherwise)
    calibration_reused: str = ""
    recommended_chunk_size: int | None = None
    recommended_chunk_unclamped: int | None = None
    recommended_token_budget: int | None = None
    recommended_decodes: int | None = None
    token_budget: int = 0
    preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    requests_rejected_total: int = 0
    requests_failed_total: int = 0
    faults_isolated_total: int = 0
    slow_queries_total: int = 0
    slow_queries_unstored: int = 0  # SLO breaches sampled out (stored rows say how many)
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prefix_cache_hit_rate: float | None = None
    kv_blocks_cached: int = 0
    guards: tuple[str, ...] = ()
    window_s: float = 0.0
    step_tokens: Percentiles = Percentiles()
    kv_block_size: int = 0
    kv_bytes_total: float = 0.0
    bandwidth_bytes_per_s: float | None = None
    bandwidth_note: str = ""
    score_estimate: str = ""
    score_note: str = ""
    # a simulated engine's figures against the published GPU cases nearest its traffic
    twin_trust: str = ""

    @property
    def arrived(self) -> int:
        """Requests that have entered the engine: those done, refused or failed, and those in
        it."""
        return (self.requests_finished_total + self.requests_rejected_total
                + self.requests_failed_total + self.num_running + self.num_waiting)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Snapshot:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["requests"] = tuple(RequestView(**r) for r in values.get("requests", ()))
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "queue_wait_ms", "step_ms", "step_tokens"):
            if isinstance(values.get(name), dict):
                values[name] = Percentiles(**values[name])
        values["guards"] = tuple(values.get("guards", ()))
        return cls(**values)
