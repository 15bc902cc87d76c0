"""A GPU's KV pool is sized for the worst step the engine allows (a warm-up step at the largest
budget, and the attention spikes it cannot meet, counted), and flash-attn runs only where it
can: the arithmetic on the device's numbers, and the runner's paths with those numbers faked."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import pytest
import torch

from engine import Engine
from engine.config import ConfigError, EngineConfig
from engine.core import model_runner
from engine.core.kv_sizing import (
    GIB,
    MemoryReading,
    StepScratch,
    WorstStep,
    kv_budget,
    worst_step_scratch,
)
from engine.core.model_runner import ModelRunner
from engine.errors import EngineError
from engine.kernels.attention import SCORE_BYTES, GpuDescription, flash_refusal
from engine.model.config import ModelConfig


def test_the_pool_gets_the_share_left_after_use_and_the_activation_peak() -> None:
    reading = MemoryReading(total=100 * GIB, free=60 * GIB, activations=5 * GIB)
    sized = kv_budget(reading, 0.9, block_bytes=GIB // 4)
    assert sized.bytes == (90 - 40 - 5) * GIB
    assert sized.line == ("KV cache: 0.9 x 100.00 GiB - 40.00 GiB in use - 5.00 GiB worst step "
                          "(warm-up peak 5.00) = 45.00 GiB, 180 blocks of 256.00 MiB")
    crowded = MemoryReading(total=100 * GIB, free=5 * GIB, activations=GIB)
    assert kv_budget(crowded, 0.9, GIB).bytes == 0


def test_a_gpu_pool_is_sized_after_a_warm_up_at_the_largest_step(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The CUDA path on a CPU runner, the device's memory numbers faked: the warm-up forward
    runs the token budget's tokens, and the pool is what the arithmetic leaves."""
    config = EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                          attention_backend="torch", max_num_batched_tokens=96,
                          max_num_batched_tokens_cap=96, max_model_len=64)
    runner = ModelRunner(config)
    steps: list[int] = []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda chunks: steps.append(
        sum(c.num_tokens for c in chunks)) or forward(chunks))

    def reading(device: torch.device, warm_up: Callable[[], Callable[[], None]]
                ) -> MemoryReading:
        warm_up()()
        return MemoryReading(total=10 * 2**20, free=8 * 2**20, activations=2**20)

    monkeypatch.setattr(model_runner, "read_cuda_memory", reading)
    with caplog.at_level(logging.INFO, logger=model_runner.__name__):
        budget = runner._measured_budget(config, block_bytes=4096)
    assert steps == [96]  # sequences of 64 and 32 tokens: the largest step
    # the counted worst step (1,536,000 bytes) passes the measured peak (1 MiB)
    scratch = worst_step_scratch(runner.model_config, 4, runner.worst_step(config))
    assert scratch.fixed == 1_536_000 and scratch.per_pool_byte == 0.625
    assert budget == int((int(0.85 * 10 * 2**20) - 2 * 2**20 - 1_536_000) / 1.625)
    assert not hasattr(runner, "kv_cache")  # the warm-up's pool went back
    assert [r.message for r in caplog.records if r.message.startswith("KV cache: 0.85 x ")]


