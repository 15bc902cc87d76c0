"""Token sampling as vLLM V1 does it, vectorised over the step's rows on the logits' device:
logit_bias, the penalties, then greedy or temperature with min-p, top-k and top-p; one read
back to the host per step.

A temperature-sampled row draws as torch.multinomial does (an exponential race:
argmax(p / q), q ~ Exp(1)); a seeded row's q comes from its own CPU generator, so a seed draws
the same tokens on every device and as the per-row sampler did."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.batch import ModelRunnerOutput, TokenLogprob
from engine.core.logits_processors import LogitsProcessors
from engine.core.runner_requests import RunnerRequest
from engine.core.staging import moved


@dataclass(frozen=True)
class Penalties:
    """The penalised rows' histories and weights, padded with the id `vocab` (a spare column)."""

    rows: torch.Tensor  # [P] the rows of the step's logits they penalise
    seen: torch.Tensor  # [P, L] prompt and output ids (repetition penalty)
    generated: torch.Tensor  # [P, G] output ids (frequency and presence penalties)
    repetition: torch.Tensor  # [P, 1]
    frequency: torch.Tensor  # [P, 1]
    presence: torch.Tensor  # [P, 1]
    bias_rows: torch.Tensor  # [B] index into `rows`
    bias_ids: torch.Tensor  # [B]
    bias: torch.Tensor  # [B]


@dataclass(frozen=True)
class SamplingInputs:
    """A step's sampling parameters as tensors, built on the host and uploaded with the step."""

    temperature: torch.Tensor  # [M, 1]; 1 where greedy, so division is harmless
    sampled: torch.Tensor  # [M] bool: temperature > 0
    top_k: torch.Tensor  # [M, 1] int64; 0 = off
    top_p: torch.Tensor  # [M, 1]
    min_p: torch.Tensor  # [M, 1]
    seeded_rows: torch.Tensor  # [S]
    seeded_noise: torch.Tensor  # [S, V]: Exp(1) draws of each seeded row's generator
    penalties: Penalties | None
    logprobs: int  # the most top logprobs a row asks for; -1 where none asks
    samples: bool  # whether any row samples at a temperature (else every row is greedy)
    sorts: bool  # whether a row asks for top-k or top-p (a sort of the vocabulary)
    unseeded: bool  # whether a row samples from the device's own generator
    errors: dict[int, str]  # row -> why its parameters cannot be sampled (drawn as greedy)


def _padded(lists: list[list[int]], pad: int) -> torch.Tensor:
    width = max(1, max(len(ids) for ids in lists))
    return torch.tensor([ids + [pad] * (width - len(ids)) for ids in lists], dtype=torch.int64)


def _penalties(requests: Sequence[RunnerRequest], vocab: int) -> Penalties | None:
    rows = [i for i, r in enumerate(requests) if r.params.penalized]
    if not rows:
        return None
    chosen = [requests[i] for i in rows]
    bias = [(j, t, b) for j, r in enumerate(chosen) for t, b in r.params.logit_bias]
    return Penalties(
        rows=torch.tensor(rows, dtype=torch.int64),
        seen=_padded([r.token_ids if r.params.repetition_penalty != 1.0 else []
                      for r in chosen], vocab),
        generated=_padded([r.output_token_ids if r.params.frequency_penalty
                           or r.params.presence_penalty else [] for r in chosen], vocab),
        repetition=torch.tensor([[r.params.repetition_penalty] for r in chosen]),
        frequency=torch.tensor([[r.params.frequency_penalty] for r in chosen]),
        presence=torch.tensor([[r.params.presence_penalty] for r in chosen]),
        bias_rows=torch.tensor([j for j, _, _ in bias], dtype=torch.int64),
        bias_ids=torch.tensor([t for _, t, _ in bias], dtype=torch.int64),
        bias=torch.tensor([b for _, _, b in bias], dtype=torch.float32))


