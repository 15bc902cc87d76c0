"""Logprobs are transformers' log_softmax of the same logits: the prompt's, scored inside the
chunked prefill at any chunk budget, and the generated tokens'; greedy tokens are unchanged
by asking for them, and a prefill-only request scores its prompt and generates nothing."""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
from pathlib import Path

import pytest
import torch

from console.cli.engine_flags import add_engine_flags, engine_config
from engine import Engine, EngineConfig, SamplingParams
from engine.config import ConfigError
from engine.core.runner_requests import RunnerRequest
from engine.core.sampler import sample
from engine.serve.completions import Choice
from tests.hf_models import hf_greedy, save_tiny

MAX_NEW = 4
TOP = 3


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    directory = save_tiny("llama", tmp_path_factory.mktemp("llama"))
    rng = random.Random(3)
    return directory, [[rng.randrange(400) for _ in range(n)] for n in (40, 7, 2)]


@pytest.fixture(scope="module")
def hf_logprobs(llama):  # -> Callable[[list[int]], torch.Tensor]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama[0], dtype=torch.float32)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def _run(engine: Engine, prompt: list[int], params: SamplingParams) -> Choice:
    """The request's whole output, gathered as the HTTP layer gathers it."""
    rid = engine.add_request(prompt, params)
    choice = Choice(0, prompt)
    while True:
        for out in engine.step():
            if out.request_id == rid:
                choice.add(out)
                if out.finished:
                    return choice


@pytest.mark.parametrize("budget", [13, 4096])
def test_logprobs_equal_transformers_log_softmax(llama, hf_logprobs, budget: int) -> None:
    directory, prompts = llama
    engine = Engine(EngineConfig(model=str(directory), device="cpu", dtype="float32",
                                 max_num_batched_tokens=budget, chunk_tile=1))
    expected_tokens = hf_greedy(directory, prompts, MAX_NEW)
    for prompt, expected in zip(prompts, expected_tokens, strict=True):
        out = _run(engine, prompt, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True,
                                                  logprobs=TOP, prompt_logprobs=TOP))
        assert out.token_ids == expected  # greedy unchanged
        reference = hf_logprobs(prompt + expected)
        # prompt positions 1.. then the generated tokens, one row earlier each
        scored = list(out.prompt_logprobs) + list(out.logprobs)
        assert len(out.prompt_logprobs) == len(prompt) - 1
        assert len(scored) == len(prompt) - 1 + MAX_NEW
        for position, entry in enumerate(scored, start=1):
            row = reference[position - 1]
            token = (prompt + expected)[position]
            assert entry.token == token
            assert abs(entry.logprob - row[token].item()) < 1e-4
            assert entry.rank == int((row > row[token]).sum()) + 1
            top = row.topk(TOP)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert max(abs(a - b) for (_, a), b in zip(entry.top, top.values.tolist(),
                                                       strict=True)) < 1e-4


