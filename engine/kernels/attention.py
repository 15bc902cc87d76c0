"""Attention over the paged KV cache for one packed batch, and each path's per-step metadata:
the path a layer runs is the type of the metadata it is handed (engine.kernels.backends)."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.kernels.cpu_kernels import paged_decode, paged_prefill

try:  # FlexAttention: in torch itself, fused where compiled (CUDA); eager on CPU is exact
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch older than 2.5
    flex_attention = BlockMask = None

try:  # optional `gpu` extra; absent on CPU machines
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None

FLASH_BLOCK_SIZE = 256  # flash-attn's paged KV needs blocks that are a multiple of 256
FLEX_TILE = 128  # FlexAttention's sparse block, on both axes (its default)
# one prefill slice's attention scores at most (SDPA's math kernel holds them all, in fp32)
SCORE_BYTES = 1 << 30
SCORE_ELEMENT_BYTES = 8  # a score and its softmax, float32 each
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MIN_CAPABILITY = (8, 0)  # Ampere
FLASH_MAX_HEAD_DIM = 256
FLASH_HEAD_DIM_MULTIPLE = 8  # flash_api.cpp's check; its Python wrapper pads others


@dataclass(frozen=True)
class GpuDescription:
    """What the attention guard and the KV sizing read of a GPU (tests make one by hand)."""

    name: str
    capability: tuple[int, int]
    total_bytes: int


def describe_gpu(device: torch.device) -> GpuDescription:
    props = torch.cuda.get_device_properties(device)
    return GpuDescription(props.name, (props.major, props.minor), props.total_memory)


def flash_refusal(gpu: GpuDescription, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why flash-attn cannot run this model here, or None where it can."""
    if dtype not in FLASH_DTYPES:
        return f"flash-attn takes float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if gpu.capability < FLASH_MIN_CAPABILITY:
        major, minor = gpu.capability
        return (f"flash-attn needs compute capability 8.0 (Ampere) or newer; {gpu.name} has "
                f"{major}.{minor}")
    if head_dim > FLASH_MAX_HEAD_DIM:
        return f"flash-attn takes head sizes up to {FLASH_MAX_HEAD_DIM}, not {head_dim}"
    if head_dim % FLASH_HEAD_DIM_MULTIPLE:
        # its wrapper would pad the whole paged cache to the next multiple, every layer
        return (f"flash-attn's paged KV needs head sizes in multiples of "
                f"{FLASH_HEAD_DIM_MULTIPLE}, not {head_dim}")
    return None


@dataclass(frozen=True)
class PrefillSpan:
    """A prefill chunk's rows of the step: SDPA's gathered key slots, or the CPU kernel's
    block table. Its mask is made on the device from positions (`mask`), never uploaded: at
    a deep context it is the size of the chunk times the context."""

    q_start: int
    q_len: int
    key_slots: torch.Tensor | None
    block_table: torch.Tensor | None = None
    start: int = 0  # the position of its first query
    first_key: int = 0  # the position of its first gathered key
    window: int | None = None

    def mask(self, first: int, last: int, device: torch.device) -> torch.Tensor | None:
        """Rows [first, last)'s mask over the gathered keys (True = attend): causal from
        the right, within the window; None where it is the square causal one SDPA makes."""
        end = self.start + self.q_len
        if (first, last, self.start) == (0, self.q_len, 0) and (
                self.window is None or end <= self.window):
            return None
        positions = torch.arange(self.start + first, self.start + last, device=device)[:, None]
        keys = torch.arange(self.first_key, end, device=device)[None]
        mask = keys <= positions
        if self.window is not None:
            mask &= keys > positions - self.window
        return mask


@dataclass(frozen=True)
class DecodeGroup:

    row_start: int
    rows: int
    block_ids: torch.Tensor
    bias: torch.Tensor


@dataclass(frozen=True)
class FlexMetadata:
    """The step's keys gathered into one view and who may see whom, for FlexAttention.

    Every chunk's history (prefills and decodes alike) lies side by side in `key_slots`; a
    query sees the keys of its own sequence at or before its position (within the window on
    windowed layers). One gather and one fused call a layer serve the whole step."""

    slot_mapping: torch.Tensor  # [N] where each new token's K/V is written
    key_slots: torch.Tensor  # [K] flat cache slots of every chunk's keys
    query_seq: torch.Tensor  # [N] the sequence (chunk index) of each query row
    query_pos: torch.Tensor  # [N]
    key_seq: torch.Tensor  # [K]
    key_pos: torch.Tensor  # [K]
    # FlexAttention's sparse block tables (engine.kernels.backends.flex_tiles), for all
    # layers and for sliding-window ones; None where flex runs without a block mask (the CPU)
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None
    windowed_tiles: tuple[torch.Tensor, torch.Tensor] | None = None
    # the block masks built from these on the device, by window (made once a step, not a layer)
    masks: dict[int | None, object] = field(default_factory=dict, init=False, compare=False)

    def mask_mod(self, window: int | None) -> Callable[..., torch.Tensor]:
        query_seq, query_pos, key_seq, key_pos = (self.query_seq, self.query_pos, self.key_seq,
                                                  self.key_pos)

        def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor) -> torch.Tensor:
            seen = (query_seq[q] == key_seq[k]) & (key_pos[k] <= query_pos[q])
            if window is not None:
                seen = seen & (key_pos[k] > query_pos[q] - window)
            return seen

        return visible


