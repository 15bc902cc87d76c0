"""The CPU attention kernels (engine/kernels/paged_attention.cpp) against plain attention and the
torch path's."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.config import EngineConfig
from engine.core.model_runner import ModelRunner
from engine.errors import EngineError
from engine.kernels import cpu_kernels as kernel
from engine.kernels.attention import DecodeGroup, PagedAttention, PrefillSpan, TorchMetadata


def reference(q, k_cache, v_cache, tables, lengths, scale, window, softcap):
    """Plain attention over each request's keys, gathered one by one."""
    kv_heads, _, block_size, _ = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q, dtype=torch.float32)
    for b, length in enumerate(lengths.tolist()):
        first = max(0, length - window) if window else 0
        pos = torch.arange(first, length)
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        keys = k_cache.flatten(1, 2)[:, slots].float()  # [Hkv, S, D]
        values = v_cache.flatten(1, 2)[:, slots].float()
        for h in range(q.shape[1]):
            scores = keys[h // group] @ q[b, h].float() * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[b, h] = torch.softmax(scores, -1) @ values[h // group]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# head sizes 64 and 128 are compiled apart; the values are walked two query heads at a time
# (groups 3 and 5 leave one head alone)
@pytest.mark.parametrize(("group", "window", "softcap", "head_dim"),
                         [(1, None, None, 32), (2, None, None, 32), (4, 5, None, 32),
                          (2, None, 30.0, 32), (3, None, None, 64), (5, 7, None, 128),
                          (1, None, None, 64)])
def test_kernel_matches_plain_attention(dtype, group, window, softcap, head_dim) -> None:
    torch.manual_seed(0)
    kv_heads, blocks, block_size = 2, 48, 4
    k_cache = torch.randn(kv_heads, blocks, block_size, head_dim).to(dtype)
    v_cache = torch.randn(kv_heads, blocks, block_size, head_dim).to(dtype)
    lengths = torch.tensor([1, 4, 5, 17, 33], dtype=torch.int64)  # block edges and inside
    width = 9
    tables = torch.zeros(len(lengths), width, dtype=torch.int64)
    order = torch.randperm(blocks)
    for b, length in enumerate(lengths.tolist()):
        used = -(-length // block_size)
        tables[b, :used] = order[b * width:b * width + used]
    q = torch.randn(len(lengths), kv_heads * group, head_dim).to(dtype)
    scale = head_dim ** -0.5
    got = kernel.paged_decode(q, k_cache, v_cache, tables, lengths, scale, window, softcap)
    want = reference(q, k_cache, v_cache, tables, lengths, scale, window, softcap)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_decode_kernel_reads_q_in_place_from_the_fused_projection_and_fills_out() -> None:
    """q as the layer hands it over (a slice of the q/k/v projection, rows wider than q) is
    read where it lies, and `out` (a slice of the step's output) is written, not copied."""
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(2, 2, 12, 4, 16)
    tables = torch.tensor([[3, 7, 1], [0, 5, 9]])
    lengths = torch.tensor([11, 6])
    qkv = torch.randn(2, 4 + 2 * 2, 16)  # four query heads, then keys and values
    q = qkv[:, :4]
    assert not q.is_contiguous()
    step = torch.full((3, 4, 16), 7.0)
    out = kernel.paged_decode(q, k_cache, v_cache, tables, lengths, 0.25, None, None,
                              out=step[1:])
    assert out.data_ptr() == step[1:].data_ptr()
    torch.testing.assert_close(step[1:], reference(q.contiguous(), k_cache, v_cache, tables,
                                                   lengths, 0.25, None, None))
    assert (step[0] == 7.0).all()
    with pytest.raises(ValueError, match="contiguous and shaped like q"):
        kernel.paged_decode(q, k_cache, v_cache, tables, lengths, 0.25, None, None,
                            out=step[:2, :, :8])


def prefill_reference(q, k_cache, v_cache, table, start, scale, window, softcap):
    """Row i of a chunk attends as a decode at position start + i over the same blocks."""
    lengths = start + 1 + torch.arange(q.shape[0])
    return reference(q, k_cache, v_cache, table.expand(q.shape[0], -1), lengths, scale, window,
                     softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("head_dim", "group", "start", "chunk", "window", "softcap", "block_size"), [
        (64, 2, 0, 37, None, None, 16),  # a fresh prompt: causal, a part-filled row block
        (16, 1, 13, 9, None, None, 16),  # history ending inside a block; one-vector heads
        (48, 4, 40, 70, 24, None, 16),  # windowed: early keys drop out row by row
        (32, 2, 5, 20, None, 30.0, 16),  # Gemma 2's soft-capped scores
        (64, 2, 1100, 30, None, None, 16),  # a long history: many softmax tiles
        (128, 2, 300, 140, 200, None, 32),  # a window across tiles, two tiles per block
        (64, 2, 21, 30, None, None, 4),  # blocks smaller than a tile: rows gathered, padded
    ])
def test_prefill_kernel_matches_plain_attention(dtype, head_dim, group, start, chunk, window,
                                                softcap, block_size) -> None:
    torch.manual_seed(3)
    kv_heads = 2
    blocks = -(-(start + chunk) // block_size) + 3
    k_cache = torch.randn(kv_heads, blocks, block_size, head_dim).to(dtype)
    v_cache = torch.randn(kv_heads, blocks, block_size, head_dim).to(dtype)
    table = torch.randperm(blocks)[:blocks - 3]  # scattered blocks, as the pool hands out
    q = torch.randn(chunk, kv_heads * group, head_dim).to(dtype)
    scale = head_dim ** -0.5
    got = kernel.paged_prefill(q, k_cache, v_cache, table, start, scale, window, softcap)
    want = prefill_reference(q, k_cache, v_cache, table, start, scale, window, softcap)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_prefill_kernel_refuses_what_its_tiles_cannot_take() -> None:
    cache = torch.zeros(1, 2, 4, 24)
    q = torch.zeros(3, 1, 24)
    table = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="steps of 16"):
        kernel.paged_prefill(q, cache, cache, table, 0, 1.0, None, None)
    cache = torch.zeros(1, 2, 4, 32)
    with pytest.raises(ValueError, match="holds 8 keys, not 9"):
        kernel.paged_prefill(torch.zeros(3, 1, 32), cache, cache, table, 6, 1.0, None, None)
    assert not kernel.prefill_supports(24) and kernel.prefill_supports(128)
    assert not kernel.prefill_supports(272)


def test_kernel_rejects_mixed_dtypes() -> None:
    cache = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel.paged_decode(torch.zeros(1, 1, 8, dtype=torch.bfloat16), cache, cache,
                            torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
                            1.0, None, None)


def test_the_kernel_path_and_the_torch_path_are_taken_when_asked() -> None:
    paged = ModelRunner(EngineConfig(device="cpu", attention_backend="paged", cpu_graphs=True))
    torch_path = ModelRunner(EngineConfig(device="cpu", attention_backend="torch"))
    assert paged.backend.paged_decode and paged.backend.paged_prefill
    assert paged.graphs is not None
    assert paged.attention_note == ("CPU backends (forced): decode paged/kernels/graphs, "
                                    "prefill paged")
    assert not torch_path.backend.paged_decode and not torch_path.backend.paged_prefill
    assert torch_path.attention_note == "torch"


def test_without_a_compiler_auto_keeps_the_torch_path_and_paged_says_why(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    kernel.load.cache_clear()
    try:
        runner = ModelRunner(EngineConfig(device="cpu"))
        assert not runner.backend.paged_decode and not runner.backend.paged_prefill
        assert "no C++ compiler" in runner.attention_note
        with pytest.raises(EngineError, match="attention_backend=torch"):
            ModelRunner(dataclasses.replace(EngineConfig(device="cpu"),
                                            attention_backend="paged"))
    finally:
        kernel.load.cache_clear()


def test_paged_attention_layer_runs_prefill_chunks_through_the_kernel() -> None:
    """A step of two prefill chunks (one with history) gives the same rows whether the
    spans carry block tables (the kernel) or slots and masks (SDPA)."""
    torch.manual_seed(4)
    layer = PagedAttention(num_heads=4, num_kv_heads=2, head_dim=16)
    k_cache, v_cache = torch.randn(2, 2, 8, 16, 16).unbind(0)
    q, k, v = torch.randn(30, 4, 16), torch.randn(30, 2, 16), torch.randn(30, 2, 16)
    first, second = torch.tensor([6, 2]), torch.tensor([1, 4, 7])
    # chunk 1: a fresh 12-token prompt; chunk 2: tokens 20..37 of a request with history
    slots = torch.cat([first[torch.arange(12) // 16] * 16 + torch.arange(12),
                       second[torch.arange(20, 38) // 16] * 16 + torch.arange(20, 38) % 16])
    kernel_spans = (PrefillSpan(0, 12, None, block_table=first, start=0),
                    PrefillSpan(12, 18, None, block_table=second, start=20))
    keys = torch.arange(38)
    torch_spans = (PrefillSpan(0, 12, slots[:12]),
                   PrefillSpan(12, 18, second[keys // 16] * 16 + keys % 16, start=20))
    metas = [TorchMetadata(slot_mapping=slots, prefills=spans, decode_start=30,
                               decode_groups=()) for spans in (kernel_spans, torch_spans)]
    got, want = (layer(q, k, v, k_cache.clone(), v_cache.clone(), meta) for meta in metas)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_paged_attention_layer_uses_the_decode_tables() -> None:
    """A decode-only step through PagedAttention gives the same rows on both backends."""
    torch.manual_seed(1)
    layer = PagedAttention(num_heads=4, num_kv_heads=2, head_dim=16)
    kernel.load()
    k_cache = torch.randn(2, 8, 16, 16)
    v_cache = torch.randn(2, 8, 16, 16)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    tables = torch.tensor([[3, 5], [1, 0]], dtype=torch.int64)
    lengths = torch.tensor([20, 9], dtype=torch.int64)
    slots = torch.tensor([5 * 16 + 3, 1 * 16 + 8], dtype=torch.int64)
    paged_meta = TorchMetadata(slot_mapping=slots, prefills=(), decode_start=0,
                                   decode_groups=(), decode_tables=tables,
                                   decode_lengths=lengths)
    bias = torch.zeros(1, 2, 1, 32)
    bias[0, 0, 0, 20:] = float("-inf")
    bias[0, 1, 0, 9:] = float("-inf")
    torch_meta = TorchMetadata(slot_mapping=slots, prefills=(), decode_start=0,
                                   decode_groups=(DecodeGroup(0, 2, tables, bias),))
    got = layer(q, k, v, k_cache.clone(), v_cache.clone(), paged_meta)
    want = layer(q, k, v, k_cache.clone(), v_cache.clone(), torch_meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_kernel_splits_requests_across_threads_alike() -> None:
    torch.manual_seed(2)
    k_cache, v_cache = torch.randn(2, 2, 64, 8, 64).unbind(0)
    tables = torch.randperm(64).view(4, 16)
    lengths = torch.tensor([128, 1, 77, 100], dtype=torch.int64)
    q = torch.randn(4, 4, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.paged_decode(q, k_cache, v_cache, tables, lengths, 0.125, None, None)
        torch.set_num_threads(2)
        two = kernel.paged_decode(q, k_cache, v_cache, tables, lengths, 0.125, None, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.manual_seed(5)
    q = torch.randn(50, 4, 64)
    try:  # prefill: KV heads and row blocks split across threads, each row computed alike
        torch.set_num_threads(1)
        one = kernel.paged_prefill(q, k_cache, v_cache, tables[0], 70, 0.125, None, None)
        torch.set_num_threads(2)
        two = kernel.paged_prefill(q, k_cache, v_cache, tables[0], 70, 0.125, None, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_loading_the_kernel_leaves_subnormal_floats_alone() -> None:
    """Linked with -ffast-math, the library would set flush-to-zero for the whole process."""
    kernel.load()
    tiny = math.ulp(0.0)
    assert tiny * 2 > 0
    assert torch.tensor([tiny], dtype=torch.float64).mul(2).item() > 0
    assert torch.tensor([1e-40], dtype=torch.float32).mul(1).item() > 0