def test_prefill_only_request_scores_its_prompt(llama) -> None:
    directory, prompts = llama
    engine = Engine(EngineConfig(model=str(directory), device="cpu", dtype="float32",
                                 max_num_batched_tokens=13, chunk_tile=1))
    out = _run(engine, prompts[0], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert out.token_ids == [] and out.finish_reason == "length"
    assert len(out.prompt_logprobs) == len(prompts[0]) - 1
    assert all(entry.top == () for entry in out.prompt_logprobs)
    assert engine.blocks.num_used == 0
    # the same prompt again reads no prefix cache: every position is scored once more
    again = _run(engine, prompts[0], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert [e.logprob for e in again.prompt_logprobs] == pytest.approx(
        [e.logprob for e in out.prompt_logprobs], abs=1e-5)


def test_scoring_rows_are_priced_in_the_step_shape(llama) -> None:
    """A chunk that scores its prompt computes a logits row per token: the budget model
    prices those rows (lm_head FLOPs and logits bytes) as a separate term."""
    from engine.batch import Batch
    from engine.core.request import Request

    directory, prompts = llama
    engine = Engine(EngineConfig(model=str(directory), device="cpu", dtype="float32"))
    plain = Request("a", prompts[0], SamplingParams(max_tokens=0), arrival=0.0)
    scoring = Request("b", prompts[0], SamplingParams(max_tokens=0, prompt_logprobs=1),
                      arrival=0.0)
    shapes = [Batch(prefills=[r.chunk(0, 13)]).shape() for r in (plain, scoring)]
    assert shapes[0].scored_rows == 0 and shapes[1].scored_rows == 13
    last = Batch(prefills=[scoring.chunk(26, 14)]).shape()
    assert last.scored_rows == 13  # the last prompt token's row predicts a generated one
    extra = engine.budget.flops(shapes[1]) - engine.budget.flops(shapes[0])
    assert extra == pytest.approx(13 * 2 * 64 * 400)  # lm_head: hidden × vocab per row
    assert engine.budget.predict(shapes[1]) > engine.budget.predict(shapes[0])


def _sampled(logits: torch.Tensor, params: SamplingParams, processed: bool):
    request = RunnerRequest("r", [1, 2, 3, 7, 7, 9], num_prompt_tokens=3, params=params,
                            block_table=[])
    out = sample(logits.unsqueeze(0), [request], processed_logprobs=processed)
    return out.token_ids["r"], out.logprobs["r"]


def test_processed_logprobs_are_the_logits_sampled_from() -> None:
    """vLLM's processed_logprobs: log_softmax of the penalised logits over the temperature;
    raw_logprobs: of the model's own logits. The token drawn is the same in both modes."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=2.0, seed=5, logprobs=TOP, logit_bias=((3, 4.0),),
                            presence_penalty=0.5, frequency_penalty=0.25)
    token, processed = _sampled(logits, params, processed=True)
    raw_token, raw = _sampled(logits, params, processed=False)
    assert token == raw_token
    penalised = logits.clone()
    penalised[3] += 4.0
    penalised[7] -= 0.5 + 2 * 0.25
    penalised[9] -= 0.5 + 0.25
    expected = torch.log_softmax(penalised / 2.0, dim=-1)
    assert abs(processed.logprob - expected[token].item()) < 1e-5
    assert [t for t, _ in processed.top] == expected.topk(TOP).indices.tolist()
    assert abs(raw.logprob - torch.log_softmax(logits, dim=-1)[token].item()) < 1e-5
    # top-k cuts the rest to -inf: the kept tokens' logprobs sum to 1
    _, cut = _sampled(logits, dataclasses.replace(params, top_k=2, logprobs=2), True)
    assert abs(sum(math.exp(v) for _, v in cut.top) - 1.0) < 1e-5
    # greedy: the same token either way, scored from the penalised logits unscaled
    greedy = dataclasses.replace(params, temperature=0.0)
    greedy_token, greedy_processed = _sampled(logits, greedy, processed=True)
    assert greedy_token == _sampled(logits, greedy, processed=False)[0]
    assert greedy_token == int(penalised.argmax())
    assert abs(greedy_processed.logprob
               - torch.log_softmax(penalised, dim=-1)[greedy_token].item()) < 1e-5


def test_processed_mode_keeps_prompt_logprobs_raw(llama, hf_logprobs) -> None:
    """As vLLM: prompt tokens skip the sampler's processing, so processed_logprobs scores
    them as raw_logprobs does; generated tokens are scored after the temperature."""
    directory, prompts = llama
    engine = Engine(EngineConfig(model=str(directory), device="cpu", dtype="float32",
                                 max_num_batched_tokens=13, chunk_tile=1,
                                 logprobs_mode="processed_logprobs"))
    prompt = prompts[1]
    out = _run(engine, prompt, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, seed=1,
                                              temperature=2.0, logprobs=TOP, prompt_logprobs=0))
    reference = hf_logprobs(prompt + out.token_ids)
    for position, entry in enumerate(out.prompt_logprobs, start=1):
        assert abs(entry.logprob - reference[position - 1][prompt[position]].item()) < 1e-4
    for offset, entry in enumerate(out.logprobs):
        row = torch.log_softmax(reference[len(prompt) - 1 + offset] / 2.0, dim=-1)
        assert abs(entry.logprob - row[entry.token].item()) < 1e-4


def test_logits_modes_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="logprobs_mode"):
        EngineConfig(logprobs_mode="raw_logits").validate()


def test_logprobs_mode_flag_reaches_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--logprobs-mode", "processed_logprobs"])
    assert engine_config(args).logprobs_mode == "processed_logprobs"
    assert engine_config(parser.parse_args([])).logprobs_mode == "raw_logprobs"
    with pytest.raises(ConfigError, match="processed_logits"):
        engine_config(parser.parse_args(["--logprobs-mode", "processed_logits"]))
