"""Scheduler modes (seed 000 §4): CACHE_PRESSURE_WAIT into and out of on cache_evict, and the
BANDWIDTH_THROTTLE levels driven by a scripted bandwidth source."""

from __future__ import annotations

from engine import Engine, EngineConfig, SamplingParams
from engine.core.request import RequestState
from engine.events import CacheEvict, ChunkComplete, Event, ModeChanged, StepComplete
from engine.ops.telemetry import InjectedBandwidth
from tests.test_scheduler import STEP_S, IdleBandwidth, SchedulerRig, prefill_sizes, sim

KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # synthetic:tiny: layers × (K, V) × heads × dim × fp32


def _modes(s: SchedulerRig) -> list[tuple[str, str]]:
    return [(e.old, e.new) for e in s.of(ModeChanged)]


def test_cache_pressure_waits_for_evictions_below_the_low_watermark() -> None:
    s = sim(num_blocks=20, max_num_batched_tokens=64, chunk_tile=4,
            cache_high_watermark=0.85, cache_low_watermark=0.3)
    first, second = s.add(30, max_tokens=40), s.add(30, max_tokens=40)
    while s.scheduler.mode == "NORMAL":
        s.step()  # the decodes grow into a ninth block each: 18 of 20 blocks
    assert _modes(s) == [("NORMAL", "CACHE_PRESSURE_WAIT")]
    assert "kv usage 0.90" in s.of(ModeChanged)[0].reason
    late = s.add(8, max_tokens=2)
    for _ in range(3):
        batch = s.step()
        assert not batch.prefills and len(batch.decodes) == 2  # decodes only
        assert batch.mode == "CACHE_PRESSURE_WAIT"
    s.finish(first)  # usage 0.45: evicted, but still above the low watermark
    batch = s.step()
    assert batch.mode == "CACHE_PRESSURE_WAIT" and not batch.prefills
    assert late.state is RequestState.WAITING
    s.finish(second)  # the cache_evict that takes usage under the low watermark
    evict_index = len(s.events) - 1
    assert isinstance(s.events[evict_index], CacheEvict)
    batch = s.step()
    assert batch.mode == "NORMAL" and prefill_sizes(batch) == {late.id: 8}
    assert _modes(s) == [("NORMAL", "CACHE_PRESSURE_WAIT"), ("CACHE_PRESSURE_WAIT", "NORMAL")]
    assert s.events.index(s.of(ModeChanged)[-1]) > evict_index


def test_cache_pressure_without_decodes_keeps_one_prefill_moving_by_tiles() -> None:
    s = sim(num_blocks=30, max_num_batched_tokens=64, chunk_tile=4,
            cache_high_watermark=0.5, cache_low_watermark=0.2)
    # 20 tokens is over budget / slots: no short prompt jumps ahead here
    long, other = s.add(100, max_tokens=1), s.add(20, max_tokens=1)
    batches = s.run()
    assert prefill_sizes(batches[0]) == {long.id: 64}  # 16 of 30 blocks: over the watermark
    pressured = [b for b in batches if b.mode == "CACHE_PRESSURE_WAIT"]
    assert [prefill_sizes(b) for b in pressured] == [{long.id: 4}] * 9
    assert long.state is other.state is RequestState.FINISHED


def test_bandwidth_throttle_levels_follow_the_scripted_source() -> None:
    """Above 0.90: chunk concurrency 2; above 0.95: 1; above 0.98 for bandwidth_pause_s:
    no new prefills (the ones in progress continue, one at a time)."""
    s = sim(num_blocks=4096, max_num_batched_tokens=256, chunk_tile=16, max_prefill_chunks=4,
            long_prefill_threshold=64, bandwidth_pause_s=0.045)
    requests = [s.add(2000, max_tokens=1) for _ in range(6)]

    def step_at(util: float) -> dict[str, int]:
        s.bandwidth.inject(util, until_s=s.now + 1.0)
        return prefill_sizes(s.step())

    assert len(step_at(0.5)) == 4
    assert len(step_at(0.92)) == 2 and s.scheduler.throttle_level == 1
    assert len(step_at(0.96)) == 1 and s.scheduler.throttle_level == 2
    for _ in range(5):  # above the pause line, but not yet for bandwidth_pause_s
        assert len(step_at(0.99)) == 1 and s.scheduler.throttle_level == 2
    late = s.add(16, max_tokens=1, priority=5)  # would go first, if anything were admitted
    for _ in range(3):
        sizes = step_at(0.99)
        assert s.scheduler.throttle_level == 3
        assert list(sizes) == [requests[0].id] and late.state is RequestState.WAITING
    assert len(step_at(0.5)) == 4
    assert s.scheduler.mode == "NORMAL" and s.scheduler.throttle_level == 0
    levels = [e.reason.rsplit(" ", 1)[-1] for e in s.of(ModeChanged)]
    assert _modes(s) == [("NORMAL", "BANDWIDTH_THROTTLE")] + [
        ("BANDWIDTH_THROTTLE", "BANDWIDTH_THROTTLE")] * 2 + [("BANDWIDTH_THROTTLE", "NORMAL")]
    assert levels == ["1", "2", "3", "0"]


