"""The GPU twin: a simulated executor under the real scheduler."""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from engine import Engine
from engine.batch import StepShape
from engine.budget.peaks import DevicePeaks, measure_peaks
from engine.budget.predictor import StepTimePredictor
from engine.budget.roofline import Roofline, step_estimate
from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.errors import EngineError
from engine.events import ChunkComplete, Event, Finished, Preempted, StepComplete
from engine.harness.driver import drive
from engine.harness.workload import WorkloadRequest
from engine.model.config import PRESETS
from engine.sim.executor import PacedClock, SimulatedExecutor, VirtualClock, simulated_engine
from engine.sim.fleet import run_fleet
from engine.sim.profiles import PROFILES, VLLM_SAMPLER_PASSES, vllm_defaults
from engine.sim.router import RoutePolicy, Router
from engine.sim.target import (
    NON_TORCH_BYTES,
    SAMPLER_BYTES_PER_LOGIT,
    Deployment,
    SimTarget,
    StepTimeRatios,
    resolve_target,
)

# --- seed 003 §6·补一: a 4,096-token prompt beside 32 decodes at 2,048 tokens --------------

SEED_ROOFLINE = Roofline(params=7e9, flops=300e12, bandwidth=2e12, kv_bytes_per_token=524288)
SEED_TTFT_MS = {128: 774, 486: 218, 2048: 194, 4096: 193}
DECODES, CONTEXT, PROMPT = 32, 2048, 4096


def _seed_target() -> SimTarget:
    def predict(shape: StepShape) -> float:
        return step_estimate(SEED_ROOFLINE.compute_seconds(shape),
                             SEED_ROOFLINE.memory_seconds(shape)).tau_s

    return SimTarget(spec="seed-003", device="sim:seed-003", dtype="bfloat16",
                     peaks=DevicePeaks("seed-003", 300e12, 2e12, "seed 003 §6"),
                     kv_cache_bytes=64 << 30, predict=predict, source="seed 003 §6 roofline")


def _llama2_7b_dir(tmp_path: Path) -> Path:
    """A model directory holding only config.json (no weights), 8k positions so that the
    4,096-token prompt fits with its output."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "max_position_embeddings": 8192,
              "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _seed_ttft_ms(model: str, chunk: int) -> float:
    warmup = EngineConfig(model=model, chunk_tile=1, max_prefill_chunks=DECODES,
                          max_num_batched_tokens=DECODES * CONTEXT)
    clock = VirtualClock(start=0.0)
    engine = simulated_engine(warmup, _seed_target(), clock)
    for i in range(DECODES):  # one step prefills them all: every decode then has S = 2048
        engine.add_request([5] * (CONTEXT - 1), SamplingParams(max_tokens=200, ignore_eos=True),
                           request_id=f"decode-{i}")
    engine.step()
    assert sum(r.is_decoding for r in engine.scheduler.running) == DECODES
    engine.update_config(max_num_batched_tokens=chunk + DECODES,
                         chunked_prefill=chunk < PROMPT)
    rid = engine.add_request([7] * PROMPT, SamplingParams(max_tokens=1, ignore_eos=True))
    request = engine.scheduler.requests[rid]
    while request.first_token_time is None:
        engine.step()
    return request.ttft_s * 1e3


@pytest.mark.parametrize("chunk", sorted(SEED_TTFT_MS))
def test_seed_003_worked_example_ttft_within_5_percent(tmp_path: Path, chunk: int) -> None:
    ttft = _seed_ttft_ms(str(_llama2_7b_dir(tmp_path)), chunk)
    assert ttft == pytest.approx(SEED_TTFT_MS[chunk], rel=0.05)


# --- the same decisions as a real run, given the real step times ------------------------


def _decisions(events: list[Event]) -> list[tuple[object, ...]]:
    """What the scheduler decided, step by step, without any timing."""
    out: list[tuple[object, ...]] = []
    for e in events:
        match e:
            case StepComplete():
                out.append(("step", e.step, e.prefill_tokens, e.decode_seqs, e.mode))
            case ChunkComplete():
                out.append(("chunk", e.request_id, e.chunk_index, e.start, e.tokens))
            case Preempted():
                out.append(("preempted", e.request_id))
            case Finished():
                out.append(("finished", e.request_id, e.reason, e.generated_tokens))
    return out


def _tiny_workload() -> list[WorkloadRequest]:
    return [WorkloadRequest(f"r{i}", 0.0, tuple(3 + (i + j) % 50 for j in range(24 + 9 * i)),
                            max_tokens=12 + 5 * i, ignore_eos=True) for i in range(10)]


def test_simulated_run_makes_the_real_runs_scheduling_decisions() -> None:
    # a pool of 24 blocks forces preemptions; a 48-token budget forces chunking
    config = EngineConfig(model="synthetic:tiny", device="cpu", max_num_batched_tokens=48,
                          kv_cache_bytes=24 * 16 * PRESETS["tiny"].kv_bytes_per_token(4))
    real = Engine(config)
    real_events: list[Event] = []
    real.bus.subscribe(real_events.append)
    drive(real, _tiny_workload())
    durations = iter([e.duration_s for e in real_events if isinstance(e, StepComplete)])
    assert any(isinstance(e, Preempted) for e in real_events)

    target = SimTarget(spec="replay", device="sim:replay", dtype="float32",
                       peaks=measure_peaks("cpu", real.runner.dtype),
                       kv_cache_bytes=config.kv_cache_bytes,
                       predict=lambda shape: next(durations), source="the real run's steps")
    clock = VirtualClock()
    sim = Engine(config, runner=SimulatedExecutor(config, target, clock), clock=clock)
    sim_events: list[Event] = []
    sim.bus.subscribe(sim_events.append)
    drive(sim, _tiny_workload(), sleep=clock.sleep)
    assert _decisions(sim_events) == _decisions(real_events)
    real_steps = [e.duration_s for e in real_events if isinstance(e, StepComplete)]
    sim_steps = [e.duration_s for e in sim_events if isinstance(e, StepComplete)]
    assert sim_steps == pytest.approx(real_steps)


# --- models without weights, tensor parallelism ------------------------------------------


def test_kv_capacity_is_vllms_share_of_memory_less_weights_and_the_profile_runs_peak() -> None:
    config = PRESETS["8b"]
    h100 = PROFILES["h100"]
    one = Deployment(config, h100)
    two = Deployment(config, h100, tp=2)
    assert one.weight_bytes == config.num_params() * 2
    # the second GPU holds no second copy of the weights: more than twice the KV
    assert two.kv_cache_bytes(0.9, 8192, 1024) > 2 * one.kv_cache_bytes(0.9, 8192, 1024)
    peak = one.activation_peak_bytes(8192, 1024)
    assert one.kv_cache_bytes(0.9, 8192, 1024) == int(
        0.9 * h100.memory_bytes - one.weight_bytes - peak - NON_TORCH_BYTES)
    # 1,024 sequences' logits outweigh 8,192 tokens' activations; 256 sequences do not
    assert peak == 1024 * config.vocab_size * SAMPLER_BYTES_PER_LOGIT
    assert one.activation_peak_bytes(8192, 256) < peak
    assert one.kv_cache_bytes(0.9, 2048, 256) > one.kv_cache_bytes(0.9, 8192, 1024)


def test_tensor_parallel_adds_two_latency_bound_allreduces_per_layer() -> None:
    config = PRESETS["8b"]
    h100 = PROFILES["h100"]
    two = Deployment(config, h100, tp=2).step_price()
    shape = StepShape(decode_contexts=(1024,) * 64)
    message = 64 * config.hidden_size * 2
    e = h100.efficiency
    per_call = (e.allreduce_s + e.tp_allreduce_s
                + 2 * (2 - 1) / 2 * message / h100.interconnect.bandwidth)
    assert two.operations(shape)["communication"] == pytest.approx(
        2 * config.num_layers * per_call)
    # a small all-reduce costs its latency, not a per-hop sum
    assert per_call < 1.2 * (e.allreduce_s + e.tp_allreduce_s)
    single = Deployment(config, h100).predictor()(shape)
    assert two.predict(shape) < single  # half the weights per GPU outweighs the link


def test_bad_simulation_inputs_name_the_fix(tmp_path: Path) -> None:
    config = EngineConfig(model="synthetic:8b")
    with pytest.raises(ConfigError, match="choose one of a100"):
        resolve_target("v100", config)
    with pytest.raises(ConfigError, match="tp"):
        resolve_target("h100", config, tp=3)  # 8 KV heads do not split three ways
    with pytest.raises(ConfigError, match="give a --db"):
        resolve_target("this", config)
    big = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
           "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
           "num_key_value_heads": 8}
    (tmp_path / "config.json").write_text(json.dumps(big))
    with pytest.raises(ConfigError, match="raise --tp"):
        resolve_target("h100", EngineConfig(model=str(tmp_path)))
    assert resolve_target("h100", EngineConfig(model=str(tmp_path)), tp=4).kv_cache_bytes > 0
    # weights that fit beside a budget whose profile run does not: the budget is the fix
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens: 16\.1 GB of weights and "
                                          r"229\.4 GB of activations a GPU do not fit .* lower "
                                          r"--max-num-batched-tokens \(2,000,000\), or raise"):
        resolve_target("h100", EngineConfig(model="synthetic:8b",
                                            max_num_batched_tokens=2_000_000))
    # a share of memory the user lowered is named first where the whole GPU holds them
    with pytest.raises(ConfigError, match=r"do not fit in 5% of 1 x H100 SXM \(86 GB each\); "
                                          r"raise --gpu-memory-utilization \(0\.05\), or "
                                          r"raise --tp$"):
        resolve_target("h100", EngineConfig(model="synthetic:8b", gpu_memory_utilization=0.05))


def test_a_kv_block_the_pool_holds_too_few_of_names_the_block_size(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--block-size 100000 left an H100's pool 4 blocks: bench's decode probe of 8 sequences
    ended in a bare ValueError, and a CPU engine's sweep in 'need at least 7 timed steps'."""
    from console.cli.main import main
    assert main(["bench", "--model", "synthetic:8b", "--simulate", "h100", "--workload",
                 "chat", "--num-requests", "3", "--block-size", "100000"]) == 2
    assert ("the KV pool (4 blocks of 100000 tokens) cannot hold the 8 sequences of 128 "
            "tokens whose decode step sets the TPOT target: lower --block-size"
            in capsys.readouterr().err)


