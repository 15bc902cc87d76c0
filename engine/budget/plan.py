"""The prefill plan budget_score measures against: scheduler rules, priced by the predictor."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.batch import PlannedChunk, StepShape

BUDGET_SCORE_DEFINITION = (
    "budget_score = measured prefill time / planned prefill time. The plan is the predicted "
    "time (calibrated step-time model) of the steps that carry the request's chunks, with the "
    "decodes and other prefills planned beside them and the steps it waits behind earlier "
    "prefills; it is re-planned on tuning changes and new arrivals, never for a fault. A "
    "healthy engine scores near 1 at any load; above the slow-query threshold something went "
    "wrong for that request: time in CACHE_PRESSURE_WAIT, a bandwidth throttle, preemption, "
    "chunks slower than predicted, or a guard. A slow query also overran its plan by at least "
    "slow_query_min_overrun_ms. None (\"calibrating\") until the engine's first calibration.")

MAX_PLAN_STEPS = 100_000


@dataclass(frozen=True)
class PlanRules:
    budget: int
    tile: int
    slots: int
    chunk_cap: float
    chunked: bool


@dataclass(frozen=True)
class PlanItem:
    """A prefill to plan: tokens [position, end) still to compute, in queue order."""

    key: object
    position: int
    end: int


def plan_prefills(items: Sequence[PlanItem], decode_contexts: Sequence[int], rules: PlanRules,
                  predict: Callable[[StepShape], float]) -> dict[object, list[PlannedChunk]]:
    position = {item.key: item.position for item in items}
    end = {item.key: item.end for item in items}
    order = [item.key for item in items if item.position < item.end]
    plans: dict[object, list[PlannedChunk]] = {key: [] for key in position}
    waited: dict[object, tuple[float, int]] = dict.fromkeys(order, (0.0, 0))
    decodes = list(decode_contexts)
    for _ in range(MAX_PLAN_STEPS):
        if not order:
            break
        chunks = _step_chunks(order, position, end, len(decodes), rules)
        shape = StepShape(prefill=tuple((n, position[k]) for k, n in chunks.items()),
                          decode_contexts=tuple(decodes))
        seconds = predict(shape)
        prefill_tokens = shape.prefill_tokens
        for key in order:
            wait_s, wait_steps = waited[key]
            tokens = chunks.get(key, 0)
            if not tokens:
                waited[key] = (wait_s + seconds, wait_steps + 1)
                continue
            plans[key].append(PlannedChunk(
                start=position[key], tokens=tokens, predicted_s=seconds, wait_s=wait_s,
                wait_steps=wait_steps, decodes=len(decodes),
                other_prefill_tokens=prefill_tokens - tokens))
            waited[key] = (0.0, 0)
            position[key] += tokens
        decodes = [c + 1 for c in decodes]
        for key in [k for k in order if position[k] >= end[k]]:
            order.remove(key)
            decodes.append(end[key] + 1)
    return plans


def _step_chunks(order: list[object], position: dict[object, int], end: dict[object, int],
                 decodes: int, rules: PlanRules) -> dict[object, int]:
    """Tokens each prefill gets in one simulated step, without tenant shares or KV limits."""
    left = rules.budget - decodes
    chunks: dict[object, int] = {}
    short = short_prefills([end[key] - position[key] for key in order], left, rules.slots,
                           rules.tile)
    picked = set(short)
    for key in [*(order[i] for i in short), *(k for i, k in enumerate(order) if i not in picked)]:
        if left < 1 or len(chunks) >= rules.slots:
            break
        tokens = chunk_tokens(end[key] - position[key], min(left, rules.chunk_cap), rules.tile,
                              rules.chunked)
        if tokens > 0:
            chunks[key] = tokens
            left -= tokens
    if not chunks:
        head = order[0]
        chunks[head] = min(end[head] - position[head], rules.tile) if rules.chunked \
            else end[head] - position[head]
    return chunks


def short_prefills(remaining: Iterable[int], budget: int, slots: int, tile: int,
                   may_jump: Callable[[int], bool] = lambda _index: True) -> list[int]:
    """The short-prompt rule, the scheduler's and the plans': of the prefills in queue order
    with `remaining` tokens each, the indices of those that go ahead of the rest in a step.
    A prefill that a slot's share of the step (`budget` / `slots`) finishes whole goes first,
    so a short prompt waits a step, not behind every long prompt before it (vLLM's
    max_long_partial_prefills lets short prompts jump long ones likewise). Short ones take at
    most half the budget and one slot less than all: the long ones advance every step.
    `may_jump(i)` is asked last, of each one short enough."""
    limit = max(tile, budget // max(1, slots))
    room = budget // 2
    picked: list[int] = []
    for index, tokens in enumerate(remaining):
        if len(picked) >= slots - 1:
            break
        if tokens <= min(limit, room) and may_jump(index):
            picked.append(index)
            room -= tokens
    return picked


def chunk_tokens(remaining: int, room: float, tile: int, chunked: bool) -> int:
    """The chunk rule, the scheduler's and the plans': a prefill with `remaining` tokens takes
    all of them if they fit in `room` (the least of its budget, cap and KV), else whole tiles,
    and without chunked prefill nothing."""
    tokens = int(max(0, min(remaining, room)))
    if tokens < remaining:
        return tokens // tile * tile if chunked else 0
    return tokens


def replanned(planned: list[PlannedChunk], position: int, steps_waited: int,
              new: list[PlannedChunk]) -> list[PlannedChunk]:
    """`planned` before `position`, then `new`, credited the wait already spent."""
    kept: list[PlannedChunk] = []
    credit_s, credit_steps = 0.0, 0
    for chunk in planned:
        if chunk.start + chunk.tokens <= position:
            kept.append(chunk)
        elif chunk.start < position:
            share = (position - chunk.start) / chunk.tokens
            kept.append(dataclasses.replace(chunk, tokens=position - chunk.start,
                                            predicted_s=chunk.predicted_s * share))
        elif chunk.start == position and chunk.wait_steps:
            credit_steps = min(steps_waited, chunk.wait_steps)
            credit_s = chunk.wait_s * credit_steps / chunk.wait_steps
    if new and credit_steps:
        first = new[0]
        new = [dataclasses.replace(first, wait_s=first.wait_s + credit_s,
                                   wait_steps=first.wait_steps + credit_steps), *new[1:]]
    return kept + new
