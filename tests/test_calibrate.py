"""The step-time predictor, the calibrator on a tiny model, drift detection and the CLI.

The calibrator runs its real sweep on a tiny engine whose clock each forward pass (real too)
advances by what a known predictor says for its shape, so the fit, its held-out error and a
slowed engine's drift are exactly checkable, whatever this machine's load. How well a sweep
fits real step times is a property of the hardware, measured by `tokenflow calibrate` (it
prints the held-out error), not by a unit test.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import text

from console.cli.main import main
from engine import Engine
from engine.batch import Batch, ModelRunnerOutput, StepShape
from engine.budget.auto import CStar
from engine.budget.operations import OperationEfficiency
from engine.budget.predictor import StepTimePredictor
from engine.calibration.calibrate import (
    Probe,
    SweepPlan,
    calibrate,
    compare,
    latest_for,
    save_result,
)
from engine.calibration.drift import DriftMonitor, Job
from engine.calibration.served import (
    QUICK_PROBE_REQUESTS,
    ServedCosts,
    ServedSample,
    measure_served,
)
from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.errors import EngineError
from engine.events import ChunkComplete, Drift, Event, StepComplete
from engine.harness.driver import OutputTokens
from engine.store import calibration_history, drift_events, open_database, save_calibration
from engine.store.database import upgrade_database
from tests.hf_models import save_tiny

TRUE = StepTimePredictor(constant_s=2e-3, multi_token_s=1e-3, per_token_s=5e-5,
                         per_prefill_chunk_s=4e-4, per_decode_seq_s=0.0, per_prefill_pair_s=3e-9,
                         per_decode_context_s=2e-8, points=0, source="truth")

# Small enough for the tiny model to sweep in a few seconds, wide enough to cover every term
# and the reference shapes drift is judged on.
TEST_PLAN = SweepPlan(prefill_chunks=(16, 64, 128, 256), prefill_contexts=(0, 1024),
                      decode_batches=(1, 8, 32), decode_contexts=(64, 1024),
                      mixed=(Probe(32, 0, 16, 128), Probe(128, 0, 8, 512), Probe(64, 256, 32, 64),
                             Probe(128, 512, 4, 1024), Probe(16, 0, 0, 0, chunks=3)),
                      warmup=5, repeats=5)


# A shorter sweep for the five-times-slower drift run.
DRIFT_PLAN = SweepPlan(prefill_chunks=(16, 128, 256), prefill_contexts=(0, 1024),
                       decode_batches=(1, 8, 32), decode_contexts=(64, 1024),
                       mixed=TEST_PLAN.mixed[:2], warmup=2, repeats=3)


def random_shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    shapes = []
    for _ in range(n):
        if rng.random() < 0.2:  # a lone decode: the one-token, matrix-vector step
            shapes.append(StepShape(decode_contexts=(rng.randint(1, 4096),)))
            continue
        prefill = tuple((rng.choice((16, 64, 256, 512)), rng.choice((0, 256, 2048)))
                        for _ in range(rng.randint(0, 2)))
        decodes = tuple(rng.randint(1, 4096) for _ in range(rng.choice((0, 1, 8, 64))))
        shapes.append(StepShape(prefill=prefill or ((32, 0),), decode_contexts=decodes))
    return shapes


class KnownSteps:
    """The engine's clock: each forward pass advances it by `factor` × what `truth` (TRUE
    unless given) predicts for the pass's shape."""

    def __init__(self, truth: StepTimePredictor = TRUE) -> None:
        self.now = 0.0
        self.factor = 1.0
        self.truth = truth

    def __call__(self) -> float:
        return self.now

    def drive(self, engine: Engine) -> None:
        forward = engine.runner.run

        def run(batch: Batch) -> ModelRunnerOutput:
            output = forward(batch)
            self.now += self.factor * self.truth.predict(batch.shape())
            return output

        engine.runner.run = run


@pytest.fixture(scope="module")
def steps() -> KnownSteps:
    return KnownSteps()


@pytest.fixture(scope="module")
def engine(steps: KnownSteps) -> Engine:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"),
                    clock=steps)
    steps.drive(engine)
    return engine


@pytest.fixture(scope="module")
def calibrated(engine: Engine):
    return calibrate(engine, plan=TEST_PLAN)


def run_jobs(engine: Engine, jobs: list[Job], between: Callable[[], object] = lambda: None,
             ) -> None:
    while jobs:
        jobs.pop(0)(engine)
        between()


# --- the predictor -----------------------------------------------------------------------

