"""The roofline reproduces the numbers of seed 003; the budget model and the three-constraint
table behave as their definitions say."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.batch import StepShape
from engine.budget.auto import token_budget_for
from engine.budget.cost_model import (
    BudgetModel,
    BudgetSegment,
    budget_limits,
    budget_table,
    window_pairs,
)
from engine.budget.peaks import GPU_PRESETS, DevicePeaks, measure_peaks
from engine.budget.roofline import Roofline
from engine.config import ConfigError
from engine.model.config import preset

GIB = 1 << 30
SEED = Roofline(params=7e9, flops=300e12, bandwidth=2e12, kv_bytes_per_token=524288)


# --- seed 003 §4, §6·补一, §7, §13 ---------------------------------------------------------

@pytest.mark.parametrize(("decode_seqs", "expected"), [(32, 486), (8, 234), (64, 821)])
def test_balance_chunk_matches_the_seed(decode_seqs: int, expected: int) -> None:
    # The seed rounds 1 + DSk/2P to 5.9 for D=64, hence 821 against the exact 822.3.
    assert SEED.balance_chunk(decode_seqs, 2048) == pytest.approx(expected, abs=2)


def test_machine_balance_and_memory_floor() -> None:
    assert SEED.machine_balance == 150
    step = SEED.step_time(128, 32, 2048)
    assert step.bound == "memory"
    assert step.tau_s * 1e3 == pytest.approx(24.2, abs=0.05)
    # weights 14 GB / 2 TB/s = 7.0 ms, KV 34.4 GB / 2 TB/s = 17.2 ms
    assert SEED.weight_bytes / SEED.bandwidth * 1e3 == pytest.approx(7.0)
    kv_ms = step.memory_s * 1e3 - 7.0
    assert kv_ms == pytest.approx(17.2, abs=0.05)


def test_seed_table_rows() -> None:
    rows = SEED.table([128, 486, 2048, 4096], prompt=4096, decode_seqs=32, context=2048)
    assert [r.rounds for r in rows] == [32, 9, 2, 1]
    assert [r.bound for r in rows] == ["memory", "balanced", "compute", "compute"]
    expected_tau = [24.2, 24.2, 97.1, 192.6]
    expected_ttft = [774, 218, 194, 193]
    for row, tau, ttft in zip(rows, expected_tau, expected_ttft, strict=True):
        assert row.tau_ms == pytest.approx(tau, abs=0.1)
        assert row.tpot_ms == row.tau_ms
        assert row.ttft_ms == pytest.approx(ttft, abs=0.6)


def test_balance_chunk_equalises_compute_and_memory() -> None:
    chunk = SEED.balance_chunk(32, 2048)
    compute = 2 * SEED.params * (chunk + 32) / SEED.flops
    memory = SEED.step_time(0, 32, 2048).memory_s
    assert compute == pytest.approx(memory)
    assert compute * 1e3 == pytest.approx(24.2, abs=0.05)


def test_kv_capacity_and_concurrency() -> None:
    assert SEED.kv_capacity_tokens(20 * GIB) == 40960
    assert SEED.max_concurrency(20 * GIB, 2048) == 20


def test_prefix_hits_shorten_ttft() -> None:
    full = SEED.ttft(4096, 486, 32, 2048)
    half = SEED.ttft(4096, 486, 32, 2048, hit_rate=0.5)
    assert SEED.rounds(4096, 486, hit_rate=0.5) == 5  # ⌈2048/486⌉
    assert half == pytest.approx(full * 5 / 9)
    assert SEED.rounds(4096, 486, hit_rate=1.0) == 1  # the first token still needs a step


def test_preemption_cost_and_intensities() -> None:
    assert SEED.preempt_cost_flops(2048) == 2 * 7e9 * 2048
    # decode intensity climbs with batch but never past 2P/(Sk)
    ceiling = 2 * SEED.params / (2048 * SEED.kv_bytes_per_token)
    intensities = [SEED.decode_intensity(b, 2048) for b in (1, 8, 64, 10_000)]
    assert intensities == sorted(intensities)
    assert intensities[-1] < ceiling
    assert intensities[-1] == pytest.approx(ceiling, rel=0.01)
    # prefill goes past the machine balance: compute bound
    assert SEED.prefill_intensity(4096) > SEED.machine_balance > SEED.decode_intensity(32, 2048)


def test_quantized_weights_move_fewer_bytes() -> None:
    int4 = Roofline(params=7e9, flops=300e12, bandwidth=2e12, kv_bytes_per_token=524288,
                    weight_bits=4)
    assert int4.weight_bytes == SEED.weight_bytes / 4 == 3.5e9
    assert int4.step_time(128, 32, 2048).memory_s == pytest.approx(
        SEED.step_time(128, 32, 2048).memory_s - (14e9 - 3.5e9) / 2e12)
    # compute is unchanged, so less memory time means a smaller balance chunk
    assert int4.step_time(128, 32, 2048).compute_s == SEED.step_time(128, 32, 2048).compute_s
    assert int4.balance_chunk(32, 2048) < SEED.balance_chunk(32, 2048)


@given(params=st.floats(1e6, 1e12), flops=st.floats(1e10, 1e16), bandwidth=st.floats(1e9, 1e13),
       k=st.floats(1e3, 1e7), bits=st.sampled_from([4, 8, 16, 32]),
       decode_seqs=st.integers(0, 512), context=st.integers(1, 1 << 17))
def test_balance_chunk_solves_the_step_equation(params: float, flops: float, bandwidth: float,
                                                k: float, bits: int, decode_seqs: int,
                                                context: int) -> None:
    r = Roofline(params=params, flops=flops, bandwidth=bandwidth, kv_bytes_per_token=k,
                 weight_bits=bits)
    chunk = r.balance_chunk(decode_seqs, context)
    compute = 2 * params * (chunk + decode_seqs) / flops
    memory = (r.weight_bytes + decode_seqs * context * k) / bandwidth
    assert compute == pytest.approx(memory, rel=1e-9)


@pytest.mark.parametrize("field", ["params", "flops", "bandwidth", "kv_bytes_per_token"])
@pytest.mark.parametrize("value", [0, -1.0, math.inf])
def test_roofline_rejects_bad_inputs(field: str, value: float) -> None:
    good = {"params": 7e9, "flops": 300e12, "bandwidth": 2e12, "kv_bytes_per_token": 524288}
    with pytest.raises(ConfigError) as info:
        Roofline(**{**good, field: value})
    assert info.value.field == field


# --- the model-aware budget model ----------------------------------------------------------

PEAKS = DevicePeaks("test", flops=100e12, bandwidth=1e12, source="test")


def _model(name: str = "7b", overhead_s: float = 0.0) -> BudgetModel:
    return BudgetModel(preset(name), bytes_per_element=2, peaks=PEAKS, step_overhead_s=overhead_s)


def test_flops_count_by_hand() -> None:
    config = preset("tiny")
    model = BudgetModel(config, bytes_per_element=4, peaks=PEAKS)
    params = config.num_params(include_embeddings=False)
    shape = StepShape(prefill=((4, 3),), decode_contexts=(10,))
    # 5 tokens through the layers; 2 logits rows; attention pairs: the chunk's 4 queries see
    # 3 cached keys each plus 1..4 causal ones (22), the decode sees 10 + itself (11)
    per_pair = 4 * config.num_layers * config.num_heads * config.head_dim
    expected = (2 * params * 5 + 2 * config.vocab_size * config.hidden_size * 2
                + per_pair * (4 * 3 + 10 + 11))
    assert model.flops(shape) == expected


@given(st.integers(0, 300), st.integers(0, 300), st.integers(1, 200))
def test_window_pairs_count_each_querys_keys(chunk: int, before: int, window: int) -> None:
    by_hand = sum(min(position + 1, window) for position in range(before, before + chunk))
    assert window_pairs(chunk, before, window) == by_hand


def test_sliding_window_layers_are_priced_by_their_window() -> None:
    gemma = preset("gemma2-small")  # windowed and global layers alternating
    window, windowed = gemma.sliding_window, len(gemma.sliding_layers)
    assert window is not None and 0 < windowed < gemma.num_layers
    model = BudgetModel(gemma, bytes_per_element=2, peaks=PEAKS)
    full = BudgetModel(dataclasses.replace(gemma, sliding_window=None, sliding_layers=()),
                       bytes_per_element=2, peaks=PEAKS)
    per_pair = 4 * gemma.num_heads * gemma.head_dim  # one layer's
    per_token = gemma.kv_bytes_per_token(2) / gemma.num_layers
    # within the window nothing differs
    short = StepShape(prefill=((window // 2, window // 4),), decode_contexts=(window - 1,))
    assert model.flops(short) == full.flops(short)
    assert model.bytes_moved(short) == full.bytes_moved(short)
    # past it, a windowed layer's queries see `window` keys and read `window` cached tokens
    long = StepShape(prefill=((64, 4 * window),), decode_contexts=(8 * window,))
    pairs_cut = (64 * 4 * window + 64 * 65 // 2 - 64 * window) + (8 * window + 1 - window)
    assert full.flops(long) - model.flops(long) == per_pair * windowed * pairs_cut
    read_cut = (4 * window - window) + (8 * window - window)
    assert full.bytes_moved(long) - model.bytes_moved(long) == pytest.approx(
        per_token * windowed * read_cut)
    # on an all-windowed model (Mistral's and Phi-3's shape) a decode's cost stops growing
    # at the window
    phi3 = BudgetModel(preset("phi3-small"), bytes_per_element=2, peaks=PEAKS)
    w = phi3.config.sliding_window
    assert w is not None
    at, past = (phi3.predict(StepShape(decode_contexts=(n,) * 8)) for n in (w, 4 * w))
    assert at == past


def test_the_roofline_reads_at_most_the_window_on_windowed_layers() -> None:
    half = dataclasses.replace(SEED, sliding_window=1024, windowed_share=0.5)
    assert half.kv_read_tokens(512) == SEED.kv_read_tokens(512) == 512
    assert half.kv_read_tokens(4096) == 0.5 * 4096 + 0.5 * 1024
    assert half.balance_chunk(32, 512) == SEED.balance_chunk(32, 512)
    assert half.balance_chunk(32, 4096) < SEED.balance_chunk(32, 4096)
    assert half.decode_intensity(32, 4096) > SEED.decode_intensity(32, 4096)
    gemma = BudgetModel(preset("gemma2-small"), bytes_per_element=2, peaks=PEAKS).roofline()
    assert (gemma.sliding_window, gemma.windowed_share) == (256, 0.5)
    with pytest.raises(ConfigError, match="sliding_window"):
        dataclasses.replace(SEED, windowed_share=0.5)
    with pytest.raises(ConfigError, match="windowed_share"):
        dataclasses.replace(SEED, sliding_window=8, windowed_share=1.5)


def test_prefill_time_grows_with_context() -> None:
    model = _model()
    times = [model.predict(StepShape(prefill=((512, before),))) for before in (0, 4096, 32768)]
    assert times == sorted(times) and times[0] < times[-1]


def test_decode_bytes_grow_with_batch_and_context() -> None:
    model = _model()
    k = model.kv_bytes_per_token
    small = model.bytes_moved(StepShape(decode_contexts=(1024,) * 8))
    wider = model.bytes_moved(StepShape(decode_contexts=(1024,) * 16))
    longer = model.bytes_moved(StepShape(decode_contexts=(2048,) * 8))
    assert wider > small and longer > small
    assert longer - small == pytest.approx(8 * 1024 * k)  # the extra KV read, nothing else


def test_predict_is_the_roofline_max_plus_overhead() -> None:
    model = _model(overhead_s=0.002)
    decode = StepShape(decode_contexts=(2048,) * 32)
    prefill = StepShape(prefill=((8192, 0),))
    assert model.estimate(decode).bound == "memory"
    assert model.estimate(prefill).bound == "compute"
    for shape in (decode, prefill):
        est = model.estimate(shape)
        assert model.predict(shape) == pytest.approx(max(est.compute_s, est.memory_s) + 0.002)
    assert model.predict(StepShape()) == pytest.approx(0.002)


def test_roofline_of_a_model_and_its_recommended_chunk() -> None:
    model = _model()
    roofline = model.roofline()
    assert roofline.params == preset("7b").num_params(include_embeddings=False)
    assert roofline.kv_bytes_per_token == 524288
    assert roofline.weight_bits == 16
    assert model.recommended_chunk(32, 2048) == round(roofline.balance_chunk(32, 2048))
    # decodes that alone saturate compute leave no balanced chunk: still at least one token
    assert model.recommended_chunk(100_000, 1) == 1


def test_budget_model_rejects_bad_inputs() -> None:
    with pytest.raises(ConfigError):
        BudgetModel(preset("tiny"), bytes_per_element=3, peaks=PEAKS)
    with pytest.raises(ConfigError):
        BudgetModel(preset("tiny"), bytes_per_element=2,
                    peaks=DevicePeaks("x", flops=0.0, bandwidth=1e9, source="x"))


# --- the three-constraint budget table -----------------------------------------------------

def test_budget_table_prefill_only_compute_then_kv() -> None:
    segments = budget_table(SEED, 20 * GIB, [128, 1024, 8192, 40000, 40960])
    assert segments == [
        BudgetSegment(128, 8192, "compute", 1071),  # 50 ms · 300 TFLOP/s / 14 GFLOP per token
        BudgetSegment(40000, 40960, "kv_capacity", 0),  # min of 960 and 0
    ]


def test_budget_table_finds_bandwidth_between() -> None:
    # 20 ms steps with 32 decodes: short contexts spend the time on compute, at 2048 the
    # decodes' KV alone (24.2 ms of reads) breaks the bandwidth budget before the pool fills
    segments = budget_table(SEED, 100 * GIB, [128, 1024, 2048], decode_seqs=32, step_time_s=0.02)
    assert [s.governing for s in segments] == ["compute", "bandwidth"]
    assert segments[0].max_batched_tokens == int(0.02 * 300e12 / 14e9)
    assert segments[1].max_batched_tokens == 0


def test_budget_table_kv_governs_when_the_decodes_do_not_fit() -> None:
    # seed 003 §13: 64 sequences at 2048 need 64 GiB of KV; a 20 GiB pool holds 20
    segments = budget_table(SEED, 20 * GIB, [256, 2048], decode_seqs=64)
    assert segments[-1] == BudgetSegment(2048, 2048, "kv_capacity", 0)


def test_budget_limits_respect_each_constraint() -> None:
    model = _model()
    kv_bytes = 32 * GIB
    limits = budget_limits(model, kv_bytes, 4096, decode_seqs=4, step_time_s=0.05)
    chunk = limits["compute"] - 4
    shape = StepShape(prefill=((chunk, 4096),), decode_contexts=(4096,) * 4)
    bigger = StepShape(prefill=((chunk + 1, 4096),), decode_contexts=(4096,) * 4)
    assert model.compute_seconds(shape) <= 0.05 < model.compute_seconds(bigger)
    capacity = kv_bytes // model.kv_bytes_per_token
    assert limits["kv_capacity"] == capacity - 5 * 4096 - 4 + 4


def test_budget_table_rejects_bad_grids() -> None:
    for grid in ([], [512, 256], [0, 16]):
        with pytest.raises(ConfigError):
            budget_table(SEED, GIB, grid)


# --- device peaks --------------------------------------------------------------------------

def test_gpu_presets_are_datasheet_shaped() -> None:
    for name, peaks in GPU_PRESETS.items():
        assert peaks.name == name and peaks.source
        assert 50 < peaks.flops / peaks.bandwidth < 500  # every current GPU's balance point


def test_measure_peaks_on_cpu_measures_once_per_process() -> None:
    peaks = measure_peaks("cpu", torch.float32)
    assert peaks.flops > 1e9 and peaks.bandwidth > 1e8
    assert "measured" in peaks.source
    assert measure_peaks("cpu", torch.float32) is peaks


def test_measure_peaks_refuses_fp16_on_cpu() -> None:
    with pytest.raises(ConfigError):
        measure_peaks("cpu", torch.float16)


# --- C* to a token budget ------------------------------------------------------------------

@pytest.mark.parametrize(("chunk", "decodes", "tile", "expected"), [
    (100, 0, 16, 112),  # rounded up to a whole tile, never down
    (100, 12, 16, 112),  # one token per decode rides in the same budget
    (100, 13, 16, 128),
    (3, 0, 16, 16),  # at least one tile
    (9, 4, 1, 13),
])
def test_token_budget_holds_the_chunk_and_the_decodes_in_whole_tiles(
        chunk: int, decodes: int, tile: int, expected: int) -> None:
    assert token_budget_for(chunk, decodes, tile) == expected