def test_the_pause_timer_restarts_when_bandwidth_dips() -> None:
    s = sim(max_num_batched_tokens=64, chunk_tile=16, bandwidth_pause_s=2.5 * STEP_S)
    s.add(900, max_tokens=1)
    s.add(900, max_tokens=1)  # two prompts: the throttle has prefills to hold back
    for util in (0.99, 0.99, 0.97, 0.99, 0.99, 0.99):
        s.bandwidth.inject(util, until_s=s.now + 1.0)
        s.step()
        assert s.scheduler.throttle_level == 2
    s.bandwidth.inject(0.99, until_s=s.now + 1.0)
    s.step()
    assert s.scheduler.throttle_level == 3


def test_a_spike_held_off_by_a_lone_request_pauses_prefills_once_more_arrive() -> None:
    """How long the bandwidth stayed high is the reading's: a lone request holds the throttle
    off without restarting the pause timer, so the spike acts as soon as a cap can help."""
    s = sim(max_num_batched_tokens=64, chunk_tile=16, bandwidth_pause_s=2.5 * STEP_S)
    s.add(900, max_tokens=1)
    for _ in range(4):  # longer than bandwidth_pause_s, with one request live
        s.bandwidth.inject(0.99, until_s=s.now + 1.0)
        s.step()
        assert s.scheduler.throttle_level == 0
    s.add(900, max_tokens=1)
    s.bandwidth.inject(0.99, until_s=s.now + 1.0)
    s.step()
    assert s.scheduler.throttle_level == 3


def test_cache_pressure_outranks_the_bandwidth_throttle() -> None:
    s = sim(num_blocks=10, max_num_batched_tokens=64, chunk_tile=4,
            cache_high_watermark=0.5, cache_low_watermark=0.2)
    s.add(30, max_tokens=8)
    s.add(8, max_tokens=8)
    s.bandwidth.inject(0.96, until_s=10.0)
    s.step()
    s.step()
    assert s.scheduler.mode == "CACHE_PRESSURE_WAIT" and s.scheduler.throttle_level == 2


def test_engine_publishes_mode_changes_on_its_bus() -> None:
    """The real engine: pressure from two decoders, resumed by the evictions of their ends,
    then a scripted bandwidth spike throttles the next prefills."""
    clock = [0.0]
    bandwidth = InjectedBandwidth(IdleBandwidth(), clock=lambda: clock[0])
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 block_size=4, kv_cache_bytes=20 * 4 * KV_BYTES_PER_TOKEN,
                                 max_num_batched_tokens=64, chunk_tile=4,
                                 cache_high_watermark=0.7, cache_low_watermark=0.3),
                    bandwidth=bandwidth, clock=lambda: clock[0])
    events: list[Event] = []
    engine.bus.subscribe(events.append)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for prompt in ([5] * 26, [6] * 26):  # 7 blocks each: 14 of 20, the high watermark
        engine.add_request(prompt, params)
    engine.step()
    late = engine.add_request([9] * 8, params)
    while engine.has_unfinished():
        clock[0] += 0.01
        engine.step()
    kinds = [(e.kind, getattr(e, "new", getattr(e, "request_id", None))) for e in events
             if isinstance(e, ModeChanged | CacheEvict | ChunkComplete)]
    enter = kinds.index(("mode_changed", "CACHE_PRESSURE_WAIT"))
    leave = kinds.index(("mode_changed", "NORMAL"))
    evicts = [i for i, k in enumerate(kinds) if k[0] == "cache_evict"]
    late_chunk = kinds.index(("chunk_complete", late))
    assert enter < evicts[0] < evicts[1] < leave < late_chunk
    assert engine.snapshot().mode == "NORMAL"

    bandwidth.inject(0.99, until_s=clock[0] + 1.0)
    engine.add_request([5] * 40, params)
    engine.add_request([6] * 40, params)
    engine.step()
    steps = [e for e in events if isinstance(e, StepComplete)]
    assert steps[-1].mode == "BANDWIDTH_THROTTLE"
    assert engine.snapshot().throttle_level == 2
    assert events[-1].kind != "mode_changed" or events[-1].new == "BANDWIDTH_THROTTLE"
