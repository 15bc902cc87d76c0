"""The CPU kernels for a layer's dense ops (engine/kernels/layer_ops.cpp) against the torch ops
they replace: linear_rows against F.linear, rms_norm against the RMSNorm module, silu_mul,
rope against transformer.rotate, and cache_write against index_copy_. The exactness tests
run them inside the engine against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, EngineConfig
from engine.kernels import cpu_kernels as kernels
from engine.kernels.cpu_kernels import PANEL_MAX_ROWS
from engine.kernels.layers import (
    KernelRMSNorm,
    KernelRotate,
    KernelSiluMul,
    PackedLinear,
    PanelLinear,
)
from engine.model.transformer import RMSNorm, RotaryEmbedding, rotate

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features", [16, 100, 112, 1024])
def test_linear_rows_computes_what_f_linear_does(out_features: int, threads: int) -> None:
    """Any row count (past 8, a second pass over each panel), outputs that fill no whole
    panel or vector, with and without bias, on one thread or several."""
    weight, bias = torch.randn(out_features, 72), torch.randn(out_features)
    panels = kernels.pack_panels(weight)
    lanes = kernels.load().lanes  # 16 with AVX-512, 8 on an AVX2 build
    assert panels.numel() == 72 * -(-out_features // lanes) * lanes
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3, 8, 9, 20):
            x = torch.randn(rows, 72)
            for b in (None, bias):
                got = kernels.linear_rows(x, panels, out_features, b)
                assert torch.allclose(got, F.linear(x, weight, b), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(previous)


def test_linear_rows_refuses_what_it_does_not_compute() -> None:
    panels = kernels.pack_panels(torch.randn(32, 16))
    with pytest.raises(ValueError, match="float32 rows of 16"):
        kernels.linear_rows(torch.randn(2, 8), panels, 32, None)
    with pytest.raises(ValueError, match="float32 rows of 16"):
        kernels.linear_rows(torch.randn(2, 16, dtype=torch.bfloat16), panels, 32, None)


def test_the_kernels_are_torch_operators_the_profiler_sees() -> None:
    x, weight = torch.randn(2, 16), torch.ones(16)
    with torch.profiler.profile() as profile:
        kernels.rms_norm(x, weight, 1e-6, 0.0)
    assert "tokenflow::rms_norm" in {event.key for event in profile.key_averages()}


def test_a_panel_linear_computes_what_f_linear_does_at_any_row_count(monkeypatch) -> None:
    """linear_rows up to PANEL_MAX_ROWS rows, oneDNN's packed GEMM past it."""
    plain = torch.nn.Linear(64, 96)
    linear = PanelLinear(PackedLinear(plain))
    assert linear.weight is plain.weight and linear.bias is plain.bias
    calls = []
    rows_kernel = kernels.linear_rows
    monkeypatch.setattr(kernels, "linear_rows", lambda *a: calls.append(1) or rows_kernel(*a))
    for rows in (1, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1, 200):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            assert torch.allclose(linear(x), F.linear(x, plain.weight, plain.bias),
                                  atol=1e-4, rtol=1e-5)
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_the_module_and_adds_the_residual_in_place(
        dtype: torch.dtype, offset: float) -> None:
    norm = RMSNorm(96, 1e-6, offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x, delta = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    with torch.inference_mode():
        assert torch.allclose(kernels.rms_norm(x, norm.weight, 1e-6, offset), norm(x),
                              **TOLERANCE[dtype])
        expected_sum = x + delta
        expected = norm(expected_sum)
        residual = x.clone()
        got = kernels.rms_norm(delta, norm.weight, 1e-6, offset, residual=residual)
    assert torch.equal(residual, expected_sum)  # the add rounds as torch's does
    assert torch.allclose(got, expected, **TOLERANCE[dtype])
    with pytest.raises(ValueError, match="contiguous and shaped like x"):
        kernels.rms_norm(delta, norm.weight, 1e-6, offset, residual=residual[:, :48])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    gate_up = torch.randn(6, 2 * 40, dtype=dtype) * 4
    gate, up = gate_up.split(40, dim=-1)
    assert torch.allclose(kernels.silu_mul(gate_up), F.silu(gate) * up, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_a_slice_of_the_projection_in_place(dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(32, 10000.0, None, 256)
    positions = torch.tensor([0, 5, 130, 255])
    rotation = rope.at(positions, dtype)
    qkv = torch.randn(4, (3 + 2) * 32 + 7, dtype=dtype)  # a row longer than its heads
    qk = qkv[:, :4 * 32].view(4, 4, 32)  # 3 query heads and a key head; the rest untouched
    expected, untouched = rotate(qk, rotation), qkv[:, 4 * 32:].clone()
    got = kernels.rope(qk, rotation)
    assert got.data_ptr() == qk.data_ptr()
    assert torch.allclose(got, expected, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, 4 * 32:], untouched)
    with pytest.raises(ValueError, match="heads are contiguous"):
        kernels.rope(torch.randn(4, 32, 4, dtype=dtype).transpose(1, 2), rotation)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_puts_rows_where_index_copy_does(dtype: torch.dtype) -> None:
    kv_heads, blocks, block_size, head_dim = 2, 5, 4, 16
    qkv = torch.randn(3, (4 + 2 * kv_heads) * head_dim, dtype=dtype)
    k = qkv[:, 4 * head_dim:6 * head_dim].view(3, kv_heads, head_dim)
    v = qkv[:, 6 * head_dim:].view(3, kv_heads, head_dim)
    slots = torch.tensor([17, 2, 9])
    k_cache = torch.zeros(kv_heads, blocks, block_size, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(kv_heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1))
    expected_v.view(kv_heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1))
    kernels.cache_write(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    with pytest.raises(ValueError, match="a slot per row"):
        kernels.cache_write(k, v, k_cache, v_cache, slots[:2])


def test_an_engine_on_the_cpu_kernels_runs_every_dense_op_there() -> None:
    """The kernel path swaps each module; attention_backend=torch keeps the torch ops on
    packed weights, and both generate the same tokens."""
    def engine(backend: str) -> Engine:
        return Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                   kv_cache_bytes=1 << 24, attention_backend=backend))

    fast, plain = engine("paged"), engine("torch")
    kinds = {type(m) for m in fast.runner.model.modules()}
    assert {KernelRMSNorm, KernelRotate, KernelSiluMul, PanelLinear} <= kinds
    assert not kinds & {RMSNorm, torch.nn.Linear, PackedLinear}
    kinds = {type(m) for m in plain.runner.model.modules()}
    assert PackedLinear in kinds and not kinds & {KernelRMSNorm, PanelLinear, torch.nn.Linear}
    bf16 = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="bfloat16",
                               kv_cache_bytes=1 << 24, attention_backend="paged"))
    kinds = {type(m) for m in bf16.runner.model.modules()}
    assert KernelRMSNorm in kinds and PanelLinear not in kinds  # linear_rows is fp32 only
    prompts = [[3 + i for i in range(n)] for n in (1, 9, 40)]
    assert fast.generate(prompts) == plain.generate(prompts)