def test_placeholder_tokens_give_every_ignore_eos_request_its_length() -> None:
    config = EngineConfig(model="synthetic:8b", max_num_batched_tokens=512)
    clock = VirtualClock(start=0.0)
    engine = simulated_engine(config, resolve_target("h200", config), clock)
    outputs = engine.generate([[5] * 300, [6] * 20], SamplingParams(max_tokens=40))
    assert [len(o) for o in outputs] == [40, 40]
    assert clock() > 0  # the simulated clock moved by the predicted step times only
    assert str(engine.snapshot().device) == "sim:h200"


class _Wall:
    """A wall clock the test moves: `pause` is the clock's sleep, `host` this host's work."""

    def __init__(self) -> None:
        self.now = 100.0
        self.paused: list[float] = []

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.paused.append(seconds)
        self.now += seconds


def test_a_paced_twins_steps_and_waits_are_its_prices_whatever_the_host_takes() -> None:
    """At 1000x a millisecond of this host's Python is a simulated second: it must count for
    nothing while the engine has work, in a step or between steps, or every chunk reads slow."""

    wall = _Wall()
    clock = PacedClock(1000.0, wall=wall, pause=wall.pause)
    config = EngineConfig(model="synthetic:8b", max_num_batched_tokens=512)
    target = resolve_target("h100", config)
    engine = simulated_engine(config, target, clock)
    host = {"s": 0.002}  # 2 ms of host work at every event: 2 simulated s at this pace
    chunks: list[ChunkComplete] = []
    steps: list[float] = []

    def observe(event: Event) -> None:
        wall.now += host["s"]
        if isinstance(event, ChunkComplete):
            chunks.append(event)
        if isinstance(event, StepComplete):
            steps.append(event.ts)

    engine.bus.subscribe(observe)
    engine.generate([[5] * 300] * 4, SamplingParams(max_tokens=16))
    assert chunks and all(c.duration_s == pytest.approx(c.predicted_s) for c in chunks)
    reference = simulated_engine(config, target, VirtualClock(start=0.0))
    virtual: list[float] = []
    reference.bus.subscribe(lambda e: virtual.append(e.ts) if isinstance(e, StepComplete)
                            else None)
    reference.generate([[5] * 300] * 4, SamplingParams(max_tokens=16))
    # the busy stretch lasts what the steps cost, as on a virtual clock
    assert steps[-1] - steps[0] == pytest.approx(virtual[-1] - virtual[0])


