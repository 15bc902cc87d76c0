"""Token sampling as vLLM V1 does it, vectorised over the step's rows on the logits' device:
logit_bias, the penalties, then greedy or temperature with min-p, top-k and top-p; one read
back to the host per step.

A temperature-sampled row draws as torch.multinomial does (an exponential race:
argmax(p / q), q ~ Exp(1)); a seeded row's q comes from its own CPU generator, so a seed draws
the same tokens on every device and as the per-row sampler did."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from engine.batch import ModelRunnerOutput, TokenLogprob
from engine.core.logits_processors import (
    LogitsProcessors,
    ProcessedRows,
    grammar_masks,
    holds_back,
    processed_rows,
)
from engine.core.runner_requests import RunnerRequest, SamplingRow
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
class RowParams:
    """What a step's rows ask of sampling, fixed while the rows are the same requests: the
    parameters' tensors and flags, and which rows draw afresh each step."""

    temperature: torch.Tensor  # [M, 1]; 1 where greedy, so division is harmless
    sampled: torch.Tensor  # [M] bool: temperature > 0
    top_k: torch.Tensor  # [M, 1] int64; 0 = off
    top_p: torch.Tensor  # [M, 1]
    min_p: torch.Tensor  # [M, 1]
    seeded: tuple[int, ...]  # rows that sample from their own seeded generator
    penalized: bool  # whether a row has penalties or a logit_bias
    logprobs: int  # the most top logprobs a row asks for; -1 where none asks
    samples: bool  # whether any row samples at a temperature (else every row is greedy)
    sorts: bool  # whether a row asks for top-k or top-p (a sort of the vocabulary)
    unseeded: bool  # whether a row samples from the device's own generator
    min_ps: bool  # whether a row asks for min-p (else the filter keeps every token)
    scales: bool  # whether a row's temperature is other than 1 (else dividing changes nothing)
    all_sampled: bool  # whether every row samples at a temperature (no greedy argmax)
    prefill_only: bool  # whether a row only scores its prompt
    processed: ProcessedRows  # the rows the logits processors may touch


@dataclass(frozen=True)
class SamplingInputs(RowParams):
    """A step's sampling inputs as tensors, built on the host and uploaded with the step: its
    rows' parameters and what is drawn or read afresh each step."""

    seeded_rows: torch.Tensor  # [S]
    seeded_noise: torch.Tensor  # [S, V]: Exp(1) draws of each seeded row's generator
    penalties: Penalties | None
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


# the flags of RowParams a row raises, OR-ed over the step's rows; a tensor whose every row
# holds its neutral value (temperature 1, top_p 1, min_p 0, top_k 0) is made without the rows
(_PENALIZED, _SAMPLES, _SORTS, _UNSEEDED, _MIN_PS, _SCALES, _PREFILL_ONLY, _GREEDY, _SAMPLED,
 _SEEDED, _LOGPROBS, _TOP_P, _TOP_K, _PROCESSED) = (1 << bit for bit in range(14))


def sampling_row(request: RunnerRequest, vocab: int) -> SamplingRow:
    """`request`'s SamplingRow, made once and kept on it."""
    row = request.sampling_row
    if row is None:
        p = request.params
        sampled = p.temperature > 0
        samples = sampled and not p.prefill_only
        top_k = p.top_k if 0 < p.top_k < vocab else 0
        logprobs = -1 if p.logprobs is None or p.prefill_only else p.logprobs
        flags = ((_PENALIZED if p.penalized else 0)
                 | (_SAMPLES if samples else 0)
                 | (_SORTS if sampled and (top_k or p.top_p < 1.0) else 0)
                 | (_UNSEEDED if samples and p.seed is None else 0)
                 | (_SEEDED if samples and p.seed is not None else 0)
                 | (_MIN_PS if p.min_p > 0 else 0)
                 | (_SCALES if sampled and p.temperature != 1.0 else 0)
                 | (_PREFILL_ONLY if p.prefill_only else 0)
                 | (_SAMPLED if sampled else _GREEDY)
                 | (_LOGPROBS if logprobs >= 0 else 0)
                 | (_TOP_P if p.top_p != 1.0 else 0)
                 | (_TOP_K if top_k else 0)
                 | (_PROCESSED if grammar_masks(p) or holds_back(p) else 0))
        row = request.sampling_row = SamplingRow(
            (p.temperature if sampled else 1.0, p.top_p, p.min_p), top_k, sampled, logprobs,
            flags)
    return row


def row_params(requests: Sequence[RunnerRequest], vocab: int) -> RowParams:
    """The rows' parameters as tensors and flags (nothing drawn, no history read), from each
    request's SamplingRow: a per-row pass only for what some row asks of."""
    rows = [r.sampling_row or sampling_row(r, vocab) for r in requests]
    flags = functools.reduce(operator.or_, (row.flags for row in rows), 0)
    m = len(rows)

    def column(index: int, flag: int, neutral: float) -> torch.Tensor:
        if flags & flag:
            return torch.tensor([[row.floats[index]] for row in rows]).view(m, 1)
        return torch.full((m, 1), neutral)

    if flags & _GREEDY and flags & _SAMPLED:  # some rows of each kind
        sampled = torch.tensor([row.sampled for row in rows])
    else:
        sampled = torch.full((m,), bool(flags & _SAMPLED), dtype=torch.bool)
    return RowParams(
        temperature=column(0, _SCALES, 1.0), top_p=column(1, _TOP_P, 1.0),
        min_p=column(2, _MIN_PS, 0.0), sampled=sampled,
        top_k=(torch.tensor([[row.top_k] for row in rows], dtype=torch.int64).view(m, 1)
               if flags & _TOP_K else torch.zeros((m, 1), dtype=torch.int64)),
        seeded=(tuple(i for i, row in enumerate(rows) if row.flags & _SEEDED)
                if flags & _SEEDED else ()),
        penalized=bool(flags & _PENALIZED),
        logprobs=max(row.logprobs for row in rows) if flags & _LOGPROBS else -1,
        samples=bool(flags & _SAMPLES),
        sorts=bool(flags & _SORTS),
        unseeded=bool(flags & _UNSEEDED),
        min_ps=bool(flags & _MIN_PS),
        scales=bool(flags & _SCALES),
        all_sampled=not flags & _GREEDY,
        prefill_only=bool(flags & _PREFILL_ONLY),
        processed=processed_rows(requests) if flags & _PROCESSED else ((), ()))