def test_the_worst_step_counts_scores_gathers_sampler_and_graphs() -> None:
    """1b-like shape: a 2,048-token chunk at a 32k context would score 32 x 2048 x 32768
    floats twice (scores, softmax), 16 GiB, which a warm-up at position 0 never allocates:
    attention takes it in slices of query rows, whose scores stay under SCORE_BYTES."""
    mc = ModelConfig(vocab_size=128_256, hidden_size=2048, intermediate_size=8192,
                     num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                     max_position_embeddings=32768)
    worst = WorstStep(tokens=2048, context=32768, rows=256, attention="torch", graph_tokens=64,
                      graph_gather=3 * GIB)
    scratch = worst_step_scratch(mc, 2, worst)
    per_token = (32 * 64 + 2 * 8 * 64 + 3 * 8192 + 4 * 2048) * 2
    assert scratch.parts == {
        "dense": 2048 * per_token,
        "sampler": 256 * 128_256 * (8 * 4 + 2),
        "chunk_scores": SCORE_BYTES + 2048 * 32768,  # a slice's scores and the bool mask
        "cuda_graphs": 64 * per_token + 3 * GIB}  # its gather, kept in the graphs' pool
    short = worst_step_scratch(mc, 2, WorstStep(64, 512, 64, "torch"))
    assert short.parts["chunk_scores"] == 32 * 64 * 512 * 8 + 64 * 512  # one slice
    assert scratch.per_pool_byte == 1.25 / 16  # one layer's gather, padded
    flash = worst_step_scratch(mc, 2, WorstStep(2048, 32768, 256, "flash"))
    assert set(flash.parts) == {"dense", "sampler"} and flash.per_pool_byte == 0
    flex = worst_step_scratch(mc, 2, WorstStep(2048, 32768, 256, "flex"))
    assert "chunk_scores" not in flex.parts and flex.per_pool_byte == 1.25 / 16


def test_the_pool_and_its_gathers_fit_together() -> None:
    reading = MemoryReading(total=80 * GIB, free=70 * GIB, activations=GIB)
    scratch = StepScratch({"dense": 2 * GIB, "sampler": GIB}, per_pool_byte=0.25)
    sized = kv_budget(reading, 0.9, GIB, scratch)
    assert sized.bytes == int((72 - 10 - 3) * GIB / 1.25)
    pool = sized.bytes
    assert 10 * GIB + 3 * GIB + pool + pool * 0.25 <= 72 * GIB  # the worst step fits
    assert "dense 2.00, sampler 1.00" in sized.line and "0.25 gathered per pool byte" in sized.line


AMPERE, TURING = GpuDescription("A100", (8, 0), 80 * GIB), GpuDescription("T4", (7, 5), 16 * GIB)


@pytest.mark.parametrize(("gpu", "dtype", "head_dim", "refused"), [
    (AMPERE, torch.bfloat16, 128, None),
    (AMPERE, torch.float16, 256, None),
    (AMPERE, torch.float32, 128, "float16 or bfloat16, not float32"),
    (TURING, torch.bfloat16, 128, "compute capability 8.0 (Ampere) or newer; T4 has 7.5"),
    (AMPERE, torch.bfloat16, 512, "head sizes up to 256, not 512"),
    (AMPERE, torch.bfloat16, 72, None),
    (AMPERE, torch.bfloat16, 100, "head sizes in multiples of 8, not 100"),
    (GpuDescription("B200", (10, 0), 180 * GIB), torch.bfloat16, 64, None),
])
def test_flash_runs_only_on_its_dtypes_gpus_and_head_sizes(gpu, dtype, head_dim,
                                                            refused) -> None:
    refusal = flash_refusal(gpu, dtype, head_dim)
    assert refusal is None if refused is None else refused in refusal


@pytest.mark.parametrize("backend", ["auto", "flash"])
def test_a_refused_flash_falls_back_with_one_line_or_fails_where_forced(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, backend: str) -> None:
    """The runner's guard with the GPU faked: fp32 on an Ampere card (the correctness checks'
    dtype) is no candidate under auto, and is refused, naming the fix, where flash is forced."""
    runner = ModelRunner(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                      attention_backend="torch"))
    monkeypatch.setattr(model_runner, "flash_importable", lambda device: True)
    monkeypatch.setattr(model_runner, "describe_gpu", lambda device: AMPERE)
    config = EngineConfig(model="synthetic:tiny", attention_backend=backend)
    if backend == "flash":
        with pytest.raises(EngineError, match="not float32; use auto, flex or torch"):
            runner._flash(config, 64)
        return
    with caplog.at_level(logging.INFO, logger=model_runner.__name__):
        assert runner._flash(config, 64) is False
    lines = [r.message for r in caplog.records if "flash-attn" in r.message]
    assert lines == ["flash-attn is installed but no candidate: flash-attn takes float16 or "
                     "bfloat16, not float32"]
    runner.dtype = torch.bfloat16
    assert runner._flash(config, 64) is True