def test_an_idle_paced_twin_runs_with_the_wall_clock_from_its_last_step() -> None:

    wall = _Wall()
    clock = PacedClock(10.0, wall=wall, pause=wall.pause)
    busy = {"on": True}
    clock.hold_while(lambda: busy["on"])
    start = clock()
    wall.now += 5.0  # host work while busy: held
    assert clock() == start
    clock.advance_to(start + 0.4)  # a step the host is already past: no pause
    assert clock() == start + 0.4 and not wall.paused
    busy["on"] = False
    assert clock() == start + 0.4  # idle: on from the hold, not from the wall's 50 s
    wall.now += 120.0  # an idle gap far longer than any step: 1,200 simulated seconds
    assert clock() == pytest.approx(start + 0.4 + 1200.0)
    busy["on"] = True
    held = clock()
    clock.advance_to(held + 30.0)  # ahead of the host: it waits the step out at 10x
    assert wall.paused == [pytest.approx(3.0)] and clock() == held + 30.0


def test_a_twins_first_calibration_waits_on_no_gpu_and_walks_no_block(monkeypatch) -> None:
    """The twin prices its own calibration sweep: its steps are simulated seconds, and the
    console's panes wait for none of them. A tiny model on an H100 has millions of KV blocks:
    the sweep's KV probe counts them, where granting them a block at a time took 18 s."""
    import engine.serve.session as session_module
    from engine.serve.session import EngineSession
    from engine.sim.executor import Simulation

    wall = _Wall()

    class OnTheTestsWall(PacedClock):
        def __init__(self, speed: float) -> None:
            super().__init__(speed, wall=wall, pause=wall.pause)

    monkeypatch.setattr(session_module, "PacedClock", OnTheTestsWall)
    session = EngineSession.start(EngineConfig(model="synthetic:tiny"), store=False,
                                  simulate=Simulation("h100"))
    first = session.first_calibration
    blocks = session.engine.blocks
    assert first is not None and first.points and not wall.paused
    assert first.kv.blocks == blocks.num_blocks > 10**6 and blocks.num_free == blocks.num_blocks
    assert blocks.take_newly_allocated() == []
    # the sweep's steps moved the twin's clock, not the wall's
    assert session.engine.clock() > wall.now + sum(p.median_s for p in first.points)


def test_the_consoles_twin_takes_the_kv_precision_and_a_profile_file_as_bench_does(
        tmp_path: Path) -> None:
    """The console's twin took --simulate, --tp and --sim-speed only: no fp8 KV, and no
    profile of the user's, though its refusal of an unknown GPU said to give one."""
    from console.cli.console import build_parser, conflict
    from engine.serve.session import EngineSession
    from engine.sim.executor import Simulation

    mine = {**PROFILES["h100"].to_dict(), "key": "x100", "name": "X100"}
    file = tmp_path / "x100.json"
    file.write_text(json.dumps(mine))
    args = build_parser().parse_args(["--simulate", "x100", "--gpu-profile", str(file),
                                      "--kv-cache-dtype", "fp8", "--model", "synthetic:8b"])
    assert conflict(args) is None
    simulation = Simulation(args.simulate, args.tp, args.sim_speed, args.kv_cache_dtype,
                            args.gpu_profile)
    session = EngineSession.start(EngineConfig(model="synthetic:8b"), store=False,
                                  simulate=simulation, calibrate=False)
    target = session.engine.runner.target
    assert target.details["kv_cache_dtype"] == "fp8" and target.details["gpu"] == "X100"
    assert target.no_band == f"{file} defines x100, a GPU no published case was measured on"


def _paced_twin_session(speed: float) -> tuple[_Wall, Engine, Any]:
    from engine.serve.session import EngineSession

    wall = _Wall()
    config = EngineConfig(model="synthetic:8b", max_num_batched_tokens=512)
    engine = simulated_engine(config, resolve_target("h100", config),
                              PacedClock(speed, wall=wall, pause=wall.pause))
    return wall, engine, EngineSession(engine, None, None, None).attach_loop()


def test_a_twins_traffic_arrives_on_its_clock_whatever_pace_the_host_keeps() -> None:
    """The loop's player runs on the twin's clock: a host that cannot keep a 1000x pace
    slows the pace, and the traffic's rate in simulated seconds stays the one asked."""
    wall, engine, loop = _paced_twin_session(1000.0)
    player = loop.player
    assert player.clock is engine.clock and player.pace == 1000.0
    arrivals = [WorkloadRequest(f"a{i}", float(i), (5,) * 40, max_tokens=4, ignore_eos=True)
                for i in range(3)]
    player.install(arrivals, False, 0)
    start = engine.clock()
    player.feed(engine)
    assert engine.has_unfinished() and len(engine.scheduler.requests) == 1
    wall.now += 5.0  # the host is slow: five wall seconds, 5,000 simulated ones at 1000x
    player.feed(engine)
    assert len(engine.scheduler.requests) == 1  # the twin's clock held: a1 is not due
    # one simulated second ahead is a millisecond's wait on the wall
    assert player.idle_timeout(10.0) == pytest.approx(0.001)
    while engine.has_unfinished():
        engine.step()
    assert engine.clock() - start < 0.1  # four steps of a 40-token request
    wall.now += 0.0015  # idle, the clock runs at 1000x: 1.5 simulated seconds
    player.feed(engine)
    assert list(engine.scheduler.requests) == ["a1-0"]


def test_a_paused_twins_time_runs_on_as_a_real_engines_does() -> None:
    wall, engine, loop = _paced_twin_session(100.0)
    engine.add_request([5] * 40, SamplingParams(max_tokens=4))
    held = engine.clock()
    wall.now += 1.0
    assert engine.clock() == held  # work waiting and the loop stepping: held
    loop.pause()
    assert engine.clock() == held  # paused: on from the hold, at the wall's pace
    wall.now += 1.0
    assert engine.clock() == pytest.approx(held + 100.0)


def test_a_session_can_serve_the_twin_at_a_multiple_of_wall_clock_pace(tmp_path: Path) -> None:
    from engine.serve.session import EngineSession
    from engine.sim.executor import Simulation

    config = EngineConfig(model="synthetic:8b", max_num_batched_tokens=512)
    with EngineSession.start(config, db=tmp_path / "t.db",
                             simulate=Simulation("h100", tp=2, speed=1000.0)) as session:
        engine = session.engine
        assert isinstance(engine.runner, SimulatedExecutor)
        assert session.calibration is None  # the target's step times, not this CPU's fit
        assert [len(o) for o in engine.generate([[5] * 64], SamplingParams(max_tokens=8))] == [8]
        assert engine.snapshot().device == "sim:h100x2"


# --- fleets -------------------------------------------------------------------------------


def _request(i: int, tenant: str = "default", prompt: int = 10, out: int = 5) -> WorkloadRequest:
    return WorkloadRequest(f"q{i}", 0.05 * i, (5,) * prompt, max_tokens=out, tenant=tenant,
                           ignore_eos=True)


