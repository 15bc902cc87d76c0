"""One object per attention path: its KV layout, its block size and the metadata it builds.

A runner picks one at start-up; the metadata's type then chooses the path in each layer
(engine.kernels.attention.PagedAttention), so no flag travels with the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.batch import ScheduledChunk
from engine.kernels.attention import (
    FLASH_BLOCK_SIZE,
    FLEX_TILE,
    AttentionMetadata,
    DecodeGroup,
    FlashMetadata,
    FlexMetadata,
    PrefillSpan,
    TorchMetadata,
)


class Held(Protocol):
    """What metadata reads of a chunk's request: where its blocks are."""

    block_table: list[int]


Pair = tuple[ScheduledChunk, Held]


class AttentionBackend(Protocol):
    name: str  # torch | flex | flash
    block_size: int  # tokens a KV block holds
    window: int | None  # the sliding window, where the model has sliding layers
    # whether attention gathers keys per sequence (scratch that grows with the context)
    gathers: bool

    def cache_shape(self, num_layers: int, num_blocks: int, num_kv_heads: int,
                    head_dim: int) -> tuple[int, ...]: ...

    @property
    def block_dim(self) -> int:
        """The KV tensor's axis of blocks."""
        ...

    def metadata(self, ordered: list[Pair], slot_mapping: torch.Tensor,
                 decode_start: int) -> AttentionMetadata:
        """A step's metadata; `ordered` is prefills first, then decodes longest first."""
        ...

    def graph_metadata(self, slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                       max_model_len: int) -> AttentionMetadata:
        """A decode-only step's metadata from a CUDA graph's static buffers, on the device."""
        ...


class _HeadsFirst:
    """The gathering paths' KV layout: (k/v, layer, kv head, block, slot, head dim), blocks on
    axis 3 of it."""

    block_size: int

    def cache_shape(self, num_layers: int, num_blocks: int, num_kv_heads: int,
                    head_dim: int) -> tuple[int, ...]:
        return (2, num_layers, num_kv_heads, num_blocks, self.block_size, head_dim)

    @property
    def block_dim(self) -> int:
        return 3


