"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed."""

from __future__ import annotations

import torch

from engine.config import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [M, V] (fp32); greedy rows never draw randomness."""
    tokens = logits.argmax(dim=-1)
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.temperature > 0:
            tokens[row] = _draw(logits[row], p, generator)
    return tokens.tolist()


def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token once the mass before it already reaches top_p; the top token stays
        drop = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def make_generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator for a seeded request; unseeded requests share torch's global one."""
    return None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
