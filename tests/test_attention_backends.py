"""Each attention path's object: its KV layout names its block axis, and the metadata it
builds for a CUDA graph's decodes is a type a layer runs."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._inductor.exc import InductorError
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from engine import Engine, EngineConfig, SamplingParams
from engine.batch import ScheduledChunk
from engine.core.model_runner import ModelRunner
from engine.kernels import backends
from engine.kernels.attention import (
    EAGER_FLEX_ON_CPU,
    FlashMetadata,
    FlexMetadata,
    TorchMetadata,
)
from engine.kernels.backends import (
    AttentionBackend,
    FlashBackend,
    FlexBackend,
    TorchBackend,
)

BACKENDS = [TorchBackend(16, None, torch.float32), FlexBackend(16, 8, torch.float32),
            FlashBackend(None)]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_the_block_axis_is_where_the_layout_puts_blocks(backend: AttentionBackend) -> None:
    shape = backend.cache_shape(num_layers=3, num_blocks=7, num_kv_heads=2, head_dim=8)
    assert shape[0] == 2 and shape[1] == 3 and shape[-1] == 8
    assert shape[backend.block_dim] == 7 and shape[backend.block_dim + 1] == backend.block_size


@pytest.mark.parametrize("backend,kind", zip(BACKENDS, (TorchMetadata, TorchMetadata,
                                                         FlashMetadata), strict=True),
                         ids=("torch", "flex", "flash"))
def test_decode_graphs_read_metadata_a_layer_can_run(backend: AttentionBackend,
                                                     kind: type) -> None:
    """A graph's decodes on flex run the gather path's metadata; the others their own."""
    slots = torch.tensor([5, 40])
    tables = torch.tensor([[0, 0], [2, 1]])
    lengths = torch.tensor([6, 25])
    meta = backend.graph_metadata(slots, tables, lengths, max_model_len=64)
    assert type(meta) is kind and meta.slot_mapping is slots


def test_flex_asked_compiled_on_the_cpu_runs_eagerly_and_says_so_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ModelRunner, "_compile", lambda self: 0.0)  # the dense halves: moot
    with caplog.at_level(logging.INFO, logger="engine.core.model_runner"):
        runner = ModelRunner(EngineConfig(model="synthetic:tiny", device="cpu",
                                          dtype="float32", kv_cache_bytes=1 << 22,
                                          attention_backend="flex", compile=True))
    assert runner.backend.name == "flex"
    assert [r.getMessage() for r in caplog.records].count(EAGER_FLEX_ON_CPU) == 1


def _packed(starts: list[int], counts: list[int]) -> FlexMetadata:
    """The flex metadata of chunks of `counts` tokens from `starts`, side by side."""
    query_seq, query_pos, key_seq, key_pos = [], [], [], []
    for seq, (start, count) in enumerate(zip(starts, counts, strict=True)):
        key_pos.append(torch.arange(start + count))
        key_seq.append(torch.full((start + count,), seq))
        query_pos.append(torch.arange(start, start + count))
        query_seq.append(torch.full((count,), seq))
    keys = torch.cat(key_pos)
    return FlexMetadata(torch.arange(0), keys, torch.cat(query_seq), torch.cat(query_pos),
                        torch.cat(key_seq), keys)


@pytest.mark.slow  # one C++ build of Inductor's flex template, about half a minute
def test_compiled_flex_on_the_cpu_still_fails_to_build_with_dynamic_shapes() -> None:
    """The torch limitation behind EAGER_FLEX_ON_CPU, on the engine's own mask: when this
    fails because the build succeeds, let block_masked compile flex on the CPU too."""
    meta = _packed([0, 30, 9], [7, 1, 1])  # a chunk beside two decodes
    rows, width = len(meta.query_seq), len(meta.key_seq)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, rows, 16), torch.randn(1, 2, width, 16), torch.randn(
        1, 2, width, 16)
    mask = create_block_mask(meta.mask_mod(None), None, None, rows, width, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=True)
    with pytest.raises(InductorError, match=r"cur_kvSplitSize[0-9]"):
        compiled(q, k, v, block_mask=mask, scale=1.0, enable_gqa=True)
    # static shapes build, but would compile afresh for every step's shape
    static = torch.compile(flex_attention, dynamic=False)
    expected = flex_attention(q, k, v, block_mask=mask, scale=1.0, enable_gqa=True)
    torch.testing.assert_close(static(q, k, v, block_mask=mask, scale=1.0, enable_gqa=True),
                               expected)


class _Held:
    def __init__(self, blocks: int) -> None:
        self.block_table = list(range(blocks))


def _chunk(start: int, count: int) -> ScheduledChunk:
    return ScheduledChunk.of("r", start, count, (), count == 1 and start > 0, True)


@pytest.mark.parametrize("window", [None, 5])
def test_flex_tiles_cover_every_visible_key_and_skip_the_rest(
        monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """The block tables flex reads on CUDA, against the dense mask they replace: every tile
    holding a visible key is listed, first; a lone chunk lists exactly those tiles."""
    monkeypatch.setattr(backends, "FLEX_TILE", 4)
    backend = FlexBackend(4, window, torch.float32, block_masks=True)

    def tiles_of(chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor]:
        pairs = [(c, _Held(-(-(c.start + c.num_tokens) // 4))) for c in chunks]
        meta = backend.metadata(pairs, torch.arange(0), 0)
        tiles = meta.windowed_tiles if window is not None else meta.tiles
        assert tiles is not None and (meta.tiles is not None)
        rows, keys = len(meta.query_seq), len(meta.key_seq)
        q, k = torch.arange(rows)[:, None], torch.arange(keys)[None]
        dense = meta.mask_mod(window)(None, None, q, k)
        padded = torch.zeros(-(-rows // 4) * 4, -(-keys // 4) * 4, dtype=torch.bool)
        padded[:rows, :keys] = dense
        needed = padded.view(padded.shape[0] // 4, 4, -1, 4).any(dim=3).any(dim=1)
        listed = torch.zeros_like(needed)
        num, indices = tiles
        for row in range(needed.shape[0]):
            listed[row, indices[0, 0, row, :num[0, 0, row]].long()] = True
        return needed, listed, num

    needed, listed, _ = tiles_of([_chunk(0, 13), _chunk(30, 1), _chunk(6, 5), _chunk(9, 1)])
    assert (listed | ~needed).all()  # every needed tile is listed
    assert listed.sum() < listed.numel()  # and others are skipped
    needed, listed, num = tiles_of([_chunk(10, 11)])
    assert torch.equal(listed, needed)
    assert num.dtype == torch.int32 and num.shape == (1, 1, needed.shape[0])


@pytest.mark.parametrize(("start", "count", "window"), [
    (0, 9, None), (0, 9, 4), (0, 3, 4), (7, 5, None), (7, 5, 3), (20, 1, 6)])
def test_a_prefill_mask_is_made_from_positions_on_the_device(start: int, count: int,
                                                              window: int | None) -> None:
    """The gather path's chunk mask, built where attention runs (never uploaded), row slice
    by row slice: query p sees key k of its history where k <= p and, windowed, k > p - w."""
    table = torch.arange(4)
    span = TorchBackend(8, window, torch.float32)._prefill_span(0, start, start + count,
                                                                table, window)
    first = 0 if window is None else max(0, start - window + 1)
    keys = torch.arange(first, start + count)[None]
    positions = torch.arange(start, start + count)[:, None]
    expected = (keys <= positions) & ((keys > positions - window) if window else True)
    whole = span.mask(0, count, torch.device("cpu"))
    square = start == 0 and (window is None or count <= window)
    assert whole is None if square else torch.equal(whole, expected)
    for low in range(count):  # any slice of rows, the square causal case included
        assert torch.equal(span.mask(low, low + 1, torch.device("cpu")), expected[low:low + 1])


def test_the_snapshot_reports_the_block_size_the_path_forced(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """flash-attn's paged KV needs blocks of 256 whatever was asked: a path with its own block
    size (here the gather path made to force 32) is what the pool, the block manager and the
    snapshot use, and the start says so once."""
    def forced(self: ModelRunner, config: EngineConfig, name: str) -> AttentionBackend:
        return TorchBackend(32, None, self.dtype)

    monkeypatch.setattr(ModelRunner, "_backend", forced)
    with caplog.at_level(logging.INFO, logger="engine.core.model_runner"):
        engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                     kv_cache_bytes=1 << 22, attention_backend="torch",
                                     block_size=16))
    assert engine.runner.block_size == engine.blocks.block_size == 32
    assert engine.snapshot().kv_block_size == 32
    assert engine.generate([[5, 6, 7] * 20], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [r.getMessage() for r in caplog.records if "KV blocks of" in r.getMessage()] == [
        "KV blocks of 32 tokens, not the 16 asked: flash-attn's paged KV needs multiples "
        "of 32"]
