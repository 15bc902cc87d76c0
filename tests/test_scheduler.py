"""The token-budget scheduler driven directly: a real Scheduler over a real BlockManager and a
scripted bandwidth source, stepped without a model. Each step's runner output is built by
hand (every sampled token is TOKEN) and the scheduler's own `update` books it, so each case
runs in microseconds and exercises the engine's real bookkeeping.

`SchedulerRig` is shared with tests/test_scheduler_properties.py and tests/test_modes.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine import Engine
from engine.batch import QUIET, Batch, HostMark, ModelRunnerOutput, StepTiming
from engine.budget.controller import BudgetController
from engine.budget.cost_model import BudgetModel
from engine.budget.peaks import DevicePeaks
from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.intake import rejection
from engine.core.request import Ending, Request, RequestState
from engine.core.scheduler import Scheduler
from engine.events import ChunkComplete, ConfigChanged, Event, ModeChanged, Preempted
from engine.model.config import PRESETS
from engine.ops.slow_query_watch import SlowQueryWatch
from engine.ops.telemetry import BandwidthReading, InjectedBandwidth

STEP_S = 0.01  # simulated duration of one step
TOKEN = 7  # every sampled token
MAX_MODEL_LEN = 1 << 20


class IdleBandwidth:
    """The inner source of the scripted one: an idle memory bus until a test injects load."""

    def reading(self) -> BandwidthReading:
        return BandwidthReading(0.0, "model")

    def record(self, bytes_moved: float, duration_s: float) -> None:
        """Nothing to learn: injected readings drive the tests."""


@dataclass
class SchedulerRig:
    """A Scheduler stepped with hand-built runner outputs: schedule, then the real update."""

    config: EngineConfig
    num_blocks: int = 64
    now: float = 0.0
    events: list[Event] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    by_id: dict[str, Request] = field(default_factory=dict)  # a batch names its requests by id
    sampled: set[Request] = field(default_factory=set)  # chunks of the last step that sampled
    host: HostMark = QUIET  # the host's mark each step carries
    step_s: float = STEP_S  # how long each step takes on the scripted clock

    def __post_init__(self) -> None:
        self.blocks = BlockManager(self.num_blocks, self.config.block_size,
                                   enable_caching=self.config.enable_prefix_caching)
        self.bandwidth = InjectedBandwidth(IdleBandwidth(), clock=self.clock)
        model = BudgetModel(PRESETS["tiny"], 4, DevicePeaks("rig", 1e12, 1e11, "rig"))
        self.scheduler = Scheduler(self.config, self.blocks, self.bandwidth,
                                   BudgetController(lambda shape: 1e-3, model),
                                   self.events.append, self.clock,
                                   watch=SlowQueryWatch(self.events.append), eos_token_ids=(),
                                   max_model_len=MAX_MODEL_LEN)

    def clock(self) -> float:
        return self.now

    def add(self, prompt_tokens: int, max_tokens: int = 4, *, priority: int = 0,
            tenant: str = "default", arrival: float | None = None) -> Request:
        """Queue a request, or reject it as the engine's intake does."""
        # a distinct first token: no two prompts share a prefix-cache block
        prompt = [len(self.requests)] + [TOKEN] * (prompt_tokens - 1)
        request = Request(id=f"r{len(self.requests)}", prompt_token_ids=prompt,
                          params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          arrival=self.now if arrival is None else arrival, tenant=tenant,
                          priority=priority)
        self.requests.append(request)
        self.by_id[request.id] = request
        refused = rejection(prompt_tokens, max_tokens, self.config, MAX_MODEL_LEN, self.blocks)
        if refused is not None:
            request.set_state(RequestState.REJECTED, refused.message)
        else:
            self.scheduler.add(request)
        return request

    def set_config(self, **changes: object) -> None:
        """What the engine does with a validated update at a step boundary."""
        self.config = self.config.replace(**changes)
        self.scheduler.set_config(self.config)

    def step(self) -> Batch:
        batch = self.scheduler.schedule()
        self.sampled = {self.by_id[c.request_id] for c in batch.sampling}
        self.now += self.step_s
        output = ModelRunnerOutput(token_ids={r.id: TOKEN for r in self.sampled})
        self.scheduler.update(batch, output, StepTiming(self.now, self.step_s, 1e-3, self.host))
        return batch

    def finish(self, request: Request, reason: str = "length") -> None:
        self.scheduler.end(Ending(request, RequestState.FINISHED, reason))

    def run(self, max_steps: int = 10_000) -> list[Batch]:
        batches = []
        while self.scheduler.has_work():
            assert len(batches) < max_steps, "the scheduler stopped making progress"
            batches.append(self.step())
        return batches

    def of(self, kind: type[Event]) -> list[Event]:
        return [e for e in self.events if isinstance(e, kind)]


