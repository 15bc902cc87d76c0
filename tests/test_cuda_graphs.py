"""Whole-model decode graphs at padded batch sizes, run on the CPU with a stand-in for the
GPU's graph capture (a replay re-runs the captured function on the static buffers, as a
CUDA graph replays its kernels on them): the same greedy tokens as transformers, padding that
touches no request's KV, one capture per size, on the thread that steps."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.core.cuda_graphs import CudaGraphs, capture_sizes
from tests.hf_models import hf_greedy, save_tiny

MAX_NEW = 8


class ReplayDouble:
    """Captures by running once into an output tensor; replays by running again into it."""

    def __init__(self) -> None:
        self.captured: list[tuple[int, threading.Thread]] = []
        self.replays = 0
        self.pools: list[object] = []  # the pool each capture was given
        self.pools_made = 0

    def new_pool(self) -> object:
        self.pools_made += 1
        return object()

    def __call__(self, run: Callable[[], torch.Tensor], pool: object
                 ) -> tuple[Callable[[], None], torch.Tensor]:
        out = run().clone()
        self.captured.append((out.shape[0], threading.current_thread()))
        self.pools.append(pool)

        def replay() -> None:
            self.replays += 1
            out.copy_(run())

        return replay, out


def _graphed(directory: Path, budget: int, sizes: tuple[int, ...]) -> tuple[Engine, ReplayDouble]:
    engine = Engine(EngineConfig(model=str(directory), device="cpu", dtype="float32",
                                 max_num_batched_tokens=budget, chunk_tile=1,
                                 attention_backend="torch", kv_cache_bytes=1 << 22))
    runner = engine.runner
    double = ReplayDouble()
    runner.cuda_graphs = CudaGraphs(
        runner.model, runner.kv_cache, device=runner.device, backend=runner.backend,
        max_model_len=runner.max_model_len, pad_block=runner.num_blocks, sizes=sizes,
        capture=double, new_pool=double.new_pool)
    return engine, double


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_graphed_decodes_are_exact_with_padding(tmp_path: Path, kind: str) -> None:
    """Five requests decode in graphs of 1, 2, 4 and 8 rows as they finish at different
    lengths (padding 3 rows at first); windows and soft-caps inside the graph."""
    directory = save_tiny(kind, tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(400) for _ in range(n)] for n in (3, 20, 9, 40, 1)]
    expected = hf_greedy(directory, prompts, MAX_NEW)
    engine, double = _graphed(directory, 64, (1, 2, 4, 8))
    # different lengths: the batch shrinks as they end
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_NEW - i, ignore_eos=True))
           for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[rid] for rid in ids] == [e[:MAX_NEW - i] for i, e in enumerate(expected)]
    sizes = [size for size, _ in double.captured]
    assert sorted(sizes) == sorted(set(sizes))  # each size captured once
    assert 8 in sizes and double.replays > len(sizes)
    assert {thread for _, thread in double.captured} == {threading.current_thread()}
    # every size shares one memory pool, made once
    assert double.pools_made == 1 and len({id(pool) for pool in double.pools}) == 1


def test_a_live_budget_change_needs_no_recapture(tmp_path: Path) -> None:
    directory = save_tiny("llama", tmp_path)
    engine, double = _graphed(directory, 16, (1, 2, 4))
    prompts = [[5 + i, 9, 11 + i] for i in range(4)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    reference = Engine(EngineConfig(model=str(directory), device="cpu", dtype="float32",
                                    kv_cache_bytes=1 << 22)).generate(prompts, params)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    while engine.has_unfinished():
        if steps == 4:
            captured = len(double.captured)
            engine.update_config(max_num_batched_tokens=64)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
    assert [tokens[rid] for rid in ids] == reference
    assert len(double.captured) == captured == 1  # the size of 4 decodes, before and after


def test_capture_sizes_follow_vllm_and_bound_the_gather() -> None:
    assert capture_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert capture_sizes(1000)[-1] == 256
    # SDPA in a graph gathers whole tables: 64 MiB a row leaves room for 16 rows in 1 GiB
    assert capture_sizes(256, gather_bytes_per_row=64 << 20) == (1, 2, 4, 8, 16)


def test_a_step_uploads_tables_as_wide_as_its_longest_row(tmp_path: Path) -> None:
    """Not max_model_len's width (at 128k and blocks of 16, 16 MB a step at 256 rows): the
    longest row's, to a power of two; the static columns past it are masked off by length."""
    engine, _ = _graphed(save_tiny("llama", tmp_path), 64, (1, 2, 4))
    graphs = engine.runner.cuda_graphs
    bs = graphs.block_size

    class Row:
        def __init__(self, blocks: int) -> None:
            self.token_ids = [7] * (blocks * bs)
            self.block_table = list(range(10, 10 + blocks))

    def decode(position: int) -> object:
        return type("Chunk", (), {"start": position})()

    inputs = graphs.host_inputs([decode(5 * bs), decode(2)], [Row(6), Row(1)])
    assert inputs.tables.shape == (2, 8) and graphs.width > 8
    assert inputs.tables[0, :6].tolist() == list(range(10, 16))
    assert inputs.tables[1].tolist() == [10] + [graphs.pad_block] * 7
