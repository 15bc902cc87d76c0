"""The protection layers of seed 000 §6 around the engine step, each a GuardAction when it acts.

1 breaker        a prompt over max_prefill_tokens × 1.2 was rejected within guard_window_s
2 throttle       the scheduler's bandwidth throttle level is above 0
3 defrag         KV fragmentation over defrag_threshold: the pool is compacted (and, on CUDA,
                 torch's cache emptied) at most every defrag_interval_s
4 chunk_timeout  a prefill chunk ran over base × (1 + 0.1 × chunk index): its request fails with
                 the reason and its KV blocks go back; the others go on
5 drift          the drift detector published a Drift event within guard_window_s
6 degraded       layers 1-4 all engaged: one prefill at a time in chunk_tile-sized chunks while
                 decodes go on (`scheduler.prefill_paused`), so the service never stops

Layer 7 (chaos) is `engine.harness.chaos`. Hand-over: every layer is evaluated at each step
boundary and whenever an event reports a fault, and layers are set in order within one
evaluation, so the layer after one that failed to contain a fault engages at the instant the
fault is detected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core.attention import block_dim
from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.events import Drift, Event, GuardAction, Rejected

if TYPE_CHECKING:
    from engine.core.engine import Engine
    from engine.core.model_runner import ModelRunner
    from engine.core.scheduler import Batch

LAYERS = ("breaker", "throttle", "defrag", "chunk_timeout", "drift", "degraded")
DEGRADED_WHEN = ("breaker", "throttle", "defrag", "chunk_timeout")
TIMEOUT_GROWTH = 0.1  # seed 000 §6: timeout = base × (1 + 0.1 × chunk index)
BREAKER_REASON = "circuit breaker"  # how Engine.rejection_reason starts a breaker rejection


class Guards:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.fragmentation = 0.0  # the larger of KV block tails and, on CUDA, allocator slack
        self.compactions = 0
        self.blocks_moved = 0
        self._engaged = dict.fromkeys(LAYERS, False)
        self._last_breaker: float | None = None
        self._last_timeout: float | None = None
        self._last_drift: float | None = None
        self._last_defrag: float | None = None
        self._timeout_detail = ""
        self._drift_detail = ""
        engine.bus.subscribe(self._observe)

    # --- called by the engine -----------------------------------------------------------
    def engaged(self) -> tuple[str, ...]:
        return tuple(name for name in LAYERS if self._engaged[name])

    def before_step(self) -> None:
        self._evaluate(self.engine.clock())

    def after_step(self, batch: Batch, duration_s: float) -> None:
        now = self.engine.clock()
        self._check_chunk_timeouts(batch, duration_s, now)
        self._defragment(now)
        self._evaluate(now)

    # --- layer 4 ------------------------------------------------------------------------
    def chunk_timeout_s(self, chunk_index: int) -> float:
        """The time a prefill chunk may take; 0 when the layer is off."""
        base = self.engine.config.chunk_timeout_base_ms / 1000
        return base * (1 + TIMEOUT_GROWTH * chunk_index)

    def _check_chunk_timeouts(self, batch: Batch, duration_s: float, now: float) -> None:
        for chunk in batch.prefills:
            request = chunk.request
            if request.state.is_final or not request.chunks:
                continue
            index = request.chunks[-1].index
            limit = self.chunk_timeout_s(index)
            if not limit or duration_s <= limit:
                continue
            reason = (f"chunk timeout: prefill chunk {index} took {duration_s * 1000:.0f} ms, "
                      f"over {limit * 1000:.0f} ms (chunk_timeout_base_ms × (1 + "
                      f"{TIMEOUT_GROWTH} × {index})); its KV blocks were released")
            self.engine.fail(request, reason)
            self._last_timeout = now
            self._timeout_detail = f"request {request.id}: {reason}"
            self._act("chunk_timeout", self._timeout_detail, now)

    # --- layer 3 ------------------------------------------------------------------------
    def _defragment(self, now: float) -> None:
        engine = self.engine
        live = list(engine.requests.values())
        self.fragmentation = max(engine.blocks.fragmentation(live),
                                 allocator_fragmentation(engine.runner.device))
        cfg = engine.config
        if self.fragmentation <= cfg.defrag_threshold:
            return
        if self._last_defrag is not None and now - self._last_defrag < cfg.defrag_interval_s:
            return
        self._last_defrag = now
        moved = compact_blocks(engine.blocks, engine.runner, live)
        self.compactions += 1
        self.blocks_moved += moved
        detail = f"fragmentation {self.fragmentation:.0%}: compacted, {moved} KV blocks moved"
        if engine.runner.device.type == "cuda":
            torch.cuda.empty_cache()
            detail += ", torch.cuda.empty_cache()"
        self._act("defrag", detail, now)

    # --- layers 1, 5: events ------------------------------------------------------------
    def _observe(self, event: Event) -> None:
        if isinstance(event, Rejected) and event.reason.startswith(BREAKER_REASON):
            self._last_breaker = self.engine.clock()
        elif isinstance(event, Drift):
            self._last_drift = self.engine.clock()
            self._drift_detail = f"budget drift {event.deviation:.0%}: {event.detail}"
        else:
            return
        self._evaluate(self.engine.clock())

    # --- state --------------------------------------------------------------------------
    def _evaluate(self, now: float) -> None:
        cfg = self.engine.config
        scheduler = self.engine.scheduler

        def recent(last: float | None) -> bool:
            return last is not None and now - last < cfg.guard_window_s

        state = {
            "breaker": (recent(self._last_breaker),
                        f"rejected a prompt over max_prefill_tokens × 1.2 within the last "
                        f"{cfg.guard_window_s:g} s"),
            "throttle": (scheduler.throttle_level > 0,
                         f"bandwidth 5 s average {scheduler.bandwidth_util:.0%}: throttle level "
                         f"{scheduler.throttle_level}"),
            "defrag": (self.fragmentation > cfg.defrag_threshold,
                       f"KV fragmentation {self.fragmentation:.0%} over defrag_threshold "
                       f"{cfg.defrag_threshold:.0%}"),
            "chunk_timeout": (recent(self._last_timeout), self._timeout_detail),
            "drift": (recent(self._last_drift), self._drift_detail),
        }
        degraded = cfg.degraded_path and all(state[name][0] for name in DEGRADED_WHEN)
        state["degraded"] = (degraded, "layers 1-4 engaged: one prefill at a time in "
                                       "chunk_tile-sized chunks while decodes go on")
        for name in LAYERS:  # in layer order, so each hand-over is one evaluation
            engaged, detail = state[name]
            if engaged != self._engaged[name]:
                self._engaged[name] = engaged
                self.engine.bus.publish(GuardAction(layer=name, engaged=engaged,
                                                    detail=detail if engaged else "released",
                                                    ts=now))
        scheduler.prefill_paused = degraded

    def _act(self, layer: str, detail: str, now: float) -> None:
        """An action of a layer (a request failed, a compaction), whatever its state."""
        self.engine.bus.publish(GuardAction(layer=layer, engaged=True, detail=detail, ts=now))


def allocator_fragmentation(device: torch.device) -> float:
    """CUDA memory torch holds but no tensor uses, as a share of what it holds; 0 elsewhere."""
    if device.type != "cuda":
        return 0.0
    reserved = torch.cuda.memory_reserved(device)
    if not reserved:
        return 0.0
    return 1.0 - torch.cuda.memory_allocated(device) / reserved


def compact_blocks(blocks: BlockManager, runner: ModelRunner, requests: list[Request]) -> int:
    """Renumber the blocks `requests` hold to 0..U-1 (in order of first use), moving their KV
    rows in the runner's cache and rewriting block tables; returns how many blocks moved.

    Generation is unchanged: attention reads KV through block tables only. Nothing moves
    unless `requests` hold every block in use (a holder outside them would be left dangling).
    """
    mapping: dict[int, int] = {}
    for request in requests:
        for block in request.block_table:
            mapping.setdefault(block, len(mapping))
    moved = {old: new for old, new in mapping.items() if old != new}
    if len(mapping) != blocks.num_allocated or not moved:
        return 0
    dim = block_dim(runner.use_flash)
    source = torch.tensor(list(moved), dtype=torch.int64, device=runner.device)
    target = torch.tensor(list(moved.values()), dtype=torch.int64, device=runner.device)
    runner.kv_cache.index_copy_(dim, target, runner.kv_cache.index_select(dim, source))
    for request in requests:
        request.block_table = [mapping[b] for b in request.block_table]
    blocks.renumber(mapping)
    return len(moved)