def sampling_inputs(requests: Sequence[RunnerRequest], vocab: int,
                    rows: RowParams | None = None) -> SamplingInputs:
    """The host half of sampling: parameters, penalty histories and seeded rows' noise;
    `rows`, where given, are these requests' parameters made already.

    Drawing a seeded row's noise advances its generator, as the per-row sampler's
    torch.multinomial did, so a recompute after preemption draws on from the same state."""
    if rows is None:
        rows = row_params(requests, vocab)
    errors: dict[int, str] = {}
    seeded, noise = [], []
    for i in rows.seeded:
        request = requests[i]
        params = request.params
        try:
            if request.generator is None:
                request.generator = make_generator(params.seed)
            noise.append(torch.empty(vocab).exponential_(1, generator=request.generator))
            seeded.append(i)
        except Exception as exc:  # whatever it is, it is this request's alone
            errors[i] = f"{type(exc).__name__}: {exc}"
    return SamplingInputs(
        **{f.name: getattr(rows, f.name) for f in fields(RowParams)},
        seeded_rows=torch.tensor(seeded, dtype=torch.int64),
        seeded_noise=torch.stack(noise) if noise else torch.empty(0, vocab),
        penalties=_penalties(requests, vocab) if rows.penalized else None, errors=errors)


class StepSampling:
    """A runner's sampling inputs step after step: the rows' parameters are made again only
    when the step's rows are other requests, as vLLM's InputBatch keeps its sampling tensors
    while its requests stay; seeded noise and penalty histories are made every step."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self._requests: tuple[RunnerRequest, ...] = ()
        self._rows: RowParams | None = None

    def inputs(self, requests: Sequence[RunnerRequest]) -> SamplingInputs:
        rows, these = self._rows, tuple(requests)
        # a tuple compares its RunnerRequests by identity: a request that re-entered is new
        if rows is None or self._requests != these:
            rows, self._requests = row_params(requests, self.vocab), these
            self._rows = rows
        return sampling_inputs(requests, self.vocab, rows)


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
    # x / 1.0 is x exactly: serve's default temperature skips the pass
    scaled = scores / s.temperature if s.scales else scores
    if s.min_ps:  # vLLM's min-p: below min_p times the likeliest (min_p 0 drops nothing)
        probs = torch.softmax(scaled, dim=-1)
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
        refused = processors.apply(scores, requests, host.processed)
    processed, broken = scores, torch.zeros_like(s.sampled)
    if host.samples:  # greedy steps (the default) skip the vocabulary-wide passes
        processed = _processed(scores, s)
        probs = torch.softmax(processed, dim=-1)
        noise = exponential(probs) if s.unseeded else torch.ones_like(probs)
        noise.index_copy_(0, s.seeded_rows, s.seeded_noise)
        drawn = (probs / noise).argmax(dim=-1)
        tokens = drawn if host.all_sampled else torch.where(s.sampled, drawn,
                                                            scores.argmax(dim=-1))
        # softmax gives [0, 1] or NaN: a row's sum is NaN exactly where one is not finite
        broken = s.sampled & probs.sum(dim=-1).isnan()
    else:
        tokens = scores.argmax(dim=-1)
    if host.logprobs < 0:  # the common step: tokens and failures only, read back as ints
        drawn_ids, failed = torch.stack((tokens, broken.to(tokens.dtype))).tolist()
        if not (refused or host.errors or host.prefill_only or any(failed)):
            return ModelRunnerOutput(token_ids=dict(zip([r.id for r in requests], drawn_ids,
                                                        strict=True)))
        return _output(list(zip(drawn_ids, failed, strict=True)), requests, host, refused)
    columns = [tokens.double(), broken.double()]
    chosen_from = torch.where(s.sampled[:, None], processed, scores) \
        if processed_logprobs else logits
    logprobs = torch.log_softmax(chosen_from, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])
    top_values, top_ids = logprobs.topk(host.logprobs, dim=1)
    columns += [chosen[:, 0].double(), (logprobs > chosen).sum(dim=1).double() + 1,
                top_ids.double().flatten(1), top_values.double().flatten(1)]
    read = torch.cat([c.view(len(requests), -1) for c in columns], dim=1).tolist()
    return _output(read, requests, host, refused)


def _output(read: Sequence[Sequence[float]], requests: Sequence[RunnerRequest],
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


def exponential(like: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws from the device's generator, shaped like `like`. On the CPU,
    `exponential_` draws a uniform double and takes -log1p(-u) one element at a time; this
    draws the same doubles with `uniform_` and takes the log1p vectorised, in a third of the
    time, leaving the generator in the same state. The two log1p may differ in a double's
    last bit (8% of draws did), which moves the float only where the double straddles a
    rounding edge, by one float ulp: none of 80 M draws did."""
    if like.device.type != "cpu":
        return torch.empty_like(like).exponential_(1)
    uniform = torch.empty(like.shape, dtype=torch.float64).uniform_()
    return uniform.neg_().log1p_().neg_().to(like.dtype)


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