@dataclass(frozen=True)
class TorchMetadata:
    """The gather path's step: SDPA over gathered keys, or the CPU paged kernels where the
    spans carry block tables and `decode_tables` is set. Built once per step, not per layer."""

    slot_mapping: torch.Tensor
    prefills: tuple[PrefillSpan, ...]
    decode_start: int  # decodes are rows [decode_start, num_tokens)
    decode_groups: tuple[DecodeGroup, ...]
    windowed: TorchMetadata | None = None  # what sliding-window layers read instead
    decode_tables: torch.Tensor | None = None
    decode_lengths: torch.Tensor | None = None


@dataclass(frozen=True)
class FlashMetadata:
    """What flash_attn_varlen_func reads: int32 offsets in packed order and block tables."""

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    block_table: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


AttentionMetadata = TorchMetadata | FlashMetadata | FlexMetadata


def flash_available(device: torch.device) -> bool:
    return device.type == "cuda" and flash_attn_varlen_func is not None


CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                      None]


def index_copy_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    k_cache.view(heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1))
    v_cache.view(heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1))


class PagedAttention:
    """Writes new K/V into a layer's cache slice and attends over the history."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None, window: int | None = None,
                 softcap: float | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        self.window = window
        self.softcap = softcap
        self.write: CacheWrite = index_copy_write  # or the kernel's (engine.core.kernel_swap)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        if isinstance(meta, FlashMetadata):
            return self._flash(q, k, v, k_cache, v_cache, meta)
        if isinstance(meta, FlexMetadata):
            return self._flex(q, k, v, k_cache, v_cache, meta)
        return self._gather(q, k, v, k_cache, v_cache, meta)

    def _flash(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: FlashMetadata) -> torch.Tensor:
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)
        return flash_attn_varlen_func(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
            meta.max_seqlen_k, softmax_scale=self.scale, causal=True,
            # flash's window counts keys left of the query, ours includes the query
            window_size=(-1, -1) if self.window is None else (self.window - 1, 0),
            softcap=self.softcap or 0.0, block_table=meta.block_table,
        )

    def _gather(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: TorchMetadata) -> torch.Tensor:
        if self.window is not None:
            if meta.windowed is None:
                raise RuntimeError("a sliding-window layer needs TorchMetadata.windowed")
            meta = meta.windowed
        self.write(k, v, k_cache, v_cache, meta.slot_mapping)
        flat_k = k_cache.view(self.num_kv_heads, -1, self.head_dim)
        flat_v = v_cache.view(self.num_kv_heads, -1, self.head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.block_table is not None:
                paged_prefill(q[rows], k_cache, v_cache, span.block_table, span.start,
                              self.scale, self.window, self.softcap, out=out[rows])
            else:
                out[rows] = self._prefill(q[rows], flat_k, flat_v, span)
        if meta.decode_tables is not None:
            paged_decode(q[meta.decode_start:], k_cache, v_cache, meta.decode_tables,
                         meta.decode_lengths, self.scale, self.window, self.softcap,
                         out=out[meta.decode_start:])
            return out
        block_k = k_cache.flatten(2)
        block_v = v_cache.flatten(2)
        for group in meta.decode_groups:
            rows = slice(group.row_start, group.row_start + group.rows)
            out[rows] = self._decode(q[rows], block_k, block_v, group)
        return out

    def _flex(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, flex: FlexMetadata) -> torch.Tensor:
        index_copy_write(k, v, k_cache, v_cache, flex.slot_mapping)
        keys = k_cache.view(self.num_kv_heads, -1, self.head_dim).index_select(1, flex.key_slots)
        values = v_cache.view(self.num_kv_heads, -1, self.head_dim).index_select(
            1, flex.key_slots)
        visible = flex.mask_mod(self.window)
        cap = self.softcap
        # scaled here, and flex's own scale held at 1: a model's scale passed as a float becomes
        # a traced tensor once Dynamo has seen two models, and reading it back costs a host read
        q = q * self.scale
        tiles = flex.tiles if self.window is None else flex.windowed_tiles
        if tiles is not None:  # sparse blocks and, compiled, a fused kernel
            if self.window not in flex.masks:
                flex.masks[self.window] = BlockMask.from_kv_blocks(
                    *tiles, BLOCK_SIZE=FLEX_TILE, mask_mod=visible,
                    seq_lengths=(q.shape[0], keys.shape[1]))
            block_mask, score_mod = flex.masks[self.window], None
            if cap is not None:
                def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor,
                              qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
                    return cap * torch.tanh(score / cap)
            run = _compiled_flex() if q.is_cuda else _eager_flex
            out = run(q.transpose(0, 1)[None], keys[None], values[None], score_mod=score_mod,
                      block_mask=block_mask, scale=1.0, enable_gqa=True)
        else:  # eager: the mask as a score_mod, no block mask to build each step
            def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor,
                          qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
                if cap is not None:
                    score = cap * torch.tanh(score / cap)
                return torch.where(visible(b, h, qi, ki), score, float("-inf"))
            out = _eager_flex(q.transpose(0, 1)[None], keys[None], values[None],
                              score_mod=score_mod, scale=1.0, enable_gqa=True)
        return out[0].transpose(0, 1)

    def _prefill(self, q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor,
                 span: PrefillSpan) -> torch.Tensor:
        assert span.key_slots is not None
        keys = flat_k.index_select(1, span.key_slots)
        values = flat_v.index_select(1, span.key_slots)
        width = keys.shape[1]
        rows = max(1, SCORE_BYTES // (self.num_heads * width * SCORE_ELEMENT_BYTES))
        if rows >= span.q_len:
            return self._attend(q, keys, values, span.mask(0, span.q_len, q.device))
        # a long chunk over a deep history: its query rows in slices, each row's own result
        out = torch.empty_like(q)
        for first in range(0, span.q_len, rows):
            last = min(first + rows, span.q_len)
            out[first:last] = self._attend(q[first:last], keys, values,
                                           span.mask(first, last, q.device))
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """q [n, Hq, D] over keys and values [Hkv, K, D]; `mask` [n, K] (None: square causal)."""
        n = q.shape[0]
        if self.softcap is not None:
            if mask is None:
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            bias.masked_fill_(~mask, float("-inf"))
            grouped = q.transpose(0, 1).reshape(self.num_kv_heads, self.group, n,
                                                self.head_dim)
            out = self._softcapped(grouped, keys[:, None], values[:, None], bias)
            return out.reshape(self.num_heads, n, self.head_dim).transpose(0, 1)
        # 4-D: SDPA's fused CPU kernel takes no 3-D inputs
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
            is_causal=mask is None, scale=self.scale, enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, block_k: torch.Tensor, block_v: torch.Tensor,
                group: DecodeGroup) -> torch.Tensor:
        batch = group.rows
        shape = (self.num_kv_heads, batch, group.bias.shape[-1], self.head_dim)
        block_ids = group.block_ids.view(-1)
        keys = block_k.index_select(1, block_ids).view(shape)
        values = block_v.index_select(1, block_ids).view(shape)
        # queries grouped per KV head: (Hkv, B) are SDPA's batch dims, so GQA copies no keys
        grouped = q.view(batch, self.num_kv_heads, self.group, self.head_dim).transpose(0, 1)
        if self.softcap is not None:
            out = self._softcapped(grouped, keys, values, group.bias)
        else:
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=group.bias,
                                                 scale=self.scale)
        return out.transpose(0, 1).reshape(batch, self.num_heads, self.head_dim)

    def _softcapped(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    bias: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        scores = self.softcap * torch.tanh(scores / self.softcap) + bias
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, values)


def block_masked(device: torch.device) -> bool:
    """Whether flex skips masked blocks (and runs compiled): on CUDA. On the CPU a block mask
    each step costs more than it saves, and Inductor's CPU flex template fails to build with
    dynamic shapes (EAGER_FLEX_ON_CPU)."""
    return device.type == "cuda"


# Inductor's CPU flex template renames its block-size symbol by plain text replacement, so
# with ten or more size symbols `ks1` also rewrites `ks17`; the C++ then fails to build
EAGER_FLEX_ON_CPU = ("flex attention runs eagerly on the CPU (compile covers the dense layers "
                     "only): Inductor's CPU flex template fails to build with dynamic shapes "
                     f"in torch {torch.__version__.split('+')[0]} (docs/gpu.md)")


def _eager_flex(*args: object, **kwargs: object) -> torch.Tensor:
    with warnings.catch_warnings():  # eager is what CPU runs by design: no nudge to compile
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        return flex_attention(*args, **kwargs)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, dynamic=True)
