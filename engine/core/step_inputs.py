"""A step's packed inputs: tokens, positions, KV slots and attention metadata of a batch,
built on the host; the runner uploads them in one copy (engine.core.staging)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import ScheduledChunk
from engine.core.runner_requests import RunnerRequest
from engine.core.sampler import SamplingInputs
from engine.kernels.attention import AttentionMetadata, DecodeGroup, FlexMetadata, PrefillSpan


@dataclass(frozen=True)
class InputLayout:
    """What packing a step needs to know of the runner, fixed once the model is loaded."""
    device: torch.device
    dtype: torch.dtype
    block_size: int
    window: int | None  # the sliding window, where the model has sliding layers
    use_flash: bool
    use_flex: bool = False


Pair = tuple[ScheduledChunk, RunnerRequest]


def _block_tables(pairs: list[Pair], dtype: torch.dtype) -> torch.Tensor:
    """Each chunk's block table as a row, padded with block 0 (one list, not a tensor per row)."""
    width = max(len(r.block_table) for _, r in pairs)
    return torch.tensor([r.block_table + [0] * (width - len(r.block_table)) for _, r in pairs],
                        dtype=dtype)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # row of each sampling chunk, in the order of the chunks given
    last_rows: dict[int, int]  # id(chunk) -> its last row in the packed order
    sampling: SamplingInputs | None = None  # the step's sampling inputs, uploaded beside