def test_fit_recovers_the_coefficients_of_exact_data() -> None:
    shapes = random_shapes(60)
    fitted = StepTimePredictor.fit(shapes, [TRUE.predict(s) for s in shapes])
    assert fitted.points == 60
    assert fitted.coefficients == pytest.approx(TRUE.coefficients, rel=1e-6, abs=1e-12)


def test_fit_with_noise_and_outliers_stays_close_and_non_negative() -> None:
    rng = random.Random(1)
    shapes = random_shapes(80, seed=1)
    seconds = [TRUE.predict(s) * rng.uniform(0.97, 1.03) for s in shapes]
    seconds[5] *= 4  # a step that lost its core to another process
    seconds[17] *= 3
    fitted = StepTimePredictor.fit(shapes, seconds)
    assert fitted.points <= 78  # both outliers dropped
    assert all(c >= 0 for c in fitted.coefficients)
    errors = sorted(abs(fitted.predict(s) / TRUE.predict(s) - 1) for s in shapes)
    assert errors[len(errors) // 2] < 0.02


def test_fit_refuses_too_few_or_bad_points() -> None:
    shapes = random_shapes(3)
    with pytest.raises(ConfigError, match="at least 7"):
        StepTimePredictor.fit(shapes, [1.0] * 3)
    shapes = random_shapes(10)
    with pytest.raises(ConfigError, match="finite and > 0"):
        StepTimePredictor.fit(shapes, [0.0] + [1.0] * 9)


def test_fit_finds_the_knee_below_which_steps_are_weight_bound() -> None:
    """Steps of up to 12 tokens pay the linear layers of 12 (one read of the weights): the
    fit's knee search finds 12 and the coefficients, so a 4-decode step is priced like a
    12-token one rather than 4 tokens' worth above a lone decode."""
    truth = dataclasses.replace(TRUE, token_knee=12.0)
    shapes = random_shapes(40) + [StepShape(decode_contexts=(64,) * n) for n in range(1, 33)]
    fitted = StepTimePredictor.fit(shapes, [truth.predict(s) for s in shapes])
    assert fitted.token_knee == 12.0
    assert fitted.coefficients == pytest.approx(truth.coefficients, rel=1e-6, abs=1e-12)
    few, one = StepShape(decode_contexts=(64,) * 4), StepShape(decode_contexts=(64,) * 1)
    assert fitted.predict(few) - fitted.predict(one) == pytest.approx(
        TRUE.multi_token_s + 3 * (TRUE.per_decode_seq_s + 64 * TRUE.per_decode_context_s))


def test_a_stored_predictor_without_a_knee_keeps_its_meaning() -> None:
    """Calibrations stored before the knee existed load with a knee of 1: the plain
    per-token price they were fitted with, so every prediction is unchanged."""
    stored = TRUE.to_dict()
    for newer in ("token_knee", "sliding_window", "windowed_share"):
        del stored[newer]
    old = StepTimePredictor.from_dict(stored)
    assert old.token_knee == 1.0 and old == TRUE
    for shape in random_shapes(20, seed=3):
        linear = (TRUE.constant_s + TRUE.multi_token_s * (shape.num_tokens > 1)
                  + TRUE.per_token_s * shape.num_tokens
                  + TRUE.per_prefill_chunk_s * len(shape.prefill)
                  + TRUE.per_decode_seq_s * len(shape.decode_contexts)
                  + TRUE.per_prefill_pair_s * sum(c * b + c * (c + 1) / 2
                                                  for c, b in shape.prefill)
                  + TRUE.per_decode_context_s * sum(shape.decode_contexts))
        assert old.predict(shape) == pytest.approx(linear, rel=1e-12)
    kneed = dataclasses.replace(TRUE, token_knee=6.5)
    assert StepTimePredictor.from_dict(kneed.to_dict()) == kneed
    with pytest.raises(ConfigError, match="token_knee"):
        dataclasses.replace(TRUE, token_knee=0.5)


def test_a_windowed_model_is_fitted_and_priced_on_the_keys_its_layers_see(
        tmp_path: Path) -> None:
    """Tiny Qwen3 with its second layer windowed at 8 keys: the calibration's steps cost
    what a predictor counting each layer's keys says, and the fit (told the model's window
    by the calibrator) recovers it; past the window only the full layer's keys add cost."""
    truth = dataclasses.replace(TRUE, sliding_window=8, windowed_share=0.5)
    steps = KnownSteps(truth)
    directory = save_tiny("qwen3", tmp_path / "qwen3")
    engine = Engine(EngineConfig(model=str(directory), device="cpu", dtype="float32"),
                    clock=steps)
    steps.drive(engine)
    plan = SweepPlan(prefill_chunks=(4, 16, 64, 128), prefill_contexts=(0, 256),
                     decode_batches=(1, 4, 16), decode_contexts=(4, 64, 512),
                     mixed=(Probe(32, 0, 4, 128), Probe(16, 64, 8, 4), Probe(8, 0, 0, 0, chunks=3)),
                     warmup=1, repeats=2)
    fitted = calibrate(engine, plan=plan).predictor
    assert (fitted.sliding_window, fitted.windowed_share) == (8, 0.5)
    assert fitted.coefficients == pytest.approx(truth.coefficients, rel=1e-6, abs=1e-12)
    assert StepTimePredictor.from_dict(fitted.to_dict()) == fitted
    near, far = StepShape(decode_contexts=(400,)), StepShape(decode_contexts=(800,))
    assert fitted.predict(far) - fitted.predict(near) == pytest.approx(
        0.5 * 400 * truth.per_decode_context_s)
    assert TRUE.predict(far) - TRUE.predict(near) == pytest.approx(
        400 * truth.per_decode_context_s)
    with pytest.raises(ConfigError, match="windowed_share"):
        dataclasses.replace(TRUE, windowed_share=0.5)  # a share needs a window


def test_predictor_round_trips_and_drives_the_roofline(engine: Engine) -> None:
    assert StepTimePredictor.from_dict(TRUE.to_dict()) == TRUE
    with pytest.raises(ConfigError, match="recalibrate"):
        StepTimePredictor.from_dict({"constant_s": 1.0})
    budget = TRUE.budget_model(engine.model_config, 4, engine.peaks)
    # F from 2P per token over the per-token time, W from k per decode context token.
    assert budget.peaks.flops == pytest.approx(2 * budget.params / TRUE.per_token_s)
    assert budget.peaks.bandwidth == pytest.approx(budget.kv_bytes_per_token / 2e-8)
    assert budget.step_overhead_s == TRUE.constant_s


# --- the calibrator ----------------------------------------------------------------------

def test_calibration_fits_and_reports_held_out_error(engine: Engine, calibrated) -> None:
    result = calibrated
    kinds = {p.probe.kind for p in result.points}
    assert kinds == {"prefill", "decode", "mixed"}
    assert len(result.points) == len(TEST_PLAN.probes()) and not result.skipped
    assert 4 <= len(result.heldout_errors) < len(result.points) // 2
    assert all(p.runs == TEST_PLAN.repeats for p in result.points)
    # Every step took what TRUE says (the engine's clock): each shape's median is exactly
    # that, the fit recovers TRUE and predicts the held-out shapes it never saw.
    for point in result.points:
        assert point.median_s == pytest.approx(point.predicted_s, rel=1e-9)
    assert result.predictor.coefficients == pytest.approx(TRUE.coefficients, rel=1e-6,
                                                          abs=1e-12)
    assert result.heldout_median_abs_error < 1e-9
    point = result.points[0]
    assert point.achieved_flops == pytest.approx(point.flops / point.median_s)
    assert point.bandwidth_utilization == pytest.approx(
        point.bytes_moved / point.median_s / engine.peaks.bandwidth)
    assert result.kv.blocks == engine.blocks.num_blocks  # the whole pool was free
    assert result.kv.capacity_tokens == engine.blocks.num_blocks * engine.blocks.block_size
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every probe block released
    table = json.loads(json.dumps(result.to_dict()))["table"]
    assert {"kind", "chunk", "median_s", "mean_s", "predicted_s", "held_out"} <= set(table[0])


def test_a_probe_of_several_chunks_is_one_step_of_as_many_prompts(calibrated) -> None:
    """Several short prompts in one step price the per-chunk cost apart from the per-step
    one; such a step is "mixed", never a row of the prefill table."""
    assert Probe(16, 0, chunks=3).kind == "mixed" and Probe(16, 0).kind == "prefill"
    point = next(p for p in calibrated.points if p.probe.chunks == 3)
    # the engine's clock moved by what TRUE says of three 16-token chunks in one step
    assert point.median_s == pytest.approx(TRUE.predict(StepShape(prefill=((16, 0),) * 3)))


def test_probes_beyond_the_pool_or_model_length_are_skipped(engine: Engine) -> None:
    too_long = Probe(chunk=16, chunk_context=engine.max_model_len)
    too_many = Probe(decode_seqs=engine.blocks.num_blocks + 1, decode_context=1)
    plan = SweepPlan(prefill_chunks=(8, 16, 32, 48), prefill_contexts=(0, 32),
                     decode_batches=(1, 2), decode_contexts=(8, 32), mixed=(too_long, too_many),
                     warmup=1, repeats=1)
    result = calibrate(engine, plan=plan)
    assert set(result.skipped) == {too_long, too_many}
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_probes_past_the_worst_step_the_pool_was_sized_for_are_skipped(
        steps: KnownSteps) -> None:
    """A GPU's pool leaves room for the budget's ceiling and max_num_seqs rows, no more: a
    probe past either is a step the engine never runs, and could run the device out."""
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 max_num_batched_tokens=32, max_num_batched_tokens_cap=64,
                                 max_num_seqs=4), clock=steps)
    steps.drive(engine)
    too_wide = Probe(chunk=40, chunks=2)  # 80 tokens over a ceiling of 64
    too_many_rows = Probe(chunk=8, decode_seqs=4, decode_context=8)  # 5 rows over 4
    plan = SweepPlan(prefill_chunks=(8, 16, 32, 48), prefill_contexts=(0, 16),
                     decode_batches=(1, 2), decode_contexts=(8, 32),
                     mixed=(too_wide, too_many_rows, Probe(chunk=60, decode_seqs=3,
                                                           decode_context=8)),
                     warmup=1, repeats=1)
    result = calibrate(engine, plan=plan)
    assert set(result.skipped) == {too_wide, too_many_rows}