def test_a_live_budget_stays_under_the_ceiling_the_pool_was_sized_for() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 kv_cache_bytes=1 << 20, max_num_batched_tokens_cap=4096))
    assert engine.update_config(max_num_batched_tokens=4096).max_num_batched_tokens == 4096
    with pytest.raises(ConfigError, match=r"at most 4096.*max_num_batched_tokens_cap"):
        engine.update_config(max_num_batched_tokens=4097)
    with pytest.raises(ConfigError, match="fixed at start"):
        engine.update_config(max_num_batched_tokens_cap=8192)
    # a start above the cap is its own ceiling
    big = EngineConfig(max_num_batched_tokens=20000, max_num_batched_tokens_cap=4096)
    assert big.budget_ceiling() == 20000


def test_device_peaks_are_measured_before_the_pool_exists(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The peak probe's copy (4 GiB on a GPU) runs while the memory is still free."""
    order: list[str] = []
    peaks, allocate = model_runner.measure_peaks, ModelRunner._allocate_kv
    monkeypatch.setattr(model_runner, "measure_peaks",
                        lambda *a: order.append("peaks") or peaks(*a))
    monkeypatch.setattr(ModelRunner, "_allocate_kv",
                        lambda self: order.append("pool") or allocate(self))
    runner = ModelRunner(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                      attention_backend="torch"))
    assert order == ["peaks", "pool"] and runner.peaks.bandwidth > 0


@pytest.mark.parametrize("attention", ["torch", "flex"])
def test_the_graphs_pool_keeps_room_for_their_whole_table_gather(attention: str) -> None:
    """A graphed decode on SDPA gathers its whole table (max_model_len wide) in every layer,
    with a length mask: the graphs' private pool keeps that apart from the eager steps."""
    config = EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                          kv_cache_bytes=1 << 22, attention_backend=attention, max_num_seqs=8,
                          max_model_len=256, compile=True)
    runner = ModelRunner(dataclasses.replace(config, compile=False))
    runner.device = torch.device("cuda:0")  # the CUDA sizing, on a CPU runner
    worst = runner.worst_step(config)
    mc = runner.model_config
    masks = 1 + (runner.backend.window is not None)
    assert worst.graph_tokens == 8
    assert worst.graph_gather == 8 * (2 * 256 * mc.num_kv_heads * mc.head_dim * 4
                                      + masks * 256 * 4)
    parts = worst_step_scratch(mc, 4, worst).parts
    assert parts["cuda_graphs"] > worst.graph_gather


def test_a_context_past_the_models_positions_is_refused_on_cpu_and_on_a_twin() -> None:
    """vLLM refuses a max_model_len past max_position_embeddings; this engine used to cap it
    without a word, on the CPU runner and on the twin alike."""
    from engine.sim.executor import VirtualClock, simulated_engine
    from engine.sim.target import resolve_target

    too_long = EngineConfig(model="synthetic:tiny", max_model_len=2049)  # tiny: 2,048
    with pytest.raises(ConfigError, match="2,049 is past the model's 2,048 positions"):
        Engine(too_long)
    with pytest.raises(ConfigError, match="pass --max-model-len 2048 or less"):
        resolve_target("h100", too_long)
    config = EngineConfig(model="synthetic:tiny", max_model_len=2048)
    assert Engine(config).max_model_len == 2048
    twin = simulated_engine(config, resolve_target("h100", config), VirtualClock())
    assert twin.max_model_len == 2048
    assert Engine(EngineConfig(model="synthetic:tiny")).max_model_len == 2048