def sim(num_blocks: int = 256, **changes: object) -> SchedulerRig:
    base = EngineConfig(model="synthetic:tiny", device="cpu", block_size=4)
    return SchedulerRig(base.replace(**changes), num_blocks)


def prefill_sizes(batch: Batch) -> dict[str, int]:
    return {c.request_id: c.num_tokens for c in batch.prefills}


# --- decode first, chunking --------------------------------------------------------------
def test_decodes_are_scheduled_before_prefills_and_fit_the_budget() -> None:
    s = sim(max_num_batched_tokens=32, chunk_tile=4, max_prefill_chunks=8)
    decoders = [s.add(4, max_tokens=50) for _ in range(6)]
    s.step()
    assert all(r.is_decoding for r in decoders)
    long = s.add(200)
    batch = s.step()
    assert [s.by_id[c.request_id] for c in batch.decodes] == decoders
    assert prefill_sizes(batch) == {long.id: 24}  # 32 - 6 decodes = 26, rounded to tiles
    assert batch.num_tokens <= 32


def test_chunks_are_whole_tiles_except_the_final_remainder() -> None:
    """Pitfall 4: a partial chunk is a multiple of chunk_tile; only the last may be ragged."""
    s = sim(max_num_batched_tokens=50, chunk_tile=16)
    request = s.add(130, max_tokens=1)
    sizes = [prefill_sizes(b)[request.id] for b in s.run()]
    assert sizes == [48, 48, 34]
    assert sum(sizes) == 130


def test_no_chunk_fits_when_less_than_a_tile_is_left() -> None:
    s = sim(max_num_batched_tokens=20, chunk_tile=16, max_prefill_chunks=8)
    decoders = [s.add(4, max_tokens=50) for _ in range(5)]
    s.step()
    long = s.add(100)
    batch = s.step()
    assert len(batch.decodes) == 5
    assert long.id not in prefill_sizes(batch)  # 15 left: less than one tile, so nothing
    assert decoders[0].is_decoding


def test_at_most_max_prefill_chunks_prefills_share_a_step() -> None:
    s = sim(max_num_batched_tokens=512, chunk_tile=4, max_prefill_chunks=3)
    for _ in range(6):
        s.add(40)
    batch = s.step()
    assert len(batch.prefills) == 3
    assert all(n == 40 for n in prefill_sizes(batch).values())


def test_long_prefill_threshold_caps_one_requests_chunk() -> None:
    s = sim(max_num_batched_tokens=256, chunk_tile=8, long_prefill_threshold=60)
    long, short = s.add(500), s.add(30)
    batch = s.step()
    assert prefill_sizes(batch) == {long.id: 56, short.id: 30}  # 60 rounded down to tiles


def test_a_threshold_below_the_tile_still_moves_whole_tiles() -> None:
    s = sim(max_num_batched_tokens=64, chunk_tile=16, long_prefill_threshold=5)
    request = s.add(40, max_tokens=1)
    sizes = [prefill_sizes(b)[request.id] for b in s.run()]
    assert sizes == [16, 16, 8]


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits() -> None:
    s = sim(max_num_batched_tokens=64, chunk_tile=4, chunked_prefill=False,
            max_prefill_chunks=8)
    decoders = [s.add(4, max_tokens=20) for _ in range(8)]
    s.step()
    fits, too_big_now = s.add(56), s.add(60)
    batch = s.step()
    assert prefill_sizes(batch) == {fits.id: 56}  # 64 - 8 decodes
    assert too_big_now.state is RequestState.WAITING
    s.run()
    assert too_big_now.state is RequestState.FINISHED
    assert all(r.state is RequestState.FINISHED for r in decoders)


