"""Token sampling as vLLM V1 does it: logit_bias, the penalties, then greedy or temperature."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.batch import ModelRunnerOutput, TokenLogprob
from engine.config import SamplingParams
from engine.core.logits_processors import LogitsProcessors
from engine.core.runner_requests import RunnerRequest


def sample(logits: torch.Tensor, requests: Sequence[RunnerRequest],
           processed_logprobs: bool = False,
           processors: LogitsProcessors | None = None) -> ModelRunnerOutput:
    """One token per row of `logits` [M, V] (fp32), row i for `requests[i]`."""
    # --- logits processors (grammar masks, min_tokens): the final logits, before sampling;
    # a request whose processor fails is failed alone and leaves the batch ---
    refused: dict[str, str] = {}
    if processors is not None:
        logits, requests, refused = processors.apply(logits, requests)
    # --- end of logits processors ---
    greedy = logits.argmax(dim=-1).tolist()
    tokens: dict[str, int] = {}
    errors: dict[str, str] = dict(refused)
    logprobs: dict[str, TokenLogprob] = {}
    for row, request in enumerate(requests):
        params = request.params
        if params.prefill_only:
            continue
        try:
            raw = logits[row]
            scores = _penalized(raw, request) if params.penalized else raw
            if not params.temperature > 0:
                token = greedy[row] if scores is raw else int(scores.argmax())
            else:
                if params.seed is not None and request.generator is None:
                    request.generator = make_generator(params.seed)
                scores = _processed(scores, params)
                token = int(torch.multinomial(torch.softmax(scores, dim=-1).cpu(), 1,
                                              generator=request.generator).item())
            if params.logprobs is not None:
                logprobs[request.id] = token_logprobs(
                    torch.log_softmax(scores if processed_logprobs else raw, dim=-1), [token],
                    params.logprobs)[0]
            tokens[request.id] = token
        except Exception as exc:  # whatever it is, it is this request's alone
            errors[request.id] = (f"sampling failed (temperature {params.temperature}, top_p "
                                  f"{params.top_p}, top_k {params.top_k}, seed {params.seed}): "
                                  f"{type(exc).__name__}: {exc}")
    return ModelRunnerOutput(token_ids=tokens, errors=errors, logprobs=logprobs)


def token_logprobs(logprobs: torch.Tensor, tokens: Sequence[int],
                   top: int) -> list[TokenLogprob]:
    """Each row's logprob and rank of `tokens[i]`, and its `top` likeliest tokens."""
    rows = logprobs.view(-1, logprobs.shape[-1])
    index = torch.tensor(tokens, dtype=torch.int64, device=rows.device).unsqueeze(1)
    chosen = rows.gather(1, index)
    ranks = ((rows > chosen).sum(dim=1) + 1).tolist()
    top_values, top_ids = rows.topk(top, dim=1) if top else (rows[:, :0], rows[:, :0].long())
    pairs = [tuple(zip(ids, values, strict=True))
             for ids, values in zip(top_ids.tolist(), top_values.tolist(), strict=True)]
    return [TokenLogprob(token, value, rank, top_pairs)
            for token, value, rank, top_pairs in zip(tokens, chosen.squeeze(1).tolist(), ranks,
                                                     pairs, strict=True)]


def _penalized(logits: torch.Tensor, request: RunnerRequest) -> torch.Tensor:
    p = request.params
    scores = logits.clone()
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64, device=scores.device)
        bias = torch.tensor([b for _, b in p.logit_bias], dtype=scores.dtype,
                            device=scores.device)
        scores.index_add_(0, ids, bias)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(request.token_ids, dtype=torch.int64, device=scores.device).unique()
        values = scores[seen]
        scores[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                   values * p.repetition_penalty)
    generated = request.output_token_ids if p.frequency_penalty or p.presence_penalty else []
    if generated:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64, device=scores.device),
                                minlength=scores.numel())[:scores.numel()].to(scores.dtype)
        scores -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(scores.dtype)
    return scores


def _processed(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scaled = logits / p.temperature
    if p.min_p > 0:  # vLLM: drop tokens below min_p times the likeliest one's probability
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass before it reaches top_p; the top one stays (top_p may be ~0)
        drop = (probs.cumsum(dim=-1) - probs) >= p.top_p
        drop[0] = False
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)