def prepare(chunks: list[ScheduledChunk], requests: list[RunnerRequest], layout: InputLayout,
            paged_prefill: bool, paged_decode: bool) -> StepInputs:
    """Pack `chunks` (of `requests`, one each) into a step's tensors, prefills first."""
    paired = list(zip(chunks, requests, strict=True))
    prefills = [p for p in paired if not p[0].is_decode]
    # decodes sorted by context so each group pads little (see _decode_groups)
    decodes = sorted((p for p in paired if p[0].is_decode), key=lambda p: -p[0].start)
    ordered = prefills + decodes
    bs = layout.block_size
    window = layout.window
    token_ids: list[int] = []
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    spans: list[PrefillSpan] = []
    windowed_spans: list[PrefillSpan] = []
    row_of: dict[int, int] = {}
    row = 0
    # a decode's position and slot as plain ints, one tensor for all (not one each)
    decode_positions: list[int] = []
    decode_slots: list[int] = []
    # flash and flex read only their own fields: no masks or gathers for them
    spanned = not (layout.use_flash or layout.use_flex)
    for chunk, request in ordered:
        end = chunk.start + chunk.num_tokens
        token_ids.extend(request.token_ids[chunk.start:end])
        row += chunk.num_tokens
        row_of[id(chunk)] = row - 1
        if chunk.is_decode:
            decode_positions.append(chunk.start)
            decode_slots.append(request.block_table[chunk.start // bs] * bs
                                + chunk.start % bs)
            continue
        table = torch.tensor(request.block_table, dtype=torch.int64)
        pos = torch.arange(chunk.start, end, dtype=torch.int64)
        positions.append(pos)
        slots.append(table[pos // bs] * bs + pos % bs)
        first = row - chunk.num_tokens
        if not spanned:
            continue
        if paged_prefill:
            # the kernel masks and windows each chunk itself: one span serves every layer
            span = PrefillSpan(first, chunk.num_tokens, None, None, block_table=table,
                               start=chunk.start)
            spans.append(span)
            windowed_spans.append(span)
        else:
            spans.append(_prefill_span(layout, first, chunk.start, end, table, None))
            if window is not None:
                windowed_spans.append(_prefill_span(layout, first, chunk.start, end, table,
                                                    window))
    if decodes:
        positions.append(torch.tensor(decode_positions, dtype=torch.int64))
        slots.append(torch.tensor(decode_slots, dtype=torch.int64))
    decode_start = row - len(decodes)
    slot_mapping = torch.cat(slots)
    # the kernel windows each decode itself: one set of tables serves every layer
    kernel = _decode_tables(decodes) if paged_decode and spanned else {}
    windowed = None
    if window is not None and spanned:
        windowed = AttentionMetadata(
            slot_mapping=slot_mapping,
            prefills=tuple(windowed_spans),
            decode_start=decode_start,
            decode_groups=() if kernel else _decode_groups(layout, decodes, decode_start,
                                                                window),
            **kernel,
        )
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        prefills=tuple(spans),
        decode_start=decode_start,
        decode_groups=() if kernel or not spanned else _decode_groups(layout, decodes,
                                                                      decode_start, None),
        **(_flash_fields(ordered) if layout.use_flash else {}),
        flex=_flex_fields(layout, ordered) if layout.use_flex else None,
        windowed=windowed,
        **kernel,
    )
    sample_rows = [row_of[id(c)] for c in chunks if c.samples]
    return StepInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=torch.cat(positions),
        meta=meta,
        sample_rows=torch.tensor(sample_rows, dtype=torch.int64),
        last_rows=row_of,
    )

def _prefill_span(layout: InputLayout, row: int, start: int, end: int, table: torch.Tensor,
                  window: int | None) -> PrefillSpan:
    """Causal lower-right mask over positions [start, end)'s history, limited to `window`."""
    pos = torch.arange(start, end, dtype=torch.int64)
    first = 0 if window is None else max(0, start - window + 1)
    keys = torch.arange(first, end, dtype=torch.int64)
    mask = None
    if start > 0 or (window is not None and end > window):
        mask = keys.unsqueeze(0) <= pos.unsqueeze(1)
        if window is not None:
            mask &= keys.unsqueeze(0) > pos.unsqueeze(1) - window
    bs = layout.block_size
    return PrefillSpan(row, len(pos), table[keys // bs] * bs + keys % bs, mask)

def _decode_groups(layout: InputLayout, decodes: list[Pair], first_row: int,
                   window: int | None) -> tuple[DecodeGroup, ...]:
    """Decodes in groups padded to their longest; a new group where padding passes a quarter."""
    bs = layout.block_size

    def first_block(chunk: ScheduledChunk) -> int:
        return 0 if window is None else max(0, chunk.start + 1 - window) // bs

    def gathered(chunk: ScheduledChunk) -> int:  # keys from its first gathered block on
        return chunk.start + 1 - first_block(chunk) * bs

    groups: list[list[Pair]] = []
    longest = real = 0  # of the last group: its widest row and its real keys
    for pair in decodes:
        keys = gathered(pair[0])
        if groups and max(longest, keys) * (len(groups[-1]) + 1) <= 1.25 * (real + keys):
            groups[-1].append(pair)
            longest, real = max(longest, keys), real + keys
            continue
        groups.append([pair])
        longest = real = keys
    result, row = [], first_row
    for group in groups:
        width = max(-(-gathered(c) // bs) for c, _ in group)
        tables = torch.zeros(len(group), width, dtype=torch.int64)
        firsts = [first_block(c) for c, _ in group]
        for i, ((_, request), first) in enumerate(zip(group, firsts, strict=True)):
            table = request.block_table[first:first + width]
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.int64)
        # global position of each gathered key; a row sees those in [low, length)
        positions = (torch.tensor(firsts, dtype=torch.int64).unsqueeze(1) * bs
                     + torch.arange(width * bs, dtype=torch.int64))
        lengths = torch.tensor([[c.start + 1] for c, _ in group], dtype=torch.int64)
        hidden = positions >= lengths
        if window is not None:
            hidden |= positions < lengths - window
        bias = torch.zeros(len(group), width * bs, dtype=layout.dtype)
        bias.masked_fill_(hidden, float("-inf"))
        result.append(DecodeGroup(row, len(group), tables,
                                  bias.view(1, len(group), 1, width * bs)))
        row += len(group)
    return tuple(result)

def _decode_tables(decodes: list[Pair]) -> dict[str, torch.Tensor]:
    """The paged kernel's metadata: block tables (padding never read) and key counts."""
    if not decodes:
        return {}
    lengths = torch.tensor([c.start + 1 for c, _ in decodes], dtype=torch.int64)
    return {"decode_tables": _block_tables(decodes, torch.int64), "decode_lengths": lengths}

def _flash_fields(ordered: list[Pair]) -> dict[str, object]:
    q_lens = [c.num_tokens for c, _ in ordered]
    k_lens = [c.start + c.num_tokens for c, _ in ordered]
    tables = _block_tables(ordered, torch.int32)
    cumulative = [0]
    for n in q_lens:
        cumulative.append(cumulative[-1] + n)
    cumulative_k = [0]
    for n in k_lens:
        cumulative_k.append(cumulative_k[-1] + n)
    return {
        "cu_seqlens_q": torch.tensor(cumulative, dtype=torch.int32),
        "cu_seqlens_k": torch.tensor(cumulative_k, dtype=torch.int32),
        "block_table": tables,
        "max_seqlen_q": max(q_lens),
        "max_seqlen_k": max(k_lens),
    }


def _flex_fields(layout: InputLayout, ordered: list[Pair]) -> FlexMetadata:
    """Each chunk's whole history side by side, in the packed order of its queries."""
    bs = layout.block_size
    slots, query_seq, query_pos, key_seq, key_pos = [], [], [], [], []
    for seq, (chunk, request) in enumerate(ordered):
        end = chunk.start + chunk.num_tokens
        table = torch.tensor(request.block_table, dtype=torch.int64)
        keys = torch.arange(end, dtype=torch.int64)
        slots.append(table[keys // bs] * bs + keys % bs)
        key_pos.append(keys)
        key_seq.append(torch.full((end,), seq, dtype=torch.int64))
        query_pos.append(keys[chunk.start:])
        query_seq.append(torch.full((chunk.num_tokens,), seq, dtype=torch.int64))
    return FlexMetadata(torch.cat(slots), torch.cat(query_seq), torch.cat(query_pos),
                        torch.cat(key_seq), torch.cat(key_pos))