def test_a_sweep_too_few_of_whose_shapes_fit_names_the_pool_and_the_fix(
        steps: KnownSteps) -> None:
    """--block-size 100000 left a tiny model's pool five blocks (a max_model_len of 100 does
    the same to this plan): the few shapes that ran were refused by the fit as 'need at least
    7 timed steps', naming no cause."""
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 max_model_len=100), clock=steps)
    steps.drive(engine)
    with pytest.raises(EngineError, match=rf"only \d of the sweep's shapes fit this engine's "
                                          rf"KV pool \({engine.blocks.num_blocks} blocks of "
                                          rf"16 tokens\) and max_model_len, and the fit needs "
                                          rf"7: lower --block-size, or raise --kv-cache-bytes "
                                          rf"or --max-model-len"):
        calibrate(engine, plan=TEST_PLAN)


def test_each_timed_run_is_the_last_of_a_burst_of_its_shape(engine: Engine) -> None:
    plan = SweepPlan(prefill_chunks=(8, 16, 32, 48), prefill_contexts=(0, 32),
                     decode_batches=(1, 2), decode_contexts=(8, 32), mixed=(), warmup=1,
                     repeats=2, burst=3)
    steps: list[StepShape] = []
    run = engine.runner.run

    def counted(batch: Batch) -> ModelRunnerOutput:
        if batch.prefills or batch.decodes:  # not the messages that lend probe requests
            steps.append(batch.shape())
        return run(batch)

    engine.runner.run = counted
    result = calibrate(engine, plan=plan)
    assert all(p.runs == 2 for p in result.points)
    # warm-up (1) then two passes of three steps back to back per shape
    assert len(steps) == 12 * (1 + 2 * 3)
    passes = steps[12:]
    assert all(len(set(passes[i:i + 3])) == 1 for i in range(0, len(passes), 3))
    with pytest.raises(EngineError, match="burst >= 1"):
        calibrate(engine, plan=dataclasses.replace(plan, burst=0))


