"""The hf baseline runs our exact weights: greedy tokens equal the engine's."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.harness.hf_baseline import hf_model, run_hf
from engine.harness.workload import WorkloadRequest
from tests.hf_models import FAMILIES, save_tiny

pytest.importorskip("transformers")


def test_hf_static_batches_match_the_engine() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu"))
    prompts = [[5, 6, 7, 8], list(range(3, 40)), [9] * 11]
    workload = [WorkloadRequest(f"r{i}", 0.0, tuple(p), 5, ignore_eos=True)
                for i, p in enumerate(prompts)]
    expected = engine.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    result = run_hf(hf_model(engine.runner.model, engine.model_config), workload, batch_size=2)
    assert [result.records[f"r{i}"].token_ids for i in range(3)] == expected
    summary = result.summary()
    assert summary["finished"] == 3 and summary["ttft_ms"]["p50"] is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_baseline_rebuilds_every_family(family: str, tmp_path) -> None:
    """hf_model maps our config back to transformers' for each family: a prompt longer than
    the windows gives the engine's tokens."""
    directory = save_tiny(family, tmp_path / family)
    engine = Engine(EngineConfig(model=str(directory), device="cpu"))
    prompt = [(11 * i) % 400 for i in range(40)]
    expected = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    result = run_hf(hf_model(engine.runner.model, engine.model_config),
                    [WorkloadRequest("r0", 0.0, tuple(prompt), 4, ignore_eos=True)])
    assert [result.records["r0"].token_ids] == expected
