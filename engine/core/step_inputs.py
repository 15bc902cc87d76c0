"""A step's packed inputs: tokens, positions, KV slots and attention metadata of a batch,
built on the host; the runner uploads them in one copy (engine.core.staging)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import ScheduledChunk
from engine.core.runner_requests import RunnerRequest
from engine.core.sampler import SamplingInputs
from engine.kernels.attention import AttentionMetadata
from engine.kernels.backends import AttentionBackend


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # row of each sampling chunk, in the order of the chunks given
    last_rows: dict[int, int]  # id(chunk) -> its last row in the packed order
    sampling: SamplingInputs | None = None  # the step's sampling inputs, uploaded beside


def prepare(chunks: list[ScheduledChunk], requests: list[RunnerRequest],
            backend: AttentionBackend) -> StepInputs:
    """Pack `chunks` (of `requests`, one each) into a step's tensors, prefills first; the
    attention metadata is `backend`'s own."""
    paired = list(zip(chunks, requests, strict=True))
    prefills = [p for p in paired if not p[0].is_decode]
    # decodes sorted by context so each group pads little (the gather path's decode groups)
    decodes = sorted((p for p in paired if p[0].is_decode), key=lambda p: -p[0].start)
    ordered = prefills + decodes
    bs = backend.block_size
    token_ids: list[int] = []
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    row_of: dict[int, int] = {}
    row = 0
    for chunk, request in prefills:
        end = chunk.start + chunk.num_tokens
        token_ids.extend(request.token_ids[chunk.start:end])
        row += chunk.num_tokens
        row_of[id(chunk)] = row - 1
        table = torch.tensor(request.block_table, dtype=torch.int64)
        pos = torch.arange(chunk.start, end, dtype=torch.int64)
        positions.append(pos)
        slots.append(table[pos // bs] * bs + pos % bs)
    if decodes:
        # a decode is one token: its id, position and slot as plain ints, one tensor each
        starts = [chunk.start for chunk, _ in decodes]
        token_ids += [request.token_ids[start]
                      for (_, request), start in zip(decodes, starts, strict=True)]
        positions.append(torch.tensor(starts, dtype=torch.int64))
        slots.append(torch.tensor([request.block_table[start // bs] * bs + start % bs
                                   for (_, request), start in zip(decodes, starts, strict=True)],
                                  dtype=torch.int64))
        for chunk, _ in decodes:
            row_of[id(chunk)] = row
            row += 1
    slot_mapping = torch.cat(slots)
    meta = backend.metadata(ordered, slot_mapping, row - len(decodes))
    sample_rows = [row_of[id(c)] for c in chunks if c.samples]
    return StepInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=torch.cat(positions),
        meta=meta,
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64),
        last_rows=row_of,
    )