def sampling_inputs(requests: Sequence[RunnerRequest], vocab: int) -> SamplingInputs:
    """The host half of sampling: parameters, penalty histories and seeded rows' noise.

    Drawing a seeded row's noise advances its generator, as the per-row sampler's
    torch.multinomial did, so a recompute after preemption draws on from the same state."""
    errors: dict[int, str] = {}
    seeded, noise = [], []
    for i, request in enumerate(requests):
        params = request.params
        if params.prefill_only or not params.temperature > 0 or params.seed is None:
            continue
        try:
            if request.generator is None:
                request.generator = make_generator(params.seed)
            noise.append(torch.empty(vocab).exponential_(1, generator=request.generator))
            seeded.append(i)
        except Exception as exc:  # whatever it is, it is this request's alone
            errors[i] = f"{type(exc).__name__}: {exc}"
    asked = [r.params.logprobs for r in requests
             if r.params.logprobs is not None and not r.params.prefill_only]
    return SamplingInputs(
        temperature=torch.tensor([[r.params.temperature if r.params.temperature > 0 else 1.0]
                                  for r in requests]),
        sampled=torch.tensor([r.params.temperature > 0 for r in requests]),
        top_k=torch.tensor([[r.params.top_k if 0 < r.params.top_k < vocab else 0]
                            for r in requests], dtype=torch.int64),
        top_p=torch.tensor([[r.params.top_p] for r in requests]),
        min_p=torch.tensor([[r.params.min_p] for r in requests]),
        seeded_rows=torch.tensor(seeded, dtype=torch.int64),
        seeded_noise=torch.stack(noise) if noise else torch.empty(0, vocab),
        penalties=_penalties(requests, vocab),
        logprobs=max(asked, default=-1),
        samples=any(r.params.temperature > 0 and not r.params.prefill_only for r in requests),
        sorts=any(r.params.temperature > 0 and (0 < r.params.top_k < vocab
                                                or r.params.top_p < 1.0) for r in requests),
        unseeded=any(r.params.temperature > 0 and r.params.seed is None
                     and not r.params.prefill_only for r in requests),
        errors=errors)