# --- preemption ---------------------------------------------------------------------------
def _full_pool() -> tuple[SchedulerRig, list[Request]]:
    """Four decoders of different priority and arrival filling a 12-block pool exactly."""
    s = sim(num_blocks=12, max_num_batched_tokens=64, chunk_tile=4,
            cache_high_watermark=0.99, cache_low_watermark=0.98)
    requests = [s.add(12, max_tokens=4, priority=p, arrival=a)
                for p, a in [(1, 0.0), (0, 1.0), (0, 2.0), (1, 3.0)]]
    s.step()
    assert all(r.is_decoding and len(r.block_table) == 3 for r in requests)
    return s, requests


def test_preemption_recomputes_the_lowest_priority_latest_arrival() -> None:
    s, requests = _full_pool()
    s.add(4, max_tokens=1)  # waits: nothing is admitted in a step that preempted
    batch = s.step()  # every decode crosses into a fourth block
    victim = requests[2]  # priority 0, arrived last among priority 0
    assert batch.preempted == [victim.id]
    assert victim.state is RequestState.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.block_table == [] and victim.num_preemptions == 1
    assert not batch.prefills
    assert {c.request_id for c in batch.decodes} == {"r0", "r1", "r3"}
    event = s.of(Preempted)[0]
    assert event.request_id == victim.id and event.tokens_discarded == 12
    assert victim.output_token_ids == [TOKEN]  # recompute keeps what it generated
    s.run()
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert all(len(r.output_token_ids) == 4 for r in requests)


def test_a_preempted_request_waits_ahead_of_requests_that_arrived_with_it() -> None:
    s = sim(num_blocks=12, max_num_batched_tokens=64, chunk_tile=4,
            cache_high_watermark=0.99, cache_low_watermark=0.98)
    running = [s.add(12, max_tokens=4, arrival=0.0) for _ in range(4)]
    s.step()
    late = s.add(4, max_tokens=1, arrival=0.0)
    batch = s.step()
    assert batch.preempted == [running[-1].id]
    assert s.scheduler.waiting[:2] == [running[-1], late]


def test_a_request_preempted_often_is_protected_while_others_can_go() -> None:
    s, requests = _full_pool()
    s.set_config(preempt_protect_after=2)
    requests[2].num_preemptions = 2
    assert s.step().preempted == [requests[1].id]  # next lowest priority, latest arrival
    s, requests = _full_pool()
    for r in requests:
        r.num_preemptions = 3
    assert s.step().preempted == [requests[2].id]  # all protected: the usual order again


def test_in_progress_prefills_that_fill_the_pool_do_not_deadlock() -> None:
    """With no decode to preempt from, blocked partial prefills give way to the head."""
    s = sim(num_blocks=20, max_num_batched_tokens=32, chunk_tile=4, long_prefill_threshold=8)
    first, second, third = s.add(56, max_tokens=2), s.add(56, max_tokens=2), s.add(56, 2)
    s.run(max_steps=200)
    assert {r.state for r in (first, second, third)} == {RequestState.FINISHED}
    assert s.of(Preempted)
    assert s.blocks.num_used == 0


# --- short prompts beside long ones ---------------------------------------------------------
def test_a_short_prompt_is_prefilled_in_the_next_step_behind_long_ones() -> None:
    s = sim(num_blocks=4096, max_num_batched_tokens=256, chunk_tile=16)
    longs = [s.add(1500, max_tokens=1) for _ in range(32)]
    s.step()  # the first long prompt takes the whole budget
    short = s.add(11, max_tokens=8)
    batch = s.step()
    assert prefill_sizes(batch)[short.id] == 11
    # the long prefill still advances, with what the short one left
    assert prefill_sizes(batch)[longs[0].id] == 256 - 11 - 5  # whole tiles of 16