@dataclass
class TorchBackend(_HeadsFirst):
    """Gathered keys through SDPA; on the CPU, the paged kernels where the choice took them."""

    block_size: int
    window: int | None
    dtype: torch.dtype  # of the decode groups' additive masks
    paged_prefill: bool = False
    paged_decode: bool = False
    name: str = "torch"
    gathers: bool = True

    def metadata(self, ordered: list[Pair], slot_mapping: torch.Tensor,
                 decode_start: int) -> TorchMetadata:
        window = self.window
        spans: list[PrefillSpan] = []
        windowed_spans: list[PrefillSpan] = []
        first = 0
        decodes = []
        for chunk, request in ordered:
            if chunk.is_decode:
                decodes.append((chunk, request))
                continue
            end = chunk.start + chunk.num_tokens
            table = torch.tensor(request.block_table, dtype=torch.int64)
            if self.paged_prefill:
                # the kernel masks and windows each chunk itself: one span serves every layer
                span = PrefillSpan(first, chunk.num_tokens, None, block_table=table,
                                   start=chunk.start)
                spans.append(span)
                windowed_spans.append(span)
            else:
                spans.append(self._prefill_span(first, chunk.start, end, table, None))
                if window is not None:
                    windowed_spans.append(self._prefill_span(first, chunk.start, end, table,
                                                             window))
            first += chunk.num_tokens
        # the kernel windows each decode itself: one set of tables serves every layer
        kernel = _decode_tables(decodes) if self.paged_decode else {}
        windowed = None
        if window is not None:
            windowed = TorchMetadata(
                slot_mapping=slot_mapping,
                prefills=tuple(windowed_spans),
                decode_start=decode_start,
                decode_groups=() if kernel else self._decode_groups(decodes, decode_start,
                                                                    window),
                **kernel,
            )
        return TorchMetadata(
            slot_mapping=slot_mapping,
            prefills=tuple(spans),
            decode_start=decode_start,
            decode_groups=() if kernel else self._decode_groups(decodes, decode_start, None),
            windowed=windowed,
            **kernel,
        )

    def graph_metadata(self, slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                       max_model_len: int) -> TorchMetadata:
        size = len(slots)
        keys = torch.arange(tables.shape[1] * self.block_size, device=lengths.device)

        def group(window: int | None) -> DecodeGroup:
            hidden = keys >= lengths[:, None]
            if window is not None:
                hidden |= keys < lengths[:, None] - window
            bias = torch.zeros(hidden.shape, dtype=self.dtype, device=lengths.device)
            bias.masked_fill_(hidden, float("-inf"))
            return DecodeGroup(0, size, tables, bias.view(1, size, 1, -1))

        windowed = None
        if self.window is not None:
            windowed = TorchMetadata(slot_mapping=slots, prefills=(), decode_start=0,
                                     decode_groups=(group(self.window),))
        return TorchMetadata(slot_mapping=slots, prefills=(), decode_start=0,
                             decode_groups=(group(None),), windowed=windowed)

    def _prefill_span(self, row: int, start: int, end: int, table: torch.Tensor,
                      window: int | None) -> PrefillSpan:
        """Positions [start, end) over the history they see, from the window's first key."""
        first = 0 if window is None else max(0, start - window + 1)
        keys = torch.arange(first, end, dtype=torch.int64)
        bs = self.block_size
        return PrefillSpan(row, end - start, table[keys // bs] * bs + keys % bs, start=start,
                           first_key=first, window=window)

    def _decode_groups(self, decodes: list[Pair], first_row: int,
                       window: int | None) -> tuple[DecodeGroup, ...]:
        """Decodes in groups padded to their longest; a new group where padding passes a
        quarter."""
        bs = self.block_size

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
            bias = torch.zeros(len(group), width * bs, dtype=self.dtype)
            bias.masked_fill_(hidden, float("-inf"))
            result.append(DecodeGroup(row, len(group), tables,
                                      bias.view(1, len(group), 1, width * bs)))
            row += len(group)
        return tuple(result)


@dataclass
class FlexBackend(_HeadsFirst):
    """FlexAttention over each chunk's whole history, gathered side by side once a layer.
    Its CUDA graphs' decodes run on the gather path's metadata. With `block_masks` (CUDA)
    each step also carries the key tiles each query tile may see, built on the host from the
    chunks' spans, so no [queries, keys] mask is ever made."""

    block_size: int
    window: int | None
    dtype: torch.dtype
    block_masks: bool = False
    name: str = "flex"
    gathers: bool = True

    def metadata(self, ordered: list[Pair], slot_mapping: torch.Tensor,
                 decode_start: int) -> FlexMetadata:
        """Each chunk's whole history side by side, in the packed order of its queries."""
        bs = self.block_size
        slots, query_seq, query_pos, key_seq, key_pos = [], [], [], [], []
        spans: list[FlexSpan] = []
        rows = keys_before = 0
        for seq, (chunk, request) in enumerate(ordered):
            end = chunk.start + chunk.num_tokens
            table = torch.tensor(request.block_table, dtype=torch.int64)
            keys = torch.arange(end, dtype=torch.int64)
            slots.append(table[keys // bs] * bs + keys % bs)
            key_pos.append(keys)
            key_seq.append(torch.full((end,), seq, dtype=torch.int64))
            query_pos.append(keys[chunk.start:])
            query_seq.append(torch.full((chunk.num_tokens,), seq, dtype=torch.int64))
            spans.append(FlexSpan(rows, chunk.num_tokens, keys_before, chunk.start))
            rows, keys_before = rows + chunk.num_tokens, keys_before + end
        tiles = windowed = None
        if self.block_masks:
            tiles = flex_tiles(spans, rows, keys_before, None)
            if self.window is not None:
                windowed = flex_tiles(spans, rows, keys_before, self.window)
        return FlexMetadata(slot_mapping, torch.cat(slots), torch.cat(query_seq),
                            torch.cat(query_pos), torch.cat(key_seq), torch.cat(key_pos),
                            tiles, windowed)

    def graph_metadata(self, slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                       max_model_len: int) -> TorchMetadata:
        return TorchBackend(self.block_size, self.window, self.dtype).graph_metadata(
            slots, tables, lengths, max_model_len)


@dataclass(frozen=True)
class FlexSpan:
    """One chunk in a flex step: its rows of the packed queries and its keys' first index."""

    row: int
    count: int
    first_key: int
    start: int  # the position of its first query


def flex_tiles(spans: list[FlexSpan], rows: int, keys: int,
               window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's sparse block tables, (kv_num_blocks [1, 1, Q], kv_indices [1, 1, Q, K])
    over Q query tiles and K key tiles of FLEX_TILE: every key tile where some query of the
    tile sees some key of its own chunk. A superset where a tile holds several chunks; the
    mask_mod, applied in every listed tile, keeps the result exact."""
    t = FLEX_TILE
    seen = torch.zeros(-(-rows // t), -(-keys // t), dtype=torch.bool)
    for span in spans:
        for tile in range(span.row // t, (span.row + span.count - 1) // t + 1):
            first = max(span.row, tile * t) - span.row  # the span's queries in this tile
            last = min(span.row + span.count, (tile + 1) * t) - 1 - span.row
            low = 0 if window is None else max(0, span.start + first - window + 1)
            high = span.start + last  # a query sees keys up to its own position
            seen[tile, (span.first_key + low) // t:(span.first_key + high) // t + 1] = True
    # each row's listed tiles first, ascending (a row at a time: a sort of the whole table
    # costs several times more)
    indices = torch.zeros(seen.shape, dtype=torch.int32)
    for tile, row in enumerate(seen):
        listed = row.nonzero()[:, 0]
        indices[tile, :len(listed)] = listed
    return seen.sum(dim=-1, dtype=torch.int32)[None, None], indices[None, None]


@dataclass
class FlashBackend:
    """flash-attn's paged varlen kernel: blocks-first layout in blocks of FLASH_BLOCK_SIZE."""

    window: int | None
    block_size: int = FLASH_BLOCK_SIZE
    name: str = "flash"
    gathers: bool = False

    def cache_shape(self, num_layers: int, num_blocks: int, num_kv_heads: int,
                    head_dim: int) -> tuple[int, ...]:
        return (2, num_layers, num_blocks, self.block_size, num_kv_heads, head_dim)

    @property
    def block_dim(self) -> int:
        return 2

    def metadata(self, ordered: list[Pair], slot_mapping: torch.Tensor,
                 decode_start: int) -> FlashMetadata:
        q_lens = [c.num_tokens for c, _ in ordered]
        k_lens = [c.start + c.num_tokens for c, _ in ordered]
        cumulative = [0]
        for n in q_lens:
            cumulative.append(cumulative[-1] + n)
        cumulative_k = [0]
        for n in k_lens:
            cumulative_k.append(cumulative_k[-1] + n)
        return FlashMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=torch.tensor(cumulative, dtype=torch.int32),
            cu_seqlens_k=torch.tensor(cumulative_k, dtype=torch.int32),
            block_table=block_tables(ordered, torch.int32),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(k_lens),
        )

    def graph_metadata(self, slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                       max_model_len: int) -> FlashMetadata:
        size = len(slots)
        zero = torch.zeros(1, dtype=torch.int32, device=lengths.device)
        return FlashMetadata(
            slot_mapping=slots,
            cu_seqlens_q=torch.arange(size + 1, dtype=torch.int32, device=lengths.device),
            cu_seqlens_k=torch.cat((zero, lengths.cumsum(0).to(torch.int32))),
            block_table=tables.to(torch.int32), max_seqlen_q=1, max_seqlen_k=max_model_len)


def block_tables(pairs: list[Pair], dtype: torch.dtype) -> torch.Tensor:
    """Each chunk's block table as a row, padded with block 0 (one list, not a tensor per row)."""
    width = max(len(r.block_table) for _, r in pairs)
    return torch.tensor([r.block_table + [0] * (width - len(r.block_table)) for _, r in pairs],
                        dtype=dtype)


def _decode_tables(decodes: list[Pair]) -> dict[str, torch.Tensor]:
    """The paged kernel's metadata: block tables (padding never read) and key counts."""
    if not decodes:
        return {}
    lengths = torch.tensor([c.start + 1 for c, _ in decodes], dtype=torch.int64)
    return {"decode_tables": block_tables(decodes, torch.int64), "decode_lengths": lengths}
