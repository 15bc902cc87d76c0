"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Each request is sampled on its own account: whatever one request's parameters make go wrong
(a seed torch cannot take, probabilities that are all NaN) fails that request alone and
every other row of the step still gets its token (issue 15).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import SamplingParams
from engine.core.batch import ModelRunnerOutput
from engine.core.request import Request


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> ModelRunnerOutput:
    """One token per row of `logits` [M, V] (fp32), row i for `requests[i]`; greedy rows
    never draw randomness."""
    greedy = logits.argmax(dim=-1).tolist()
    tokens: dict[str, int] = {}
    errors: dict[str, str] = {}
    for row, request in enumerate(requests):
        params = request.params
        if not params.temperature > 0:
            tokens[request.id] = greedy[row]
            continue
        try:
            if params.seed is not None and request.generator is None:
                request.generator = make_generator(params.seed)
            tokens[request.id] = _draw(logits[row], params, request.generator)
        except Exception as exc:  # whatever it is, it is this request's alone
            errors[request.id] = (f"sampling failed (temperature {params.temperature}, top_p "
                                  f"{params.top_p}, top_k {params.top_k}, seed {params.seed}): "
                                  f"{type(exc).__name__}: {exc}")
    return ModelRunnerOutput(token_ids=tokens, errors=errors)


def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass before it already reaches top_p; the top token always
        # stays, even when top_p is below float32's smallest number and compares as 0
        drop = (probs.cumsum(dim=-1) - probs) >= p.top_p
        drop[0] = False
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator for a seeded request (unseeded requests share torch's global one);
    raises for a seed outside [-2^63, 2^64)."""
    return torch.Generator(device="cpu").manual_seed(seed)