def test_apply_switches_budgeting_and_recommended_chunk(calibrated) -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    predictor = calibrated.predictor
    engine.apply_calibration(predictor)
    shape = StepShape(prefill=((64, 0),))
    assert engine.scheduler.controller.predict(shape) == predictor.predict(shape)
    expected = predictor.budget_model(engine.model_config, 4, engine.peaks)
    # C* at no load, held within [chunk_tile, max_num_batched_tokens] as the engine holds it
    config = engine.config
    assert engine.snapshot().recommended_chunk_size == CStar().observe(
        0.0, 0, 0, expected, config.chunk_tile, config.max_num_batched_tokens)
    engine.add_request(list(range(1, 200)), SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    request = engine.scheduler.recent[-1]
    assert request.budgeted_prefill_s == pytest.approx(
        sum(c.predicted_s for c in request.chunks), rel=0.5)  # budget from the predictor


def test_calibrating_between_steps_leaves_serving_exact(calibrated) -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 max_num_batched_tokens=32))
    prompts = [[(7 * i + j) % 300 + 1 for j in range(40 + 10 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=12)
    expected = engine.generate(prompts, params)
    ids = [engine.add_request(p, params) for p in prompts]
    jobs: list[Job] = []
    monitor = DriftMonitor(engine, jobs.append, plan=TEST_PLAN)
    monitor.request("test")
    outputs: dict[str, list[int]] = {}
    tokens = OutputTokens()

    def step() -> None:
        for out in engine.step():
            held = tokens.add(out)
            if out.finished:
                outputs[out.request_id] = held

    run_jobs(engine, jobs, between=step)
    while engine.has_unfinished():
        step()
    assert [outputs[i] for i in ids] == expected
    assert monitor.recalibrations == 1 and engine.predict == monitor.reference.predict
    engine.blocks.check_consistent([])


# --- drift -------------------------------------------------------------------------------

def test_recalibration_of_a_slowed_engine_is_a_drift_event_of_its_size(
        engine: Engine, steps: KnownSteps, calibrated) -> None:
    jobs: list[Job] = []
    seen: list[Event] = []
    unsubscribe = engine.bus.subscribe(seen.append)
    monitor = DriftMonitor(engine, jobs.append, reference=calibrated.predictor, plan=DRIFT_PLAN)
    steps.factor = 5.0  # fault injection: every step takes five times as long, +400%
    try:
        assert monitor.request()
        assert not monitor.request()  # one at a time
        run_jobs(engine, jobs)
    finally:
        steps.factor = 1.0
        engine.bus.drain()
        unsubscribe()
    drifts = [e for e in seen if isinstance(e, Drift)]
    assert len(drifts) == 1
    assert drifts[0].deviation == pytest.approx(4.0, rel=1e-6), drifts[0].detail
    assert monitor.pending_reason is None and monitor.recalibrations == 1


def test_compare_is_the_median_relative_change_over_the_reference_shapes() -> None:
    slower = StepTimePredictor(*(c * 1.3 for c in TRUE.coefficients), points=0, source="x")
    assert compare(TRUE, TRUE) == 0.0
    assert compare(TRUE, slower) == pytest.approx(0.3)
    assert compare(slower, TRUE) == pytest.approx(1 / 1.3 - 1)


def test_monitor_logs_chunks_off_their_prediction_without_recalibrating(
        engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """Seed 000 §4's 15% deviation is a warning per chunk; alone it starts no sweep."""
    jobs: list[Job] = []
    monitor = DriftMonitor(engine, jobs.append, interval_s=100, clock=lambda: 0.0)

    def chunk(duration: float) -> ChunkComplete:
        return ChunkComplete(request_id="r", chunk_index=0, tokens=16, start=0,
                             duration_s=duration, estimated_bytes=0.0, predicted_s=1.0,
                             prefill_done=False)

    with caplog.at_level(logging.WARNING, logger="engine.calibration.drift"):
        for duration in (1.1, 0.9, 1.14, 0.86):  # within 15%: nothing
            monitor.observe(chunk(duration))
        assert monitor.off_prediction_total == 0 and not caplog.records
        for duration in (1.2, 0.5, 1.3, 1.5, 2.0, 3.0):
            monitor.observe(chunk(duration))
    assert monitor.off_prediction_total == 6 and not jobs
    assert len(caplog.records) == 6 and "+20% off" in caplog.records[0].getMessage()


def feed_ratio(engine: Engine, start: float, seconds: float, ratios: Callable[[int], float],
               per_second: int = 20) -> float:
    """Steps into the engine's live ratio as if they ran from `start` for `seconds`."""
    now = start
    for i in range(int(seconds * per_second)):
        now = start + i / per_second
        engine.step_ratio.observe(now, ratios(i) * 0.01, 0.01)
    return now


def test_drift_must_persist_beyond_the_threshold_and_runs_are_spaced(engine: Engine) -> None:
    now = [0.0]
    jobs: list[Job] = []
    monitor = DriftMonitor(engine, jobs.append, interval_s=3600, persist_s=30,
                           min_interval_s=300, live_threshold=0.25, clock=lambda: now[0],
                           plan=dataclasses.replace(DRIFT_PLAN, warmup=0, repeats=1))
    step = StepComplete(step=1, prefill_tokens=16, decode_seqs=0, duration_s=0.01,
                        predicted_s=0.01, mode="NORMAL")
    engine.step_ratio.reset()
    try:
        # Noisy but centred steps (every third one 4x slow, as a shared CPU gives): never.
        end = 0.0
        for second in range(0, 400, 10):
            end = feed_ratio(engine, second, 10, lambda i: 4.0 if i % 3 == 0 else 0.8)
            now[0] = end
            monitor.observe(step)
        assert not jobs and abs(engine.step_ratio.value - 1) < 0.25
        # A slowdown of +60%: the window's median moves past 25% in ~30 s, then must hold
        # for persist_s more before a sweep starts.
        start, first_seen = end, None
        for second in range(120):
            now[0] = feed_ratio(engine, start + second, 1, lambda i: 1.6)
            monitor.observe(step)
            if first_seen is None and engine.step_ratio.value > 1.25:
                first_seen = now[0]
            if jobs:
                break
        assert jobs and first_seen is not None and now[0] - first_seen >= 30
        assert "off the predictor" in monitor.pending_reason
        run_jobs(engine, jobs)  # the sweep (a short one) concludes and is applied
        assert monitor.recalibrations == 1 and monitor.pending_reason is None
        # Steps still run 1.6x the new predictor (the injected ratio stays): drift persists,
        # but no second sweep comes within min_interval_s of the first.
        start = now[0]
        for second in range(320):
            now[0] = feed_ratio(engine, start + second, 1, lambda i: 1.6)
            monitor.observe(step)
            if jobs:
                break
        assert jobs and now[0] - start >= 300
    finally:
        engine.step_ratio.reset()


def test_monitor_recalibrates_on_its_interval(engine: Engine) -> None:
    now = [0.0]
    jobs: list[Job] = []
    monitor = DriftMonitor(engine, jobs.append, interval_s=3600, clock=lambda: now[0])
    step = StepComplete(step=1, prefill_tokens=0, decode_seqs=1, duration_s=0.01,
                        predicted_s=0.01, mode="NORMAL")
    now[0] = 3599.0
    monitor.observe(step)
    assert not jobs
    now[0] = 3600.0
    monitor.observe(step)
    assert len(jobs) == 1 and "periodic" in monitor.pending_reason
    with pytest.raises(ConfigError, match="interval_s"):
        DriftMonitor(engine, jobs.append, interval_s=0)
    with pytest.raises(ConfigError, match="persist_s"):
        DriftMonitor(engine, jobs.append, persist_s=0)


# --- the store and the CLI ---------------------------------------------------------------

def test_result_is_stored_with_its_table_and_predictor(tmp_path: Path, engine: Engine,
                                                       calibrated) -> None:
    database = open_database(tmp_path / "t.db")
    with database.session() as session:
        run_id = save_result(session, calibrated, "test")
        record = latest_for(session, engine)
    database.close()
    assert record is not None and record.id == run_id
    assert StepTimePredictor.from_dict(record.params) == calibrated.predictor
    prefill = [p for p in calibrated.points if p.probe.kind == "prefill"]
    assert len(record.table) == len(prefill)
    assert record.info["heldout_median_abs_error"] == calibrated.heldout_median_abs_error
    # the same steps in the GPU twin's per-operation form, beside the predictor
    operations = record.info["operations"]
    assert operations["form"] == "operations"
    assert OperationEfficiency.from_dict(operations["efficiency"]) == (
        calibrated.operations.efficiency)
    assert operations["heldout_median_abs_error"] >= 0


def test_runs_keep_their_reason_and_older_runs_upgrade_without_one(tmp_path: Path,
                                                                  calibrated) -> None:
    database = open_database(tmp_path / "old.db", upgrade=False)
    try:
        upgrade_database(database, "0001")  # a store from before reasons were kept
        with database.engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO calibration_runs (created_at, model, device, info, params) "
                "VALUES (1.0, 'synthetic:tiny', 'cpu', '{}', '{}')"))
        upgrade_database(database)
        with database.session() as session:
            save_result(session, calibrated, "steps +40% off the predictor for 30 s")
            newest, older = calibration_history(session, model="synthetic:tiny")
    finally:
        database.close()
    assert older.reason == "" and newest.reason == "steps +40% off the predictor for 30 s"


def test_cli_calibrates_stores_and_flags_drift(tmp_path: Path, capsys: pytest.CaptureFixture,
                                               calibrated) -> None:
    db = tmp_path / "cli.db"
    # A stored calibration whose steps take microseconds (TRUE / 1000), far faster than any
    # machine runs even the tiny model: the CLI's real sweep is a large drift from it, by a
    # margin no load can close.
    fast = StepTimePredictor(*(c / 1000 for c in calibrated.predictor.coefficients), points=1,
                             source="test")
    database = open_database(db)
    with database.session() as session:
        save_calibration(session, model="synthetic:tiny", device="cpu", table=[],
                         params=fast.to_dict(), info={"dtype": "float32"})
    database.close()
    assert main(["calibrate", "--model", "synthetic:tiny", "--device", "cpu", "--quick",
                 "--json", "--no-progress", "--db", str(db)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["points"] == len(out["table"]) > 0
    assert 0 <= out["heldout_median_abs_error"] < 1
    assert out["previous_id"] == 1 and out["calibration_id"] == 2
    assert out["drift"]["kind"] == "drift" and out["drift"]["deviation"] > 0.4
    assert out["served"]["steps"] > 0 and out["served"]["prefill_scale"] > 0  # a probe served
    assert set(out["phases"]) == {"engine_start_s", "sweep_s", "served_probe_s"}
    assert all(v > 0 for v in out["phases"].values())
    database = open_database(db)
    with database.session() as session:
        assert len(calibration_history(session)) == 2
        events = drift_events(session)
    database.close()
    assert len(events) == 1 and events[0].deviation == out["drift"]["deviation"]


@pytest.mark.parametrize("command, flag", [
    (["calibrate"], ["--slo-ttft-ms", "500"]),
    *((command, flag) for command in (["calibrate"], ["run"], ["bench"],
                                      ["bench", "--simulate", "h100"])
      for flag in (["--stats-window-s", "5"], ["--logprobs-mode", "processed_logprobs"])),
])
def test_cli_refuses_serving_flags_a_sweep_or_a_batch_would_ignore(
        command: list[str], flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """No request of a sweep, a run or a bench asks for logprobs, and no one reads their
    live percentiles' window: the flags were taken and dropped."""
    with pytest.raises(SystemExit) as exited:
        main([*command, "--model", "synthetic:tiny", *flag])
    assert exited.value.code == 2
    assert f"unrecognized arguments: {' '.join(flag)}" in capsys.readouterr().err


def test_cli_refuses_a_bad_database_before_loading(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not sqlite at all")
    assert main(["calibrate", "--model", "synthetic:tiny", "--db", str(bad)]) == 2
    assert "not a SQLite database" in capsys.readouterr().err


def test_history_lists_the_stored_runs_and_the_ids_the_twin_takes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The twin's refusals said `tokenflow calibrate --history` lists the ids, and no such
    flag existed: the only place an id showed was the line a calibration printed as it ended."""
    db = tmp_path / "s.db"
    database = open_database(db)
    with database.session() as session:
        for model, error in (("synthetic:tiny", 0.05),
                             ("/models/a-very-long-directory/llama", None)):
            save_calibration(session, model=model, device="cpu", table=[], params={},
                             info={"dtype": "float32", "points": 16, "quick": True,
                                   "heldout_median_abs_error": error})
    database.close()
    assert main(["calibrate", "--history", "--db", str(db)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["id", "measured"]
    assert out[1].split()[0] == "2" and "…ry-long-directory/llama  cpu" in out[1]
    assert out[1].rstrip().endswith("-  quick")
    assert out[2].split()[0] == "1" and "5.0%" in out[2]
    assert "calibration:ID" in out[-1]
    assert main(["calibrate", "--history", "--model", "synthetic:tiny", "--json", "--db",
                 str(db)]) == 0
    rows = json.loads(capsys.readouterr().out)["calibrations"]
    assert [(r["id"], r["shapes"], r["heldout_median_abs_error"]) for r in rows] == [
        (1, 16, 0.05)]
    # listing measures nothing, so the flags that shape a measurement are refused, named
    assert main(["calibrate", "--history", "--quick", "--dtype", "float32", "--no-progress",
                 "--db", str(db)]) == 2
    assert ("--dtype, --[no-]progress, --quick shape a new one: drop them, or drop --history"
            in capsys.readouterr().err)
    # and it reads: a mistyped store is refused, not created
    assert main(["calibrate", "--history", "--db", str(tmp_path / "typo.db")]) == 2
    assert not (tmp_path / "typo.db").exists()
    with pytest.raises(ConfigError, match=r"no stored calibration with id 9 \(`tokenflow "
                                          r"calibrate --history` lists them\)"):
        from engine.sim.target import resolve_target
        with open_database(db).session() as session:
            resolve_target("calibration:9", EngineConfig(model="synthetic:tiny"),
                           session=session)


# --- what serving costs beyond the sweep --------------------------------------------------

def test_the_served_probe_fits_host_time_and_prefill_steps_served_price() -> None:
    """The engine's clock: each forward pass as TRUE prices it, a step with a prefill chunk
    at 1.2x that, and scheduling that takes 1 ms + 0.1 ms a decode + 0.5 ms a prefill chunk;
    the probe fits exactly those."""
    steps = KnownSteps()
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"),
                    clock=steps)
    forward, schedule = engine.runner.run, engine.scheduler.schedule

    def run(batch: Batch) -> ModelRunnerOutput:
        output = forward(batch)
        steps.now += TRUE.predict(batch.shape()) * (1.2 if batch.prefills else 1.0)
        return output

    def scheduled() -> Batch:
        batch = schedule()
        if batch.prefills or batch.decodes:
            steps.now += 1e-3 + 1e-4 * len(batch.decodes) + 5e-4 * len(batch.prefills)
        return batch

    engine.runner.run, engine.scheduler.schedule = run, scheduled
    with pytest.raises(EngineError, match="apply it first"):
        measure_served(engine)
    engine.apply_calibration(TRUE)
    costs = measure_served(engine)
    assert costs.step_s == pytest.approx(1e-3)
    assert costs.per_decode_s == pytest.approx(1e-4)
    assert costs.per_prefill_chunk_s == pytest.approx(5e-4)
    assert costs.prefill_scale == pytest.approx(1.2)
    assert costs.steps > 20 and not engine.has_unfinished()
    assert ServedCosts.from_dict(costs.to_dict()) == costs
    quick = measure_served(engine, requests=QUICK_PROBE_REQUESTS)
    assert quick.per_prefill_chunk_s == pytest.approx(5e-4)
    assert quick.prefill_scale == pytest.approx(1.2)
    assert 3 <= quick.steps < costs.steps and not engine.has_unfinished()
    engine.add_request([5] * 8, SamplingParams(max_tokens=2))
    with pytest.raises(EngineError, match="idle engine"):
        measure_served(engine)


def test_served_costs_drop_a_step_that_lost_its_core() -> None:
    samples = [ServedSample(chunks, decodes, 0.01, 0.01,
                            0.01 + 1e-3 + 1e-4 * decodes + 5e-4 * chunks)
               for chunks in (0, 1, 2) for decodes in (1, 4, 9, 16)]
    samples.append(ServedSample(0, 4, 0.01, 0.01, 0.2))  # 190 ms of something else
    costs = ServedCosts.fit(samples)
    assert costs.step_s == pytest.approx(1e-3, rel=1e-6)
    assert costs.steps == len(samples) - 1
    assert costs.prefill_scale == 1.0
    with pytest.raises(EngineError, match="at least 3"):
        ServedCosts.fit(samples[:2])


def test_this_and_the_calibrations_id_make_one_twin(
        calibrated, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--simulate this` measured this host's peaks afresh and ran a CPU calibration at a
    CPU run's lengths, while `--simulate calibration:1` (the same calibration) took its stored
    peaks and GPU lengths: 478 against 3,819 tokens, 1.1 against 1.7 simulated seconds. On
    CUDA, `this` looked the calibration up as "cuda:0", never the GPU's model it is stored by."""
    import engine.calibration.calibrate as calibrate_module
    from engine.sim.target import resolve_target

    db = tmp_path / "cal.db"
    database = open_database(db)
    with database.session() as session:
        save_result(session, calibrated, "test")
        this = resolve_target("this", EngineConfig(model="synthetic:tiny"), session=session)
        by_id = resolve_target("calibration:1", EngineConfig(model="synthetic:tiny"),
                               session=session)
    database.close()
    assert (this.peaks, this.kv_cache_bytes, this.device, this.device_type) == (
        by_id.peaks, by_id.kv_cache_bytes, by_id.device, by_id.device_type)
    assert this.device_type == "cpu" and this.peaks.name == calibrated.peaks.name
    reports = []
    for spec in ("this", "calibration:1"):
        assert main(["bench", "--simulate", spec, "--model", "synthetic:tiny", "--workload",
                     "chat", "--num-requests", "4", "--compare", "chunked", "--db", str(db),
                     "--json", "--quiet"]) == 0
        report = json.loads(capsys.readouterr().out)
        run = report["runs"]["chunked"]
        reports.append((report["workload"], run["wall_s"], run["steps"], run["ttft_ms"]))
    assert reports[0] == reports[1]
    # on a GPU the key is the GPU's model, as calibrate stores it
    gpu = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(calibrate_module, "device_key", lambda device: gpu)
    database = open_database(db)
    with database.session() as session:
        stored = save_calibration(session, model="synthetic:tiny", device=gpu, table=[],
                                  params=calibrated.predictor.to_dict(),
                                  info={k: v for k, v in calibrated.to_dict().items()
                                        if k not in ("model", "device")})
        on_gpu = resolve_target("this", EngineConfig(model="synthetic:tiny"), session=session)
    database.close()
    assert on_gpu.details["calibration_id"] == stored and on_gpu.device == f"sim:{gpu}"
    assert on_gpu.device_type == "sim"