def test_router_policies() -> None:
    rr = Router(RoutePolicy.ROUND_ROBIN, 3)
    assert [rr.route(_request(i)) for i in range(4)] == [0, 1, 2, 0]
    least = Router(RoutePolicy.LEAST_TOKENS, 2)
    assert least.route(_request(0, prompt=100)) == 0
    assert least.route(_request(1, prompt=10)) == 1
    assert least.route(_request(2, prompt=10)) == 1  # 20 outstanding there against 105
    least.finished("q0")
    assert least.outstanding == [0, 30] and least.route(_request(3)) == 0
    session = Router(RoutePolicy.SESSION, 4)
    picks = {session.route(_request(i, tenant=f"t{i % 3}")) for i in range(0, 30, 3)}
    assert len(picks) == 1  # one session, one replica
    with pytest.raises(ConfigError, match="choose one of round-robin"):
        RoutePolicy.parse("random")


@pytest.mark.parametrize("collecting", [True, False])
def test_a_fleet_run_leaves_the_collector_as_it_found_it(collecting: bool) -> None:
    config = EngineConfig(model="synthetic:8b", max_num_batched_tokens=512)
    was = gc.isenabled()
    (gc.enable if collecting else gc.disable)()
    try:
        fleet = run_fleet(config, resolve_target("h100", config),
                          [_request(i, prompt=64, out=8) for i in range(4)], 1,
                          RoutePolicy.ROUND_ROBIN)
        assert gc.isenabled() is collecting
    finally:
        (gc.enable if was else gc.disable)()
    assert fleet.merged.summary()["finished"] == 4


