"""What the flash path hands flash_attn_varlen_func, built on the CPU: int32 offsets of the
queries and keys in packed order (prefills first), int32 block tables padded with block 0,
the longest query and key, and none of the masks or gathers the other paths read."""

from __future__ import annotations

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.core.step_inputs import prepare
from engine.kernels.attention import FlashMetadata
from engine.kernels.backends import FlashBackend


def test_flash_fields_follow_the_packed_order() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 kv_cache_bytes=1 << 22, max_num_batched_tokens=64,
                                 chunk_tile=1, block_size=16))
    long_prompt, short_prompt = list(range(3, 43)), list(range(50, 55))
    engine.add_request(short_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the short one decodes from here on
    engine.add_request(long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    batch = engine.scheduler.schedule()
    rows = engine.runner.requests.update(batch)
    inputs = prepare(batch.chunks, rows, FlashBackend(None, block_size=16))
    meta = inputs.meta
    assert isinstance(meta, FlashMetadata)
    prefill = next(c for c in batch.chunks if not c.is_decode)
    decode = next(c for c in batch.chunks if c.is_decode)
    assert meta.cu_seqlens_q.dtype == meta.cu_seqlens_k.dtype == torch.int32
    assert meta.cu_seqlens_q.tolist() == [0, prefill.num_tokens, prefill.num_tokens + 1]
    assert meta.cu_seqlens_k.tolist() == [0, prefill.start + prefill.num_tokens,
                                          prefill.start + prefill.num_tokens + decode.start + 1]
    assert meta.max_seqlen_q == prefill.num_tokens
    assert meta.max_seqlen_k == max(prefill.start + prefill.num_tokens, decode.start + 1)
    tables = {c.request_id: r.block_table for c, r in zip(batch.chunks, rows, strict=True)}
    width = max(len(t) for t in tables.values())
    assert meta.block_table.dtype == torch.int32
    assert meta.block_table.tolist() == [
        t + [0] * (width - len(t)) for t in (tables[prefill.request_id],
                                             tables[decode.request_id])]
    # the new tokens' slots, prefill rows first
    table = tables[prefill.request_id]
    first = [table[p // 16] * 16 + p % 16 for p in range(prefill.start, prefill.start + 3)]
    assert meta.slot_mapping[:3].tolist() == first