def test_short_prompts_take_at_most_half_the_budget_and_one_slot_less_than_all() -> None:
    s = sim(num_blocks=4096, max_num_batched_tokens=256, chunk_tile=16, max_prefill_chunks=4)
    long = s.add(2000, max_tokens=1)
    s.step()
    shorts = [s.add(60, max_tokens=1) for _ in range(6)]
    batch = s.step()
    sizes = prefill_sizes(batch)
    assert [r.id for r in shorts if r.id in sizes] == [shorts[0].id, shorts[1].id]
    assert sizes[long.id] >= 128
    while long.num_computed_tokens < 2000:  # the long prompt advances every step
        before = long.num_computed_tokens
        s.step()
        assert long.num_computed_tokens > before


def test_a_short_prompt_jumps_no_request_of_a_higher_priority() -> None:
    s = sim(num_blocks=4096, max_num_batched_tokens=256, chunk_tile=16)
    urgent = s.add(1500, max_tokens=1, priority=1)
    s.step()
    short = s.add(11, max_tokens=1)
    assert short.id not in prefill_sizes(s.step())
    assert urgent.num_computed_tokens == 512


def test_a_short_prompt_jumps_only_while_the_free_blocks_hold_it() -> None:
    s = sim(num_blocks=10, max_num_batched_tokens=32, chunk_tile=4)
    long = s.add(36, max_tokens=1)
    s.step()  # 32 tokens: 8 of the 10 blocks of 4
    short = s.add(12, max_tokens=1)  # 3 blocks: the long prompt's last block would not fit
    batch = s.step()
    assert batch.prefills[0].request_id == long.id  # the short one only takes what is left
    assert long.num_computed_tokens == 36
    assert prefill_sizes(batch)[short.id] == 4


# --- tenants (pitfall 5) ------------------------------------------------------------------
def _first_chunk_step(shares: dict[str, float]) -> int:
    s = sim(num_blocks=4096, max_num_batched_tokens=256, chunk_tile=16,
            tenant_shares=shares)
    for _ in range(4):
        s.add(2000, max_tokens=2, tenant="bulk", arrival=0.0)
    # longer than a slot's share of the step (256 / 4): no short prompt, which would jump
    chat = s.add(100, max_tokens=2, tenant="chat", arrival=1.0)
    for step, batch in enumerate(s.run()):
        if chat.id in prefill_sizes(batch):
            return step
    raise AssertionError("the chat request never ran")


def test_tenant_shares_keep_a_long_prompt_tenant_from_starving_another() -> None:
    without = _first_chunk_step({})
    with_shares = _first_chunk_step({"bulk": 0.75, "chat": 0.25})
    assert with_shares == 0
    assert without >= 4 * 2000 // 256  # FCFS: the bulk prompts go first
    s = sim(num_blocks=4096, max_num_batched_tokens=256, chunk_tile=16,
            tenant_shares={"bulk": 0.75, "chat": 0.25})
    bulk = s.add(2000, tenant="bulk", arrival=0.0)
    chat = s.add(2000, tenant="chat", arrival=1.0)
    assert prefill_sizes(s.step()) == {bulk.id: 192, chat.id: 64}


def test_a_lone_tenant_uses_the_whole_budget() -> None:
    s = sim(max_num_batched_tokens=256, chunk_tile=16, tenant_shares={"bulk": 0.5})
    request = s.add(600, tenant="bulk")
    assert prefill_sizes(s.step()) == {request.id: 256}