def _penalized(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    vocab = logits.shape[-1]
    scores = logits.index_select(0, p.rows)
    scores.index_put_((p.bias_rows, p.bias_ids), p.bias, accumulate=True)
    wide = (scores.shape[0], vocab + 1)  # the spare column takes the padding
    seen = torch.zeros(wide, dtype=torch.bool, device=scores.device).scatter_(
        1, p.seen, True)[:, :vocab]
    scores = torch.where(seen, torch.where(scores > 0, scores / p.repetition,
                                           scores * p.repetition), scores)
    counts = torch.zeros(wide, dtype=scores.dtype, device=scores.device).scatter_add_(
        1, p.generated, torch.ones(p.generated.shape, dtype=scores.dtype,
                                   device=scores.device))[:, :vocab]
    scores = scores - (p.frequency * counts + p.presence * (counts > 0).to(scores.dtype))
    return logits.index_copy(0, p.rows, scores)


def _processed(scores: torch.Tensor, s: SamplingInputs) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p: rows that ask nothing of a filter pass it unchanged."""
    scaled = scores / s.temperature
    probs = torch.softmax(scaled, dim=-1)  # vLLM's min-p: below min_p times the likeliest
    scaled = scaled.masked_fill(probs < s.min_p * probs.amax(dim=-1, keepdim=True),
                                float("-inf"))
    if s.sorts:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        kth = sorted_logits.gather(1, (s.top_k - 1).clamp(min=0))
        cut = (s.top_k > 0) & (scaled < kth)
        scaled = scaled.masked_fill(cut, float("-inf"))
        sorted_logits = sorted_logits.masked_fill(cut.gather(1, order), float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass before it reaches top_p; the top one stays
        drop = ((probs.cumsum(dim=-1) - probs) >= s.top_p) & (s.top_p < 1.0)
        drop[:, 0] = False
        scaled = scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled


def sample(logits: torch.Tensor, requests: Sequence[RunnerRequest],
           processed_logprobs: bool = False,
           inputs: SamplingInputs | None = None,
           processors: LogitsProcessors | None = None) -> ModelRunnerOutput:
    """One token per row of `logits` [M, V] (fp32), row i for `requests[i]`; `inputs` as
    sampling_inputs made them (on the logits' device), else made here; `processors` (grammar
    masks, min_tokens) shape the final logits, and a request whose processor fails fails
    alone."""
    if not requests:
        return ModelRunnerOutput()
    host = sampling_inputs(requests, logits.shape[-1]) if inputs is None else inputs
    s = _on(host, logits.device)
    scores = logits if s.penalties is None else _penalized(logits, s.penalties)
    # the one place the logits become final: the logits processors shape `scores` here,
    # before greedy, sampling and processed logprobs read them
    refused: dict[str, str] = {}
    if processors is not None:
        refused = processors.apply(scores, requests)
    tokens = scores.argmax(dim=-1)
    processed, broken = scores, torch.zeros_like(s.sampled)
    if host.samples:  # greedy steps (the default) skip the vocabulary-wide passes
        processed = _processed(scores, s)
        probs = torch.softmax(processed, dim=-1)
        noise = (torch.empty_like(probs).exponential_(1) if s.unseeded
                 else torch.ones_like(probs))
        noise.index_copy_(0, s.seeded_rows, s.seeded_noise)
        tokens = torch.where(s.sampled, (probs / noise).argmax(dim=-1), tokens)
        broken = s.sampled & ~torch.isfinite(probs).all(dim=-1)
    columns = [tokens.double(), broken.double()]
    if host.logprobs >= 0:
        chosen_from = torch.where(s.sampled[:, None], processed, scores) \
            if processed_logprobs else logits
        logprobs = torch.log_softmax(chosen_from, dim=-1)
        chosen = logprobs.gather(1, tokens[:, None])
        top_values, top_ids = logprobs.topk(host.logprobs, dim=1)
        columns += [chosen[:, 0].double(), (logprobs > chosen).sum(dim=1).double() + 1,
                    top_ids.double().flatten(1), top_values.double().flatten(1)]
    read = torch.cat([c.view(len(requests), -1) for c in columns], dim=1).tolist()
    return _output(read, requests, host, refused)


def _output(read: list[list[float]], requests: Sequence[RunnerRequest],
            inputs: SamplingInputs, refused: dict[str, str]) -> ModelRunnerOutput:
    """The step's one read back, per request: its token, error or logprobs."""
    output = ModelRunnerOutput()
    top = inputs.logprobs
    for row, (request, values) in enumerate(zip(requests, read, strict=True)):
        params = request.params
        if params.prefill_only:
            continue
        if request.id in refused:  # its processor failed: the token drawn is not its
            output.errors[request.id] = refused[request.id]
            continue
        cause = inputs.errors.get(row) or ("probabilities are not finite (NaN or inf)"
                                           if values[1] else None)
        if cause is not None:
            output.errors[request.id] = (
                f"sampling failed (temperature {params.temperature}, top_p {params.top_p}, "
                f"top_k {params.top_k}, seed {params.seed}): {cause}")
            continue
        token = int(values[0])
        output.token_ids[request.id] = token
        if params.logprobs is not None:
            ids, lps = values[4:4 + top], values[4 + top:4 + 2 * top]
            pairs = tuple((int(i), v) for i, v in zip(ids[:params.logprobs],
                                                      lps[:params.logprobs], strict=True))
            output.logprobs[request.id] = TokenLogprob(token, values[2], int(values[3]), pairs)
    return output


def _on(inputs: SamplingInputs, device: torch.device) -> SamplingInputs:
    """`inputs` with its tensors on `device` (already there when the step uploaded them)."""
    if inputs.temperature.device == device:
        return inputs
    return moved(inputs, lambda t: t.to(device))


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


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)
