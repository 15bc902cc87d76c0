"""The engine's snapshot: its state, queues, KV pool and recommendations at one instant."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from engine.budget.auto import token_budget_for
from engine.budget.peaks import DevicePeaks
from engine.clock import Clock
from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.equipment import BandwidthSource, Guard, HostSense, Metrics
from engine.core.executor import Executor
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.events import wall_offset
from engine.snapshot import RequestView, Snapshot

if TYPE_CHECKING:
    from engine.core.model_runner import ModelRunner


class Engine(Protocol):
    """What a snapshot reads of an engine (the Engine class imports this module)."""

    clock: Clock
    config: EngineConfig
    scheduler: Scheduler
    runner: ModelRunner | Executor
    blocks: BlockManager
    block_bytes: int
    peaks: DevicePeaks
    bandwidth: BandwidthSource
    host: HostSense
    guards: Guard
    metrics: Metrics

    @property
    def calibrated(self) -> bool: ...


def snapshot(engine: Engine) -> Snapshot:
    """What the engine is doing now, for the UI, the API and the metrics."""
    now = engine.clock()
    s = engine.scheduler
    live = list(s.requests.values())
    cstar = s.controller.cstar
    chunk = s.controller.recommended_chunk(now, *s.decode_load(), engine.config)
    reading = engine.bandwidth.reading()
    host = engine.host.latest
    return Snapshot(
        ts=now, wall_offset=wall_offset(), model=engine.config.model,
        device=str(engine.runner.device),
        mode=s.mode.value, step=s.steps,
        mode_reason=_mode_reason(engine), config=engine.config.live_values(),
        requests=tuple(_view(r, engine.config.max_num_batched_tokens)
                       for r in [*s.recent, *live]),
        num_running=len(s.running), num_waiting=len(s.waiting),
        chunk_queue_length=s.chunk_queue_length,
        kv_usage=engine.blocks.usage, kv_blocks_used=engine.blocks.num_used,
        kv_blocks_total=engine.blocks.num_blocks,
        kv_fragmentation=engine.blocks.fragmentation(live),
        kv_compactions_total=engine.blocks.compactions,
        kv_blocks_moved_total=engine.blocks.blocks_moved,
        kv_block_size=engine.blocks.block_size,  # flash-attn forces its own
        kv_bytes_total=float(engine.blocks.num_blocks * engine.block_bytes),
        bandwidth_bytes_per_s=reading.util_5s * engine.peaks.bandwidth,
        bandwidth_util_5s=reading.util_5s, bandwidth_source=reading.source,
        bandwidth_note=reading.note,
        throttle_level=s.throttle_level, throttle_note=s.modes.throttle_note,
        host_contended=host.contended, host_others_cpus=host.others_cpus,
        host_steal=host.steal, host_own_cpus=host.own_cpus, host_measured=host.measured,
        host_others_gpu=host.others_gpu, host_gpu_others=host.gpu_others,
        slow_queries_unstored=s.watch.unstored,
        calibration="calibrated" if engine.calibrated else "calibrating",
        recommended_chunk_size=chunk,
        recommended_chunk_unclamped=None if chunk is None else cstar.unclamped,
        recommended_token_budget=None if chunk is None else token_budget_for(
            max(cstar.unclamped or chunk, engine.config.chunk_tile), cstar.decodes,
            engine.config.chunk_tile),
        recommended_decodes=None if chunk is None else cstar.decodes,
        token_budget=s.token_budget,
        faults_isolated_total=engine.guards.faults_isolated,
        kv_blocks_cached=engine.blocks.num_cached,
        guards=engine.guards.engaged(),
        **engine.metrics.snapshot_fields(now),
    )


def _mode_reason(engine: Engine) -> str:
    s = engine.scheduler
    if s.cache_pressure:
        return (f"KV usage {engine.blocks.usage:.0%} reached the high watermark "
                f"{engine.config.cache_high_watermark:.0%}; decodes only")
    if s.throttle_level:
        return (f"bandwidth 5 s average {s.bandwidth_util:.0%}: "
                f"throttle level {s.throttle_level}")
    return ""


def _view(request: Request, budget: int) -> RequestView:
    chunk = max(1, budget)
    done = len(request.chunks)
    # the chunks still to run: a prompt the prefix cache covered needs none
    left = max(0, request.num_prompt_tokens - request.num_computed_tokens)
    return RequestView(
        id=request.id, tenant=request.tenant, state=request.state.value, reason=request.reason,
        prompt_tokens=request.num_prompt_tokens,
        prefilled_tokens=min(request.num_computed_tokens, request.num_prompt_tokens),
        chunks_done=done, chunks_total=done + -(-left // chunk),
        generated_tokens=len(request.output_token_ids), cached_tokens=request.cached_tokens,
        ttft_ms=None if request.ttft_s is None else request.ttft_s * 1000,
        tpot_ms=None if request.tpot_s is None else request.tpot_s * 1000,
        budget_score=request.budget_score, arrival_s=request.arrival, kind=request.kind,
        resumed_tokens=request.resumed_tokens)
