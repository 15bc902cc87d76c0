"""The snapshot: one immutable picture of the engine, what the console and /v1/stats render.

It is plain data (numbers, strings, tuples of small dataclasses) so it crosses HTTP as JSON
and back without loss: `Snapshot.from_dict(s.to_dict()) == s`.
"""

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
    cached_tokens: int = 0  # prompt tokens its latest admission found in the prefix cache
    kind: str = "generate"  # or "chat" (a chat completion) or "score" (prefill only)

    @property
    def cached_share(self) -> float:
        """The share of its prompt found in the prefix cache, 0..1."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class Percentiles:
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


@dataclass(frozen=True)
class Snapshot:
    ts: float = 0.0
    # wall-clock time minus ts where the snapshot was taken (engine.events.wall_offset): places
    # the store's wall-clock rows on this timeline; None in recordings made before it existed
    wall_offset: float | None = None
    model: str = ""
    device: str = ""
    mode: str = "NORMAL"
    mode_reason: str = ""
    paused: bool = False
    engine_restarts: int = 0  # times a fault in its steps restarted the engine (serve loop)
    engine_fault: str = ""  # the last such fault and where it was raised
    # requests/s the embedded console's own traffic arrives at; None: it plays none, or none
    # with a rate (sent all at once)
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
    kv_compactions_total: int = 0  # protection layer 3's compactions of the KV pool
    kv_blocks_moved_total: int = 0
    bandwidth_util_5s: float = 0.0
    bandwidth_source: str = "model"
    throttle_level: int = 0  # 0 none, 1 concurrency 2, 2 concurrency 1, 3 prefills paused
    tokens_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    # latency percentiles over the last stats_window_s seconds (not the process's lifetime)
    stats_window_s: float = 60.0
    ttft_ms: Percentiles = Percentiles()
    tpot_ms: Percentiles = Percentiles()
    itl_ms: Percentiles = Percentiles()
    queue_wait_ms: Percentiles = Percentiles()  # arrival to admission
    step_ms: Percentiles = Percentiles()
    # "calibrating" until the engine's first calibration (no C* or budget_score before it),
    # then "calibrated"; "" from a source that does not say
    calibration: str = ""
    recommended_chunk_size: int | None = None  # C* for the smoothed decode load
    # C* before its clamp to [chunk_tile, max_num_batched_tokens]: the roofline's own answer
    recommended_chunk_unclamped: int | None = None
    # the budget `c` sets: the unclamped C* (at least a tile) plus one token for each of
    # recommended_decodes (the smoothed decode load C* was set from), in whole tiles
    recommended_token_budget: int | None = None
    recommended_decodes: int | None = None
    token_budget: int = 0  # this step's budget (differs from the config under auto_budget)
    preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    requests_rejected_total: int = 0
    requests_failed_total: int = 0
    faults_isolated_total: int = 0  # failed alone by an error of their own (guard layer 7)
    slow_queries_total: int = 0
    # vLLM's meaning: tokens looked up in the prefix cache at admission, and those found
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prefix_cache_hit_rate: float | None = None  # hits / queries over the recent window
    kv_blocks_cached: int = 0  # blocks registered in the prefix cache (in use or free)
    guards: tuple[str, ...] = ()  # protection layers engaged now
    # Attached servers (vLLM, SGLang) report cumulative counters: the console differences them
    # over `window_s` seconds (0: the engine's own windows, or not enough history yet).
    window_s: float = 0.0
    step_tokens: Percentiles = Percentiles()  # tokens per engine step over the window
    kv_block_size: int = 0  # tokens per KV block; 0 when unknown
    kv_bytes_total: float = 0.0  # bytes the KV cache holds at most; 0 when unknown
    bandwidth_bytes_per_s: float | None = None
    bandwidth_note: str = ""  # why the bandwidth share cannot be shown, when it cannot
    prefix_cache_hit_rate: float | None = None
    # what traced requests' budget scores divide by ("roofline", "calibration 3"); "" when
    # the source's scores are its own engine's
    score_estimate: str = ""
    score_note: str = ""  # why budget scores are missing ("–"), and the flags that fill them

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