def test_tenant_priorities_admit_a_higher_priority_tenant_first() -> None:
    s = sim(max_num_batched_tokens=64, chunk_tile=16, max_prefill_chunks=1)
    first = s.add(64, max_tokens=1, tenant="bulk", arrival=0.0)
    s.add(64, max_tokens=1, tenant="bulk", arrival=1.0)
    gold = s.add(64, max_tokens=1, tenant="gold", arrival=2.0)
    assert prefill_sizes(s.step()) == {first.id: 64}  # FCFS while no tenant ranks higher
    s.set_config(tenant_priorities={"gold": 1})  # live: the queue is reordered at once
    assert prefill_sizes(s.step()) == {gold.id: 64}
    late = s.add(64, max_tokens=1, tenant="gold", arrival=3.0)
    s.add(64, max_tokens=1, priority=5, tenant="bulk", arrival=4.0)  # its own priority counts
    assert [r.id for r in s.scheduler.waiting] == ["r4", late.id, "r1"]


def test_tenant_priorities_must_be_integers() -> None:
    with pytest.raises(ConfigError) as excinfo:
        EngineConfig().replace(tenant_priorities={"gold": "high"})
    assert excinfo.value.field == "tenant_priorities"


# --- configuration at step boundaries -----------------------------------------------------
def test_mode_changes_are_published_once_per_change() -> None:
    s = sim(num_blocks=10, max_num_batched_tokens=64, chunk_tile=4)
    s.add(30, max_tokens=8)  # its decodes take the pool to 9 of 10 blocks
    s.run()
    s.add(4, max_tokens=1)  # the next step sees the pool empty again
    s.run()
    changes = [(e.old, e.new) for e in s.of(ModeChanged)]
    assert changes == [("NORMAL", "CACHE_PRESSURE_WAIT"), ("CACHE_PRESSURE_WAIT", "NORMAL")]


# --- the real engine ------------------------------------------------------------------------
PROMPTS = [[(7 * i + 3 * n) % 250 + 3 for i in range(n)] for n in (1, 5, 17, 40, 63, 30)]
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # synthetic:tiny: layers × (K, V) × heads × dim × fp32


def _generate(**config: object) -> tuple[list[list[int]], Engine]:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 **config))
    return engine.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True)), engine


@pytest.fixture(scope="module")
def unchunked() -> list[list[int]]:
    return _generate(max_num_batched_tokens=4096, chunk_tile=1)[0]


@pytest.mark.parametrize("schedule", [
    {"max_num_batched_tokens": 7, "chunk_tile": 1},
    {"max_num_batched_tokens": 16, "chunk_tile": 4, "max_prefill_chunks": 1},
    {"max_num_batched_tokens": 64, "chunk_tile": 16, "long_prefill_threshold": 20},
    {"max_num_batched_tokens": 64, "chunked_prefill": False},
    # a 24-block pool: requests are preempted and recomputed
    {"max_num_batched_tokens": 48, "chunk_tile": 4, "block_size": 4,
     "kv_cache_bytes": 24 * 4 * KV_BYTES_PER_TOKEN},
])
def test_greedy_outputs_do_not_depend_on_the_schedule(unchunked: list[list[int]],
                                                     schedule: dict[str, object]) -> None:
    outputs, engine = _generate(**schedule)
    assert outputs == unchunked
    assert engine.blocks.num_used == 0
    if "kv_cache_bytes" in schedule:
        assert engine.metrics.preemptions_total > 0


def test_update_config_applies_at_the_next_step_boundary() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 max_num_batched_tokens=64, chunk_tile=4))
    events: list[Event] = []
    engine.bus.subscribe(events.append)
    engine.add_request(list(range(3, 203)), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    before = engine.config
    engine.update_config(max_num_batched_tokens=16)
    assert engine.config is before and engine.scheduler.config is before
    with pytest.raises(ConfigError) as excinfo:
        engine.update_config(chunk_tile="wide")
    assert excinfo.value.field == "chunk_tile"
    assert engine.config is before
    engine.step()
    assert engine.config.max_num_batched_tokens == 16 and engine.config.chunk_tile == 4
    chunks = [e.tokens for e in events if isinstance(e, ChunkComplete)]
    assert chunks == [64, 16]
    changed = [e for e in events if isinstance(e, ConfigChanged)]
    assert len(changed) == 1 and changed[0].changes == {"max_num_batched_tokens": (64, 16)}
