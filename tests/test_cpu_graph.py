"""CPU graphs (engine/kernels/cpu_graph.py): decode steps replayed from their recorded kernel calls
compute what eager steps compute; a step that needs a torch op stays eager and says why."""

from __future__ import annotations

import argparse
import threading

import pytest
import torch

from console.cli.engine_flags import add_engine_flags, engine_config
from engine import Engine, EngineConfig, SamplingParams
from engine.harness.driver import OutputTokens
from engine.kernels import cpu_graph, cpu_kernels
from engine.kernels.cpu_graph import Arena, CpuGraph, DecodeGraphs, NotGraphable
from tests.hf_models import save_tiny

# lengths that end prefill at different steps and finish at different ones, so decode batches
# shrink and grow; blocks of 4 tokens, so each request's block table widens as it decodes
PROMPTS = [[(7 * i + 3 * j) % 300 + 1 for j in range(n)] for i, n in enumerate((3, 9, 17, 30))]
MAX_TOKENS = (20, 9, 14, 25)


def _generate(model: str, graphs: bool, params: SamplingParams | None = None,
              ) -> tuple[Engine, list[list[int]]]:
    engine = Engine(EngineConfig(model=model, device="cpu", dtype="float32", block_size=4,
                                 max_num_batched_tokens=16, attention_backend="paged",
                                 cpu_graphs=graphs))
    ids = [engine.add_request(prompt, params or SamplingParams(max_tokens=n, ignore_eos=True))
           for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    done: dict[str, list[int]] = {}
    tokens = OutputTokens()
    while len(done) < len(ids):
        for out in engine.step():
            held = tokens.add(out)
            if out.finished:
                done[out.request_id] = held
    return engine, [done[i] for i in ids]


@pytest.mark.slow  # an eager and a graphed engine side by side
def test_decode_steps_replay_what_eager_steps_compute(monkeypatch) -> None:
    replays = []
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self, values: replays.append(
        len(values)) or replay(self, values))
    engine, tokens = _generate("synthetic:tiny", graphs=True)
    _, eager = _generate("synthetic:tiny", graphs=False)
    assert tokens == eager
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.refused is None
    assert {rows for rows, _ in graphs.graphs} == {1, 2}  # one capture per batch size
    assert len(replays) > 2 * len(graphs.graphs)
    # sampled, not greedy: the tokens follow every bit of the logits
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    assert _generate("synthetic:tiny", True, sampled)[1] == _generate("synthetic:tiny", False,
                                                                     sampled)[1]


def test_a_model_whose_step_computes_in_torch_stays_eager_and_says_why(tmp_path) -> None:
    """Qwen3 norms q and k per head in torch (a concatenation): its steps cannot replay."""
    model = str(save_tiny("qwen3", tmp_path / "qwen3"))
    engine, tokens = _generate(model, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.graphs
    assert graphs.refused is not None and "aten." in graphs.refused
    assert tokens == _generate(model, graphs=False)[1]


def test_the_arena_grows_and_the_graphs_are_captured_again(monkeypatch) -> None:
    monkeypatch.setattr(cpu_graph, "ARENA_START_BYTES", 4096)
    engine, tokens = _generate("synthetic:tiny", graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.arena.buffer.numel() > 4096 and graphs.graphs
    assert tokens == _generate("synthetic:tiny", graphs=False)[1]


def test_graphs_are_off_where_asked_and_for_bfloat16() -> None:
    for config in (EngineConfig(model="synthetic:tiny", device="cpu", cpu_graphs=False),
                   EngineConfig(model="synthetic:tiny", device="cpu", dtype="bfloat16")):
        assert Engine(config).runner.graphs is None


def test_a_capture_refuses_torch_ops_that_compute_and_allows_views() -> None:
    arena = Arena(1 << 16)
    x = torch.randn(4, 16)
    weight = torch.ones(16)

    def kernels_and_views() -> torch.Tensor:
        return cpu_kernels.rms_norm(x.view(2, 2, 16)[1].contiguous(), weight, 1e-6, 0.0)

    graph = CpuGraph(kernels_and_views, [x], arena)
    assert len(graph.calls) == 1
    first = graph.output.clone()
    doubled = x * 2
    want = cpu_kernels.rms_norm(doubled[2:], weight, 1e-6, 0.0)
    assert torch.equal(graph.replay([doubled]), want)  # new inputs, the same memory
    assert not torch.equal(graph.output, first)
    with pytest.raises(NotGraphable, match=r"aten\.mul"):
        CpuGraph(lambda: x * 2, [x], arena)
    with pytest.raises(NotGraphable, match="writes a tensor"):
        CpuGraph(lambda: x.add_(1), [x], arena)


def test_recordings_do_not_nest() -> None:
    with (cpu_kernels.recording(), pytest.raises(RuntimeError, match="already"),
          cpu_kernels.recording()):
        pass


def test_a_recording_sees_only_its_own_thread() -> None:
    x, weight = torch.randn(2, 16), torch.ones(16)
    with cpu_kernels.recording() as calls:
        other = threading.Thread(target=cpu_kernels.rms_norm, args=(x, weight, 1e-6, 0.0))
        other.start()
        other.join()
        cpu_kernels.rms_norm(x, weight, 1e-6, 0.0)
    assert len(calls) == 1


def test_a_graph_is_captured_at_the_first_decode_step_of_its_size() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                                 cpu_graphs=True))
    graphs = engine.runner.graphs
    assert isinstance(graphs, DecodeGraphs)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the prefill: not a decode step
    assert not graphs.graphs
    engine.step()
    assert list(graphs.graphs) == [(1, torch.get_num_threads())]


def test_the_flags_force_graphs_on_or_off_and_measurement_decides_without_them() -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args([])).cpu_graphs is None
    assert engine_config(parser.parse_args(["--cpu-graphs"])).cpu_graphs is True
    assert engine_config(parser.parse_args(["--no-cpu-graphs"])).cpu_graphs is False
