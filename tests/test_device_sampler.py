"""The vectorised sampler draws what the per-row sampler drew: the same tokens for the same
seeds under every mix of temperature, top-k/p, min-p, penalties and logit bias, with the same
logprobs, ranks and top pairs; and a request whose sampling cannot go on fails alone."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import SamplingParams
from engine.core.runner_requests import RunnerRequest
from engine.core.sampler import StepSampling, exponential, row_params, sample, sampling_inputs
from tests import sampler_oracle

VOCAB = 300


def _params(rng: random.Random, seeded: bool) -> SamplingParams:
    temperature = rng.choice([0.0, 0.0, 0.3, 0.7, 1.0, 1.5])
    return SamplingParams(
        max_tokens=8, temperature=temperature,
        top_k=rng.choice([0, 0, 1, 5, 40, VOCAB + 5]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.05]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
        seed=rng.randrange(2**63) if seeded else None,
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.4]),
        presence_penalty=rng.choice([0.0, 0.0, 0.7]),
        logit_bias=tuple((rng.randrange(VOCAB), rng.uniform(-5, 5))
                         for _ in range(rng.choice([0, 0, 3]))),
        logprobs=rng.choice([None, None, 0, 1, 5]))


def _requests(rng: random.Random, rows: int, seeded: bool) -> list[RunnerRequest]:
    requests = []
    for i in range(rows):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
        requests.append(RunnerRequest(f"r{i}", prompt + output, len(prompt),
                                      _params(rng, seeded), []))
    return requests


def _copies(requests: list[RunnerRequest]) -> list[RunnerRequest]:
    return [RunnerRequest(r.id, list(r.token_ids), r.num_prompt_tokens, r.params, [])
            for r in requests]


@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
@pytest.mark.parametrize("case", range(12))
def test_the_same_seeds_draw_the_same_tokens_and_logprobs(case: int, processed: bool) -> None:
    rng = random.Random(case)
    requests = _requests(rng, rng.choice([1, 3, 9, 17]), seeded=True)
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(case))
    logits *= rng.choice([1.0, 4.0])
    old_rows, new_rows = _copies(requests), _copies(requests)
    # several steps: each seeded generator draws on from where its last step left it
    for _ in range(3):
        old = sampler_oracle.sample(logits, old_rows, processed)
        new = sample(logits, new_rows, processed)
        assert new.token_ids == old.token_ids
        assert new.errors == old.errors == {}
        assert new.logprobs.keys() == old.logprobs.keys()
        for rid, expected in old.logprobs.items():
            got = new.logprobs[rid]
            assert (got.token, got.rank) == (expected.token, expected.rank)
            assert got.logprob == pytest.approx(expected.logprob, abs=1e-5)
            assert [t for t, _ in got.top] == [t for t, _ in expected.top]
            assert [v for _, v in got.top] == pytest.approx([v for _, v in expected.top],
                                                            abs=1e-5)
        for rows, output in ((old_rows, old), (new_rows, new)):
            for request in rows:
                request.token_ids.append(output.token_ids[request.id])


def test_unseeded_rows_follow_the_global_generator_as_before() -> None:
    rng = random.Random(99)
    requests = _requests(rng, 6, seeded=False)
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(1234)
    old = sampler_oracle.sample(logits, _copies(requests))
    torch.manual_seed(1234)
    new = sample(logits, _copies(requests))
    assert new.token_ids == old.token_ids


def test_a_request_with_nan_probabilities_fails_alone() -> None:
    rng = random.Random(3)
    requests = _requests(rng, 4, seeded=True)
    bad = RunnerRequest("bad", [1, 2], 2, SamplingParams(temperature=1.0), [])
    object.__setattr__(bad.params, "temperature", 1e-50)  # as if past the edge's validation
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(2))
    old = sampler_oracle.sample(logits, [*_copies(requests), bad])
    new = sample(logits, [*_copies(requests), bad])
    assert new.token_ids == old.token_ids
    assert set(new.errors) == set(old.errors) == {"bad"}
    assert "sampling failed" in new.errors["bad"]


def test_the_cpu_noise_is_what_exponential_draws_from_the_same_generator_state() -> None:
    torch.manual_seed(77)
    expected = torch.empty(64, 4096).exponential_(1)
    after = torch.get_rng_state()
    torch.manual_seed(77)
    got = exponential(torch.empty(64, 4096))
    assert torch.equal(got, expected)
    assert torch.equal(torch.get_rng_state(), after)


def test_a_runners_kept_row_parameters_draw_what_fresh_ones_draw() -> None:
    rng = random.Random(11)
    requests = _requests(rng, 9, seeded=True)
    kept, fresh = _copies(requests), _copies(requests)
    steps = StepSampling(VOCAB)
    made = []
    for step in range(6):
        if step == 3:  # one request leaves and another enters: the rows are made again
            kept, fresh = kept[1:] + _copies(requests[:1]), fresh[1:] + _copies(requests[:1])
        logits = torch.randn(len(kept), VOCAB, generator=torch.Generator().manual_seed(step))
        inputs = steps.inputs(kept)
        made.append(inputs.temperature)
        got = sample(logits, kept, inputs=inputs)
        expected = sample(logits, fresh, inputs=sampling_inputs(fresh, VOCAB))
        assert got.token_ids == expected.token_ids
        assert got.logprobs == expected.logprobs
        for rows, output in ((kept, got), (fresh, expected)):
            for request in rows:
                request.token_ids.append(output.token_ids[request.id])
    # kept while the rows were the same requests, made again when they changed
    assert [t is made[0] for t in made] == [True, True, True, False, False, False]
    assert made[4] is made[3]


@pytest.mark.parametrize("case", range(8))
def test_row_parameters_hold_each_rows_values_where_they_skip_the_rows(case: int) -> None:
    rng = random.Random(case)
    # homogeneous batches too: there a column is made without reading the rows
    same = case % 2 == 0
    first = _params(rng, seeded=case % 4 == 0)
    requests = _requests(rng, rng.choice([1, 4, 17]), seeded=case % 4 == 0)
    if same:
        requests = [RunnerRequest(r.id, r.token_ids, r.num_prompt_tokens, first, [])
                    for r in requests]
    rows = row_params(requests, VOCAB)
    params = [r.params for r in requests]
    expected = {
        "temperature": [[p.temperature if p.temperature > 0 else 1.0] for p in params],
        "top_p": [[p.top_p] for p in params], "min_p": [[p.min_p] for p in params],
        "top_k": [[p.top_k if 0 < p.top_k < VOCAB else 0] for p in params],
        "sampled": [p.temperature > 0 for p in params]}
    for name, values in expected.items():
        tensor = getattr(rows, name)
        assert torch.equal(tensor, torch.tensor(values, dtype=tensor.dtype)), name
    assert rows.seeded == tuple(i for i, p in enumerate(params)
                                if p.temperature > 0 and p.seed is not None)
    assert rows.logprobs == max((p.logprobs for p in params if p.logprobs is not None),
                                default=-1)
    assert rows.all_sampled == all(p.temperature > 0 for p in params)
