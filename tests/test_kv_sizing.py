"""A GPU's KV pool is sized after a warm-up step at the largest token budget: the arithmetic
on the device's memory numbers, and the runner's path to it with those numbers faked."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from engine.config import EngineConfig
from engine.core import model_runner
from engine.core.kv_sizing import GIB, MemoryReading, kv_budget
from engine.core.model_runner import ModelRunner


def test_the_pool_gets_the_share_left_after_use_and_the_activation_peak() -> None:
    reading = MemoryReading(total=100 * GIB, free=60 * GIB, activations=5 * GIB)
    sized = kv_budget(reading, 0.9, block_bytes=GIB // 4)
    assert sized.bytes == (90 - 40 - 5) * GIB
    assert sized.line == ("KV cache: 0.9 x 100.00 GiB - 40.00 GiB in use - 5.00 GiB "
                          "activation peak = 45.00 GiB, 180 blocks of 256.00 MiB")
    crowded = MemoryReading(total=100 * GIB, free=5 * GIB, activations=GIB)
    assert kv_budget(crowded, 0.9, GIB).bytes == 0


def test_a_gpu_pool_is_sized_after_a_warm_up_at_the_largest_step(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The CUDA path on a CPU runner, the device's memory numbers faked: the warm-up forward
    runs the token budget's tokens, and the pool is what the arithmetic leaves."""
    config = EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                          attention_backend="torch", max_num_batched_tokens=96,
                          max_model_len=64)
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
    assert budget == int(0.85 * 10 * 2**20) - 2 * 2**20 - 2**20
    assert not hasattr(runner, "kv_cache")  # the warm-up's pool went back
    assert [r.message for r in caplog.records if r.message.startswith("KV cache: 0.85 x ")]
