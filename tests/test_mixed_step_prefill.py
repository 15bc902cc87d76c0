"""A step that holds decodes takes at most `mixed_step_prefill_tokens` prompt tokens after
them (decodes first, then chunks, as Sarathi-Serve batches): a long prompt's chunks never turn
a running decode's step into a whole budget's prefill. Without decodes the prompt takes the
whole budget; 0 turns the bound off. On the scheduler rig's scripted steps."""

from __future__ import annotations

import argparse

import pytest

from console.cli.engine_flags import SERVE_MIXED_STEP_PREFILL_TOKENS, engine_config
from console.cli.serve import register
from engine.config import ConfigError, EngineConfig
from tests.test_scheduler import prefill_sizes, sim


def test_a_long_prompt_beside_a_decode_takes_the_bound_and_alone_the_budget() -> None:
    s = sim(max_num_batched_tokens=64, chunk_tile=4, mixed_step_prefill_tokens=8)
    s.add(4, max_tokens=6)
    s.step()  # the decoder's prompt
    long = s.add(200, max_tokens=1)
    mixed = 0
    while (batch := s.step()).decodes:  # the decoder's 5 tokens after its first
        assert prefill_sizes(batch) == {long.id: 8} and batch.num_tokens == 9
        mixed += 1
    assert mixed == 5 and prefill_sizes(batch) == {long.id: 64}
    sizes = [prefill_sizes(s.step()).get(long.id, 0) for _ in range(2)]
    # the decoder ended: no decode waits, and the budget is the prompt's to its end
    assert sizes == [64, 200 - 5 * 8 - 2 * 64]


def test_off_a_decodes_step_fills_its_budget_with_prompt_tokens() -> None:
    s = sim(max_num_batched_tokens=64, chunk_tile=4)
    s.add(4, max_tokens=6)
    s.step()
    long = s.add(200, max_tokens=1)
    batch = s.step()
    assert len(batch.decodes) == 1 and prefill_sizes(batch) == {long.id: 63 // 4 * 4}


def test_a_bound_under_a_tile_is_refused_by_name() -> None:
    with pytest.raises(ConfigError) as caught:
        EngineConfig(chunk_tile=16, mixed_step_prefill_tokens=8).validate()
    assert caught.value.field == "mixed_step_prefill_tokens"
    assert EngineConfig().replace(mixed_step_prefill_tokens=32).mixed_step_prefill_tokens == 32


def test_serve_bounds_mixed_steps_by_default_and_other_commands_do_not() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    served = engine_config(parser.parse_args(["serve"]))
    assert served.mixed_step_prefill_tokens == SERVE_MIXED_STEP_PREFILL_TOKENS
    assert engine_config(parser.parse_args(
        ["serve", "--mixed-step-prefill-tokens", "0"])).mixed_step_prefill_tokens == 0
    assert EngineConfig().mixed_step_prefill_tokens == 0
