"""Each attention path's object: its KV layout names its block axis, and the metadata it
builds for a CUDA graph's decodes is a type a layer runs."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.attention import FlashMetadata, TorchMetadata
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
