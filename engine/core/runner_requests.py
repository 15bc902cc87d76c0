"""What the model runner holds of each request between steps (vLLM V1's CachedRequestState)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.batch import Batch, ModelRunnerOutput, ScheduledChunk
from engine.config import SamplingParams


class SamplingRow(NamedTuple):  # a tuple: read for every row of a step whose rows changed
    """A request's part of the sampler's RowParams (engine.core.sampler.sampling_row), made at
    its first step: its parameters never change."""

    floats: tuple[float, float, float]  # temperature (1 where greedy), top_p, min_p
    top_k: int  # 0 = off (also where it keeps the whole vocabulary)
    sampled: bool  # temperature > 0
    logprobs: int  # top logprobs asked for; -1 where none
    flags: int  # a bit for each RowParams flag it raises (engine.core.sampler)


@dataclass(eq=False)
class RunnerRequest:
    id: str
    token_ids: list[int]  # the prompt, then every generated token: the runner appends its own
    num_prompt_tokens: int
    params: SamplingParams
    block_table: list[int]
    generator: torch.Generator | None = None  # a seeded request's, made at its first draw
    sampling_row: SamplingRow | None = None  # its sampling parameters, made at its first step

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class RunnerRequests:
    """The runner's requests by id, kept as the batches' messages say."""

    def __init__(self) -> None:
        self.held: dict[str, RunnerRequest] = {}
        # a preempted seeded request's generator: its recompute draws on, as if never preempted
        self.parked: dict[str, torch.Generator] = {}

    def update(self, batch: Batch) -> list[RunnerRequest]:
        """Apply a batch's message; returns the request of each chunk, in `batch.chunks` order."""
        held, parked = self.held, self.parked
        for request_id in batch.finished:
            held.pop(request_id, None)
            parked.pop(request_id, None)
        for request_id in batch.preempted:
            request = held.pop(request_id, None)
            if request is not None and request.generator is not None:
                parked[request_id] = request.generator
        for new in batch.new_requests:
            held[new.id] = RunnerRequest(new.id, [*new.prompt_token_ids, *new.output_token_ids],
                                         len(new.prompt_token_ids), new.params,
                                         list(new.block_ids), parked.pop(new.id, None))
        rows = []
        for chunk in batch.chunks:
            request = held[chunk.request_id]
            if chunk.new_block_ids:
                request.block_table += chunk.new_block_ids
            rows.append(request)
        return rows

    def rows(self, chunks: Sequence[ScheduledChunk]) -> list[RunnerRequest]:
        """Each chunk's request, for chunks whose batch was applied already (probes)."""
        held = self.held
        return [held[chunk.request_id] for chunk in chunks]

    def sampled(self, rows: Sequence[RunnerRequest], output: ModelRunnerOutput) -> None:
        """Append each row's sampled token: its next decode feeds it."""
        tokens = output.token_ids
        for request in rows:
            token = tokens.get(request.id)
            if token is not None:
                request.token_ids.append(token)

    def renumber(self, moved: dict[int, int]) -> None:
        """Block ids after a compaction moved the KV rows of `moved`'s keys to its values."""
        for request in self.held.values():
            request.block_table = [moved.get(block, block) for block in request.block_table]