@pytest.mark.parametrize("replicas", [0, 1025, 100_000])
def test_a_fleet_is_one_to_1024_whole_engines(replicas: int,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """--replicas 100000 built 100,000 engines: about 50 GB for an 8B twin, and minutes
    before the first step."""
    from console.cli.main import main

    config = EngineConfig(model="synthetic:8b")
    with pytest.raises(EngineError, match=f"1 to 1024 replicas, got {replicas}"):
        run_fleet(config, resolve_target("h100", config), [_request(0)], replicas,
                  RoutePolicy.ROUND_ROBIN)
    assert main(["bench", "--simulate", "h100", "--model", "synthetic:8b", "--input-len", "8",
                 "--output-len", "2", "--num-prompts", "2", "--replicas", str(replicas)]) == 2
    assert f"--replicas must be 1 to 1024 (each is a whole engine in this process), got " \
           f"{replicas}" in capsys.readouterr().err


def test_a_fleet_replays_arrivals_across_replicas() -> None:
    config = EngineConfig(model="synthetic:8b", max_num_batched_tokens=512)
    workload = [_request(i, prompt=200 + 40 * i, out=20 + i) for i in range(12)]
    fleet = run_fleet(config, resolve_target("h100", config), workload, 3,
                      RoutePolicy.ROUND_ROBIN)
    assert [len(r.records) for r in fleet.replicas] == [4, 4, 4]
    merged = fleet.merged
    assert merged.summary()["finished"] == 12
    for item in workload:
        record = merged.records[item.request_id]
        assert record.arrival == pytest.approx(item.arrival_s)  # the trace's own times
        assert record.first_scheduled >= record.arrival  # never before it arrives
        assert len(record.token_ids) == item.max_tokens
    assert fleet.summary()["replicas"][0]["requests"] == 4
    # the routing alone, without walking each replica's requests again
    assert "replicas" not in fleet.routing(per_replica=False)
    assert fleet.routing()["x_real_time"] == fleet.summary()["x_real_time"]


def test_arrivals_microseconds_apart_share_an_idle_replicas_first_step() -> None:
    """This host's engine, as calibrated, wakes for an arrival a little late, and what arrived
    meanwhile joins the step; a twin stepping at the first arrival's instant made the second
    wait a whole step."""
    from engine.sim.fleet import HOST_WAKE_S

    config = EngineConfig(model="synthetic:tiny", device="cpu", max_num_batched_tokens=512)
    first, second = _request(0, prompt=200, out=4), _request(1, prompt=200, out=4)
    second = dataclasses.replace(second, arrival_s=first.arrival_s + 7e-6)
    later = dataclasses.replace(_request(2, prompt=200, out=4), arrival_s=5.0)
    fleet = run_fleet(config, _flat_target(0.01), [first, second, later], 1,
                      RoutePolicy.ROUND_ROBIN)
    records = fleet.merged.records
    assert records["q0"].first_scheduled == records["q1"].first_scheduled
    assert records["q0"].scheduling_delay_s == pytest.approx(HOST_WAKE_S)
    # one arriving alone to an idle replica waits for the wake-up only
    assert records["q2"].scheduling_delay_s == pytest.approx(HOST_WAKE_S)


def test_a_named_gpu_adds_no_host_wake_up_to_arrivals() -> None:
    """The wake-up is this host's figure: a simulated GPU server starts at the arrival."""
    config = EngineConfig(model="synthetic:8b", max_num_batched_tokens=512)
    alone = dataclasses.replace(_request(2, prompt=200, out=4), arrival_s=5.0)
    fleet = run_fleet(config, resolve_target("h100", config), [alone], 1,
                      RoutePolicy.ROUND_ROBIN)
    assert fleet.merged.records["q2"].scheduling_delay_s == 0.0


def test_bench_simulate_prints_the_real_json_plus_what_was_simulated(
        capsys: pytest.CaptureFixture[str]) -> None:
    from console.cli.main import main

    code = main(["bench", "--simulate", "h100", "--tp", "2", "--model", "synthetic:8b",
                 "--workload", "chat", "--num-requests", "6", "--compare", "chunked,unchunked",
                 "--replicas", "2", "--capacity", "--capacity-requests", "4",
                 "--capacity-duration", "1", "--capacity-iterations", "1", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["simulated"] is True and report["predictor"] == "roofline"
    assert "H100 datasheet" in report["predictor_source"]
    assert report["target"]["interconnect"]["name"].startswith("NVLink 4")
    run = report["runs"]["chunked"]
    assert run["finished"] == 6 and len(run["replicas"]) == 2
    assert {"ttft_ms", "tpot_ms", "output_tok_s", "goodput"} <= set(run)
    assert set(report["capacity"]) == {"chunked", "unchunked"}
    assert main(["bench", "--model", "synthetic:tiny", "--tp", "2"]) == 2
    assert "add --simulate" in capsys.readouterr().err


def test_the_console_takes_a_context_length_for_its_embedded_engine(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A twin of a model that nearly fills its GPU is refused at the model's full length
    with "--max-model-len N or less": the console must take that flag, and refuse it where
    there is no engine of its own or no length."""
    from console.cli.console import build_parser, conflict, main

    parse = build_parser().parse_args
    assert parse(["--simulate", "h100", "--max-model-len", "32768"]).max_model_len == 32768
    assert "--max-model-len configure the embedded engine" in conflict(
        parse(["--attach", "http://x", "--max-model-len", "10"]))
    assert main(["--simulate", "h100", "--max-model-len", "0"]) == 2
    assert "--max-model-len 0: must be a number of tokens >= 1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="max_model_len: must be a number of tokens >= 1"):
        EngineConfig(max_model_len=-5).validate()


def test_console_simulation_flags_need_the_embedded_engine() -> None:
    from console.cli.console import build_parser, conflict

    parse = build_parser().parse_args
    assert conflict(parse(["--simulate", "h200", "--model", "synthetic:8b"])) is None
    assert "add --simulate" in conflict(parse(["--sim-speed", "10"]))
    assert conflict(parse(["--tp", "2", "--kv-cache-dtype", "fp8", "--gpu-profile", "p.json"])) \
        == "--tp, --kv-cache-dtype, --gpu-profile apply to a simulated engine; add --simulate"
    # at inf a paced clock reads nan at its start; at 1e300 a step's price is below the
    # clock's last digit (the first calibration read 0 s steps); at 1e-300 a step's wait
    # overflows time.sleep
    for speed in ("0", "-2", "nan", "inf", "1e300", "1e5", "1e-300", "0.0009"):
        said = conflict(parse(["--simulate", "h200", f"--sim-speed={speed}"]))
        assert "must be in [0.001, 10000]" in said and "bench --simulate" in said
        with pytest.raises(EngineError, match=r"must be in \[0.001, 10000\]"):
            PacedClock(float(speed))
    for speed in ("0.001", "10000"):
        assert conflict(parse(["--simulate", "h200", "--sim-speed", speed])) is None
    assert "--simulate" in conflict(parse(["--simulate", "h200", "--attach", "http://x"]))


def test_the_twin_calibrates_on_its_own_step_times() -> None:
    from engine.calibration.calibrate import calibrate

    config = EngineConfig(model="synthetic:8b", max_num_batched_tokens=512)
    target = resolve_target("h100", config)
    engine = simulated_engine(config, target, VirtualClock(start=0.0))
    result = calibrate(engine, quick=True)
    assert result.heldout_median_abs_error < 0.10  # a linear fit of a roofline, no noise
    assert result.kv.capacity_bytes <= target.kv_cache_bytes


@pytest.mark.slow  # real engine runs, several a config
def test_against_real_runs_each_config_n_times_and_compares_with_their_median(
        capsys: pytest.CaptureFixture[str]) -> None:
    from console.cli.bench import _print_agreement, _print_table, real_runs, sim_vs_real
    from console.cli.main import main

    code = main(["bench", "--simulate", "h100", "--model", "synthetic:tiny", "--workload",
                 "chat", "--num-requests", "4", "--compare", "chunked", "--against-real", "2",
                 "--json", "--quiet"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    # the real runs stay in the report, for another twin to be judged against
    assert real_runs(report, "chunked") == [report["runs"]["chunked:real"],
                                            report["runs"]["chunked:real2"]]
    # and the twin again at the real runs' median speed, to tell its misses from drift
    assert set(report["runs"]) == {"chunked", "chunked:real", "chunked:real2",
                                   "chunked:at-real-speed"}
    for kind in ("prefill", "decode"):  # the twin's steps at the real ones' measured speeds
        reals = [report["runs"][r]["step_time_ratios"][kind]
                 for r in ("chunked:real", "chunked:real2")]
        matched = report["runs"]["chunked:at-real-speed"]
        assert matched["step_time_ratios"][kind] == pytest.approx(statistics.median(reals))
        assert matched["target_drift"][kind] == pytest.approx(statistics.median(reals))
    agreement = report["sim_vs_real"]["chunked"]
    assert set(agreement) == {"output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
                              "tpot_ms_p99"}
    assert all(len(a["real"]) == 2 and set(a["at_real_speed"]) == {"sim", "error", "within"}
               for a in agreement.values())
    # how fast the real steps ran against the predictor: a simulated step takes its prediction
    assert report["runs"]["chunked"]["step_time_ratio"] == pytest.approx(1.0)
    assert all(report["runs"][real]["step_time_ratio"] > 0
               for real in ("chunked:real", "chunked:real2"))
    _print_table(report)
    printed = capsys.readouterr().out
    assert "their steps took" in printed and "simulated at their median speeds" in printed
    assert "at the real runs' speed" in printed
    # every run says how busy the machine was meanwhile, and a busy one is called out
    assert all(set(run["host"]) == {"others_cpus", "steal", "load_1m", "own_cpus", "quiet"}
               for run in report["runs"].values())
    report["runs"]["chunked:real2"]["host"] = {"others_cpus": 1.02, "steal": 0.031,
                                               "load_1m": 2.1, "quiet": False}
    _print_table(report)
    assert ("chunked:real2 shared its machine: other processes used 1.02 CPUs, the hypervisor "
            "stole 3%") in capsys.readouterr().out
    assert main(["bench", "--simulate", "h100", "--model", "synthetic:tiny",
                 "--against-real", "-1"]) == 2
    assert "at least 1" in capsys.readouterr().err
    # the median of the real runs is the yardstick, and the error is sim / median - 1
    runs = [{"output_tok_s": v, "ttft_ms": {"p50": v, "p99": None}, "tpot_ms": None}
            for v in (90.0, 100.0, 130.0)]
    figures = sim_vs_real({"output_tok_s": 110.0, "ttft_ms": {"p50": 95.0, "p99": 1.0},
                           "tpot_ms": {"p50": 2.0, "p99": 3.0}}, runs)
    assert "at_real_speed" not in figures["output_tok_s"]  # no rerun given
    assert figures["output_tok_s"] == {
        "sim": 110.0, "real": [90.0, 100.0, 130.0], "real_median": 100.0,
        "error": pytest.approx(0.10), "tolerance": 0.10, "within": True,
        # the yardstick's own agreement: each real run against the median of the other two
        "real_vs_rest": [pytest.approx(90 / 115 - 1), pytest.approx(100 / 110 - 1),
                         pytest.approx(130 / 95 - 1)]}
    assert figures["ttft_ms_p50"]["error"] == pytest.approx(-0.05)
    assert figures["ttft_ms_p99"]["error"] is None and figures["ttft_ms_p99"]["within"] is None
    assert figures["tpot_ms_p50"]["real"] == [] and figures["tpot_ms_p50"]["real_vs_rest"] == []
    # the summary line counts the twin's figures and the real runs' against one another
    _print_agreement({"runs": {"chunked:real": {}, "chunked:real2": {}, "chunked:real3": {}},
                      "sim_vs_real": {"chunked": figures}})
    printed = capsys.readouterr().out
    assert "output_tok_s +10%," in printed and "ttft_ms_p50 -5%," in printed
    assert "the twin 2 of 2 (100%); a real run against the median of the others 2 of 6" in printed


def _flat_target(step_s: float, **changes: object) -> SimTarget:
    """Every step takes `step_s`, priced by a calibrated predictor of one constant."""
    flat = StepTimePredictor(constant_s=step_s, multi_token_s=0.0, per_token_s=0.0,
                             per_prefill_chunk_s=0.0, per_decode_seq_s=0.0,
                             per_prefill_pair_s=0.0, per_decode_context_s=0.0, points=1,
                             source="flat")
    target = SimTarget(spec="flat", device="sim:flat", dtype="float32",
                       peaks=DevicePeaks("flat", 1e12, 1e11, "test"), kv_cache_bytes=1 << 30,
                       predict=flat.predict, source="flat", calibration=flat)
    return dataclasses.replace(target, **changes)


def test_a_twin_charges_what_serving_cost_its_calibrated_host() -> None:
    """Served costs (engine.calibration.served): host time after every step, and a step with a
    prefill chunk at its served price."""
    from engine.calibration.served import ServedCosts
    from engine.sim.fleet import HOST_WAKE_S

    config = EngineConfig(model="synthetic:tiny", device="cpu")
    workload = [WorkloadRequest("one", 0.0, tuple(range(3, 35)), max_tokens=6,
                                ignore_eos=True)]
    served = ServedCosts(step_s=1e-3, per_decode_s=2e-4, per_prefill_chunk_s=5e-4,
                         prefill_scale=2.0, steps=1)
    plain = run_fleet(config, _flat_target(0.01), workload, 1, RoutePolicy.ROUND_ROBIN)
    charged = run_fleet(config, _flat_target(0.01, served=served), workload, 1,
                        RoutePolicy.ROUND_ROBIN)
    before, after = plain.merged.records["one"], charged.merged.records["one"]
    assert before.ttft_s == pytest.approx(HOST_WAKE_S + 0.01)
    assert after.ttft_s == pytest.approx(HOST_WAKE_S + 0.02)  # the prefill at 2x
    assert before.tpot_s == pytest.approx(0.01)
    # each later token waits for the host after the step before (1 ms + 0.2 ms a decode;
    # the prefill step's host time is 1.5 ms) and its own 10 ms step
    gaps = after.inter_token_s()
    assert gaps[0] == pytest.approx(1.5e-3 + 0.01)
    assert gaps[1:] == pytest.approx([1.2e-3 + 0.01] * 4)
    assert charged.merged.steps[0].duration_s == pytest.approx(0.02)



def test_a_twin_of_a_drifted_machine_runs_its_steps_slow_but_predicts_the_fit() -> None:
    """drift: steps take those times their predictions (prefill and decode-only steps apart),
    while the engine still predicts the fit's time, as a real engine on a machine slower than
    at calibration; measured ratios replace the served prefill scale."""
    from engine.calibration.served import ServedCosts

    config = EngineConfig(model="synthetic:tiny", device="cpu")
    workload = [WorkloadRequest("one", 0.0, tuple(range(3, 35)), max_tokens=6,
                                ignore_eos=True)]
    served = ServedCosts(step_s=0.0, per_decode_s=0.0, per_prefill_chunk_s=0.0,
                         prefill_scale=3.0, steps=1)
    slow = run_fleet(config, _flat_target(0.01, served=served,
                                          drift=StepTimeRatios(prefill=2.0, decode=1.5)),
                     workload, 1, RoutePolicy.ROUND_ROBIN).merged
    assert [s.duration_s for s in slow.steps] == pytest.approx([0.02] + [0.015] * 5)
    assert [s.predicted_s for s in slow.steps] == pytest.approx([0.01] * 6)
    assert slow.step_time_ratio(prefill=True) == pytest.approx(2.0)
    assert slow.step_time_ratio(prefill=False) == pytest.approx(1.5)
    assert slow.records["one"].tpot_s == pytest.approx(0.015)


def test_fp8_weights_halve_an_8b_decodes_weight_bytes_and_its_time_per_token() -> None:
    h100 = PROFILES["h100"]
    bf16 = Deployment(PRESETS["8b"], h100).step_price()
    fp8 = Deployment(PRESETS["8b"], h100, weight_dtype="fp8").step_price()
    assert fp8.model.weight_bytes == pytest.approx(bf16.model.weight_bytes / 2)
    shape = StepShape(decode_contexts=(512,))  # batch 1: the weights' read bounds it
    halved = bf16.operations(shape)["gemm"] / 2
    assert fp8.operations(shape)["gemm"] == pytest.approx(halved, rel=0.01)
    assert bf16.predict(shape) - fp8.predict(shape) == pytest.approx(halved, rel=0.02)
    with pytest.raises(ConfigError, match="no fp8"):
        Deployment(PRESETS["8b"], PROFILES["a100"], weight_dtype="fp8")


def test_bench_on_a_gpu_takes_vllms_defaults_and_fixed_length_requests(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from console.cli.main import main

    args = ["bench", "--simulate", "h100", "--model", "synthetic:8b", "--compare", "chunked",
            "--db", str(tmp_path / "s.db"), "--json"]
    assert main([*args, "--input-len", "100", "--output-len", "8", "--num-prompts", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    defaults = report["gpu_defaults"]
    assert defaults["max_num_batched_tokens"] == 8192 and defaults["max_num_seqs"] == 1024
    # V1 preempts the newest however often it was preempted, and sizes KV at 0.9 of memory
    assert defaults["preempt_protect_after"] > 3 and defaults["gpu_memory_utilization"] == 0.9
    # the pool is what vLLM's profile run at those defaults leaves
    assert report["target"]["kv_cache_bytes"] == Deployment(
        PRESETS["8b"], PROFILES["h100"]).kv_cache_bytes(0.9, 8192, 1024)
    run = report["runs"]["chunked"]
    assert run["config"]["max_num_batched_tokens"] == 8192 and run["finished"] == 3
    assert report["workload"]["spec"] == "fixed:100in/8out"
    requests = tmp_path / "r.jsonl"
    requests.write_text('{"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 4}\n')
    assert main([*args, "--requests", str(requests), "--max-num-batched-tokens", "512"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "max_num_batched_tokens" not in report["gpu_defaults"]  # the user's stands
    assert report["runs"]["chunked"]["config"]["max_num_batched_tokens"] == 512
    assert main([*args, "--requests", str(requests), "--input-len", "4"]) == 2
    assert "pick one" in capsys.readouterr().err


def test_roofline_shows_a_profile_and_a_users_file_overrides_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from console.cli.main import main

    assert main(["roofline", "--gpu", "h200", "--show-profile"]) == 0
    text = capsys.readouterr().out
    # the factors a publication gave, not the fit, print their source beside them
    assert "saturated_clock  0.7399   [Stas Bekman" in text
    assert "attention_flops  0.6222   [FlashAttention-3" in text
    assert main(["roofline", "--gpu", "h200", "--show-profile", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["flops"]["fp8"] == 1979e12 and shown["sources"]["flops"]
    override = tmp_path / "p.json"
    override.write_text(json.dumps({"efficiency": {"step_s": 0.004}}))
    assert main(["roofline", "--gpu", "h200", "--show-profile", "--json", "--gpu-profile",
                 str(override)]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert mine["efficiency"]["step_s"] == 0.004
    assert mine["efficiency"]["memory"] == shown["efficiency"]["memory"]
    # a flag the chosen output does not read is refused, named, not dropped
    assert main(["roofline", "--gpu", "h200", "--show-profile", "--decode-seqs", "8",
                 "--kv-gib", "4"]) == 2
    assert "--decode-seqs, --kv-gib shape the what-if table" in capsys.readouterr().err
    assert main(["roofline", "--gpu", "h200", "--gpu-profile", str(override)]) == 2
    assert "add --show-profile" in capsys.readouterr().err
    assert main(["roofline", "--gpu", "h200", "--decode-seqs", "8", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)["inputs"]
    assert table["decode_seqs"] == 8 and table["context"] == 2048 and table["weight_bits"] == 16
    config = EngineConfig(model="synthetic:8b")
    slow = resolve_target("h200", config, gpu_profile=override)
    shape = StepShape(decode_contexts=(100,))
    assert slow.predict(shape) > resolve_target("h200", config).predict(shape)


def test_a_step_costs_the_sum_of_its_operations() -> None:
    config = EngineConfig(model="synthetic:8b")
    for tp in (1, 2):
        price = Deployment(PRESETS["8b"], PROFILES["h100"], tp).step_price()
        shape = StepShape(prefill=((300, 1000), (40, 0)), decode_contexts=(5, 900, 4000))
        parts = price.operations(shape)
        assert price.predict(shape) == pytest.approx(sum(parts.values()))
        e = PROFILES["h100"].efficiency
        assert parts["step"] == pytest.approx(e.step_s + PRESETS["8b"].num_layers * e.layer_s
                                              + 2 * e.chunk_s + 3 * e.sequence_s)
        assert all(v >= 0 for v in parts.values()) and (parts["communication"] > 0) == (tp > 1)
    assert resolve_target("h100", config).predict(StepShape()) == 0.0


def test_each_sampled_row_pays_vllms_passes_over_its_float32_logits() -> None:
    gpu = PROFILES["h100"]
    price = Deployment(PRESETS["8b"], gpu, 1).step_price()
    rows = StepShape(prefill=((128, 0),), decode_contexts=(50,) * 255)
    one_pass = 256 * PRESETS["8b"].vocab_size * 4 / (gpu.bandwidth * gpu.efficiency.elementwise)
    assert gpu.efficiency.sampler_passes == VLLM_SAMPLER_PASSES
    assert price.operations(rows)["sampler"] == pytest.approx(VLLM_SAMPLER_PASSES * one_pass)
    single = dataclasses.replace(gpu, efficiency=dataclasses.replace(gpu.efficiency,
                                                                     sampler_passes=1.0))
    assert (price.predict(rows) - Deployment(PRESETS["8b"], single, 1).step_price()
            .predict(rows)) == pytest.approx((VLLM_SAMPLER_PASSES - 1) * one_pass)


@pytest.mark.parametrize(("gpu", "server", "offline", "seqs"), [
    ("h100", 8192, 16384, 1024), ("h200", 8192, 16384, 1024), ("a100", 2048, 8192, 256),
    ("l40s", 2048, 8192, 256)])
def test_vllms_defaults_follow_the_gpu_and_the_entry_point(gpu: str, server: int, offline: int,
                                                         seqs: int) -> None:
    served, batch = vllm_defaults(PROFILES[gpu]), vllm_defaults(PROFILES[gpu], offline=True)
    assert (served["max_num_batched_tokens"], batch["max_num_batched_tokens"]) == (server,
                                                                                  offline)
    assert served["max_num_seqs"] == batch["max_num_seqs"] == seqs
    assert served["gpu_memory_utilization"] == 0.9


@pytest.mark.parametrize(("override", "said"), [
    ({"bandwidth": -1}, "bandwidth must be in bytes/s, between 1e+10 and 1e+15; got -1"),
    ({"bandwidth": float("inf")}, "bandwidth must be in bytes/s, between 1e+10 and 1e+15; "
                                  "got inf"),
    # a unit slip is refused, naming the unit: 3.35 meant as TB/s priced a step at years
    ({"bandwidth": 3.35}, "bandwidth must be in bytes/s, between 1e+10 and 1e+15; got 3.35"),
    ({"flops": {"bfloat16": 989}}, "flops.bfloat16 must be in FLOP/s, between 1e+12 and "
                                   "1e+18; got 989"),
    ({"flops": {"fp8": 1e30}}, "flops.fp8 must be in FLOP/s, between 1e+12 and 1e+18; "
                               "got 1e+30"),
    ({"memory_bytes": 80}, "memory_bytes must be in bytes, between 1.074e+09 and 1.126e+15; "
                           "got 80"),
    ({"interconnect": {"bandwidth": 450}}, "interconnect.bandwidth must be in bytes/s, "
                                           "between 1e+09 and 1e+14; got 450"),
    ({"memory_bytes": 1.5}, "memory_bytes must be a whole number, got 1.5"),
    ({"memory_bytes": True}, "memory_bytes must be a whole number, got true"),
    ({"interconnect": {"bandwidth": -3}}, "interconnect.bandwidth must be in bytes/s"),
    ({"interconnect": 5}, "interconnect must be an object, got 5"),
    # a misspelt key was dropped, its figure left as shipped (and named "given in" the file)
    ({"interconnect": {"bandwith": 1e11}}, "interconnect.bandwith is no field of a profile's "
                                           "interconnect; it takes name, bandwidth, source"),
    ({"sources": {"bandwith": "my lab"}}, "sources.bandwith is no field of a profile's "
                                          "sources; it takes attention, bandwidth"),
    ({"link": 1}, "link is no field of a profile; it takes key, name, memory_bytes"),
    ({"sources": [1]}, "sources must be an object, got [1]"),
    ({"sources": {"bandwidth": 1}}, "sources.bandwidth must be a string, got 1"),
    ({"flops": {"bfloat16": "1e15"}}, 'flops.bfloat16 must be a number, got "1e15"'),
    ({"efficiency": {"step_s": "x"}}, "step_s must be a number, got 'x'"),
    ({"efficiency": 3}, "efficiency must be an object, got 3"),
    ({"flops": {"fp4": 1e15}}, "flops.fp4 is no precision the twin prices; flops takes "
                               "bfloat16, fp8, int8"),
    # each factor's own range, not one sentence of every rule
    ({"efficiency": {"memory": -1}}, "efficiency.memory: must be a share in (0, 20], got -1.0"),
    ({"efficiency": {"overlap": 5}}, "efficiency.overlap: must be a share in [0, 1], got 5.0"),
    ({"efficiency": {"sampler_passes": -3}},
     "efficiency.sampler_passes: must be a number of passes in (0, 20], got -3.0"),
    ({"efficiency": {"attention_context_half": -5}},
     "efficiency.attention_context_half: must be a number of tokens in [0, 1048576], "
     "got -5.0"),
    ({"efficiency": {"step_s": float("nan")}},
     "efficiency.step_s: must be a time in seconds in [0, 1], got nan"),
    # a typo's size is refused too: a 10^9 s step would run a workload for millennia
    ({"efficiency": {"step_s": 1e9}},
     "efficiency.step_s: must be a time in seconds in [0, 1], got 1000000000.0"),
    ({"efficiency": {"gemm_m_half": 1e300}},
     "efficiency.gemm_m_half: must be a number of tokens in [0, 1048576], got 1e+300"),
])
def test_a_gpu_profile_file_names_its_first_bad_field(override: dict[str, object], said: str,
                                                      tmp_path: Path) -> None:
    file = tmp_path / "p.json"
    file.write_text(json.dumps(override))
    with pytest.raises(ConfigError) as raised:
        resolve_target("h100", EngineConfig(model="synthetic:8b"), gpu_profile=file)
    assert said in str(raised.value) and "Traceback" not in str(raised.value)


def test_a_new_gpus_profile_file_refuses_a_field_no_profile_has(tmp_path: Path) -> None:
    """A file defining a new GPU is read whole, not merged: its misspelt keys were dropped."""
    data = PROFILES["h100"].to_dict() | {"key": "x200", "bandwith": 1}
    file = tmp_path / "x200.json"
    file.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="bandwith is no field of a profile; it takes key"):
        resolve_target("x200", EngineConfig(model="synthetic:8b"), gpu_profile=file)


def test_a_new_gpus_profile_file_simulates_it_without_a_band(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--simulate x100 --gpu-profile x100.json` was refused as an unknown GPU ("give a
    profile file whose key is the name", which it was): the check that a file changes the
    shipped profile looked the new name up among the shipped ones. A file of another GPU's
    key over a shipped one was taken without a word."""
    from console.cli.main import main

    mine = {**PROFILES["h100"].to_dict(), "key": "x100", "name": "X100"}
    file = tmp_path / "x100.json"
    file.write_text(json.dumps(mine))
    config = EngineConfig(model="synthetic:8b")
    target = resolve_target("x100", config, gpu_profile=file)
    shape = StepShape(decode_contexts=(100,))
    assert target.predict(shape) == resolve_target("h100", config).predict(shape)
    assert target.no_band == f"{file} defines x100, a GPU no published case was measured on"
    assert main(["bench", "--simulate", "x100", "--gpu-profile", str(file), "--model",
                 "synthetic:8b", "--input-len", "8", "--output-len", "2", "--num-prompts", "2",
                 "--compare", "chunked", "--db", str(tmp_path / "s.db")]) == 0
    assert "no band: " in capsys.readouterr().out
    with pytest.raises(ConfigError, match="is the profile of 'x100', not 'h100': simulate "
                                          "'x100', or give the file the key 'h100'"):
        resolve_target("h100", config, gpu_profile=file)


@pytest.mark.parametrize("spec", ["", "  "])
def test_an_empty_simulate_target_is_an_unknown_gpu_not_an_empty_profile(spec: str) -> None:
    """An empty name once matched the empty key of no profile file, and was read as a
    profile of nothing: "interconnect is missing"."""
    with pytest.raises(ConfigError, match=r"unknown GPU '.*'; choose one of a100"):
        resolve_target(spec, EngineConfig(model="synthetic:8b"))


def test_a_board_with_datasheet_peaks_alone_is_refused_as_having_no_twin_profile() -> None:
    """roofline's --gpu lists rtx4090 (its peaks serve the what-if table); the twin has no
    memory, link or factors for it, and says so rather than call it unknown."""
    with pytest.raises(ConfigError, match="'rtx4090' has datasheet peaks for roofline's "
                                          "what-if table but no twin profile"):
        resolve_target("rtx4090", EngineConfig(model="synthetic:8b"))


def test_a_profile_files_figures_name_the_file_as_their_source(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user's bandwidth over the H100's was shown as the datasheet's, and a user's step_s as
    fitted on the published cases: in --show-profile, in bench's peaks source, in report.md."""
    from console.cli.main import main
    from engine.sim.profiles import profile
    file = tmp_path / "mine.json"
    file.write_text(json.dumps({"bandwidth": 3.0e12, "flops": {"fp8": 1.5e15},
                                "efficiency": {"step_s": 0.004},
                                "interconnect": {"bandwidth": 4e11},
                                "sources": {"memory_bytes": "my lab's nvidia-smi"},
                                "memory_bytes": 80 * 2**30}))
    gpu, given = profile("h100", file), f"given in {file}"
    shipped = PROFILES["h100"]
    assert gpu.source_of("bandwidth") == gpu.source_of("flops.fp8") == given
    assert gpu.source_of("efficiency.step_s") == gpu.interconnect.source == given
    assert gpu.source_of("flops.bfloat16") == shipped.sources["flops"]  # not given: as shipped
    assert gpu.source_of("memory_bytes") == "my lab's nvidia-smi"  # the user's own word wins
    assert gpu.efficiency_source == f"{shipped.efficiency_source}; step_s {given}"
    assert gpu.peaks("bfloat16").source == f"{shipped.sources['flops']}; bandwidth {given}"
    assert gpu.peaks("fp8").source == given
    assert shipped.peaks().source == shipped.sources["flops"]
    assert main(["roofline", "--gpu", "h100", "--show-profile", "--gpu-profile",
                 str(file)]) == 0
    shown = capsys.readouterr().out
    assert f"bandwidth     3 TB/s   [{given}]" in shown
    assert f"fp8 peak      1,500 TFLOP/s   [{given}]" in shown
    assert f"  step_s           0.004   [{given}]" in shown
