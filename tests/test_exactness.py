"""Chunked prefill is exact on every family we serve: greedy tokens equal transformers' for
any token budget, with prompts that cross the sliding windows and budgets that cut chunks at
odd positions, and the logits of a chunked prefill match one full prefill within 1e-4 (fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, EngineConfig, SamplingParams
from engine.core import model_runner
from engine.core.backend_choice import PAGED, TORCH, Backends, candidates
from engine.core.model_runner import compiles
from engine.harness.driver import OutputTokens
from engine.kernels import attention, backends
from engine.kernels.cpu_kernels import prefill_supports
from engine.kernels.layers import PackedLinear
from engine.model.transformer import RECOMPILE_LIMIT
from tests.hf_models import FAMILIES, hf_greedy, hf_last_logits, save_tiny
from tests.prompt_logits import prompt_logits

# windows are 8-16 tokens: most prompts cross them, several times
LENGTHS = [1, 2, 17, 64, 100, 150, 233, 300, 5]
MAX_NEW = 6


# the inner loop checks llama; every family runs in the whole suite
@pytest.fixture(scope="module", params=[family if family == "llama" else
                                        pytest.param(family, marks=pytest.mark.slow)
                                        for family in FAMILIES])
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory = save_tiny(request.param, tmp_path_factory.mktemp(request.param))
    rng = random.Random(7)
    prompts = [[rng.randrange(400) for _ in range(n)] for n in LENGTHS]
    return directory, prompts, hf_greedy(directory, prompts, MAX_NEW)


def _engine(directory: Path, budget: int, block_size: int = 16,
            compile: bool = False, attention: str = "auto") -> Engine:
    return Engine(EngineConfig(model=str(directory), device="cpu", dtype="float32",
                               max_num_batched_tokens=budget, chunk_tile=1,
                               block_size=block_size, compile=compile,
                               attention_backend=attention))


@pytest.mark.parametrize("budget", [7, 13, 64, 4096])
def test_greedy_tokens_equal_transformers(reference, budget: int) -> None:
    directory, prompts, expected = reference
    engine = _engine(directory, budget)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert outputs == expected
    assert engine.blocks.num_used == 0


def test_one_token_chunks_are_exact(reference) -> None:
    """A budget of 1: every prompt token is its own chunk (the prompts up to 64 tokens, which
    cross every window, keep it quick)."""
    directory, prompts, expected = reference
    short = [i for i, n in enumerate(LENGTHS) if n <= 64]
    outputs = _engine(directory, 1).generate([prompts[i] for i in short],
                                             SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert outputs == [expected[i] for i in short]


def test_windows_across_small_blocks_are_exact(reference) -> None:
    """Blocks of 4 tokens: a window starts mid-block and spans several blocks."""
    directory, prompts, expected = reference
    outputs = _engine(directory, 13, block_size=4).generate(
        prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert outputs == expected


# every decode path the backend choice can pick, each beside one of the prefill attentions
# (both are taken where the head size fits the prefill kernel), so each is held to
# transformers' tokens whatever a machine measures
DECODE_PATHS = candidates("auto", None, kernels=True, graphable=True, prefill_fits=True).decode


@pytest.mark.parametrize("index", range(len(DECODE_PATHS)),
                         ids=[path.name for path in DECODE_PATHS])
def test_every_path_the_backend_choice_can_pick_is_exact(reference, index: int) -> None:
    directory, prompts, expected = reference
    engine = _engine(directory, 24)
    fits = prefill_supports(engine.model_config.head_dim)
    engine.runner.apply(Backends(DECODE_PATHS[index], PAGED if index % 2 and fits else TORCH))
    short = [i for i, n in enumerate(LENGTHS) if n <= 150]  # past every window, quicker
    outputs = engine.generate([prompts[i] for i in short],
                              SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert outputs == [expected[i] for i in short]


# the short budgets cut the most chunks and take the longest: an eager flex step is slow on
# the CPU, so they serve the shorter prompts (the longest of each crosses every window, and a
# block, at least once; 64 tokens cross them several times), and a budget of 64 serves all
FLEX_PROMPTS = {1: 17, 7: 64, 64: max(LENGTHS)}


@pytest.mark.parametrize("budget", [pytest.param(1, marks=pytest.mark.slow),
                                    pytest.param(7, marks=pytest.mark.slow), 64])
def test_flex_attention_is_exact_at_every_chunk_position(reference, budget: int) -> None:
    """FlexAttention over the step's gathered keys: chunks cut at every position (a budget
    of 1 makes each prompt token its own chunk), beside decodes, windows and soft-caps."""
    directory, prompts, expected = reference
    engine = _engine(directory, budget, attention="flex")
    kept = [i for i, n in enumerate(LENGTHS) if n <= FLEX_PROMPTS[budget]]
    outputs = engine.generate([prompts[i] for i in kept],
                              SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert outputs == [expected[i] for i in kept]
    assert engine.runner.attention_note == "flex"


@pytest.mark.slow  # a block mask built eagerly each step: ~20 s a family on a small CPU
@pytest.mark.parametrize("reference", ["llama", "mistral", "gemma2"], indirect=True)
def test_flex_with_block_masks_is_exact(reference, monkeypatch) -> None:
    """The CUDA path's block masks (sparse tiles built on the host from the chunks' spans,
    the mask_mod inside each tile) and its soft-cap score_mod, run eagerly on the CPU; tiles
    of 16 tokens, so a step's chunks and windows span many."""
    directory, prompts, expected = reference
    monkeypatch.setattr(model_runner, "block_masked", lambda device: True)
    monkeypatch.setattr(attention, "FLEX_TILE", 16)
    monkeypatch.setattr(backends, "FLEX_TILE", 16)
    made = []
    from_tiles = attention.BlockMask.from_kv_blocks
    monkeypatch.setattr(attention.BlockMask, "from_kv_blocks", classmethod(
        lambda cls, *args, **kwargs: made.append(kwargs["BLOCK_SIZE"]) or from_tiles(
            *args, **kwargs)))
    outputs = _engine(directory, 7, attention="flex").generate(
        prompts[:4], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert outputs == expected[:4]  # up to 64 tokens: across every window
    assert made and set(made) == {16}  # the tiles, not a dense mask, chose the blocks


def test_long_chunks_attend_in_slices_exactly(reference, monkeypatch) -> None:
    """A chunk whose scores would pass SCORE_BYTES attends a few query rows at a time (here
    3 to 7 rows of a 300-token prompt), windows and soft-caps included."""
    directory, prompts, expected = reference
    monkeypatch.setattr(attention, "SCORE_BYTES", 4 * 300 * 8 * 5)
    outputs = _engine(directory, 64, attention="torch").generate(
        prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert outputs == expected


@pytest.mark.parametrize("kv_heads", [1, 4], ids=["multi-query", "multi-head"])
@pytest.mark.parametrize("attention", ["flex", "torch", "auto"])
def test_every_gqa_ratio_is_exact(tmp_path: Path, kv_heads: int, attention: str) -> None:
    """The families above share 2 query heads per KV head; 4 (one KV head) and 1 too."""
    directory = save_tiny("llama", tmp_path, kv_heads=kv_heads)
    rng = random.Random(11)
    prompts = [[rng.randrange(400) for _ in range(n)] for n in (1, 30, 90)]
    expected = hf_greedy(directory, prompts, MAX_NEW)
    for budget in (7, 4096):
        outputs = _engine(directory, budget, attention=attention).generate(
            prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        assert outputs == expected, budget


def test_chunked_prefill_logits_match_full_prefill(reference) -> None:
    """Logits, not just tokens: Gemma 2's final soft-cap never changes the argmax."""
    directory, prompts, _ = reference
    prompt = prompts[LENGTHS.index(300)]
    full = prompt_logits(_engine(directory, 4096), prompt)
    for budget in (7, 64, 100):
        chunked = prompt_logits(_engine(directory, budget), prompt)
        assert torch.allclose(chunked, full, atol=1e-4, rtol=0), budget
    assert torch.allclose(full, hf_last_logits(directory, prompt), atol=1e-4, rtol=0)


def test_mixed_batch_prefill_beside_decodes_is_exact(reference) -> None:
    """Requests arriving while others decode: chunks and decodes share steps."""
    directory, prompts, expected = reference
    engine = _engine(directory, 24)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    ids = {}
    results: dict[str, list[int]] = {}
    tokens = OutputTokens()
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:
            index, prompt = pending.pop(0)
            ids[engine.add_request(prompt, params)] = index
        for out in engine.step():
            held = tokens.add(out)
            if out.finished:
                results[out.request_id] = held
    assert [results[rid] for rid in sorted(ids, key=ids.get)] == expected


@pytest.mark.slow  # compiling takes 10-30 s on a small CPU
@pytest.mark.parametrize("reference", ["llama", "gemma2"], indirect=True)
def test_compiled_forward_is_exact(reference) -> None:
    """torch.compile'd layers (the `tokenflow` commands' default): the same greedy tokens as
    transformers with chunks beside decodes, and the same logits as the eager forward."""
    directory, prompts, expected = reference
    engine = _engine(directory, 13, compile=True)
    assert engine.runner.compile_s > 0
    # one process compiles every family here: Dynamo's limit (8 by default) is shared by all,
    # and past it a model would quietly run eager
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert outputs == expected
    prompt = prompts[LENGTHS.index(300)]
    assert torch.allclose(prompt_logits(engine, prompt),
                          prompt_logits(_engine(directory, 13), prompt), atol=1e-4, rtol=0)


def test_compile_is_on_where_asked_else_on_cuda_only() -> None:
    assert not compiles(EngineConfig(device="cpu"))
    assert compiles(EngineConfig(device="cpu", compile=True))
    assert not compiles(EngineConfig(device="auto", compile=False))
    assert compiles(EngineConfig(device="auto")) == torch.cuda.is_available()


def test_eager_cpu_steps_read_packed_weights() -> None:
    """Every GEMM of an eager CPU engine on torch's dense ops runs on oneDNN-packed weights
    (PackedLinear), which compute what F.linear does on the dense parameter; the exactness
    tests above run them. The path is forced: measurement may pick the C++ layer ops here."""
    engine = Engine(EngineConfig(model="synthetic:qwen3-small", device="cpu", dtype="float32",
                                 kv_cache_bytes=1 << 24, attention_backend="torch"))
    linears = [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * engine.model_config.num_layers + 1  # and lm_head
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for linear in linears:
            assert linear.packed is not None
            for rows in (1, 2, 3, 8, 300):  # under 4 rows are padded with zeros and cut
                x = torch.randn(rows, linear.in_features, generator=generator)
                out = linear(x)
                assert out.shape == (rows, linear.out_features)
                assert torch.allclose(out, F.linear(x, linear.weight, linear.bias),
                                      atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN has no bf16 kernels on this CPU")
def test_bfloat16_cpu_steps_read_packed_weights_too() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="bfloat16",
                                 kv_cache_bytes=1 << 24))
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for linear in (m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)):
            assert linear.packed is not None
            for rows in (1, 8, 300):
                x = torch.randn(rows, linear.in_features, generator=generator,
                                dtype=torch.bfloat16)
                reference = F.linear(x.float(), linear.weight.float(), None)
                out = linear(x)
                assert out.dtype == torch.bfloat16 and out.shape == reference.shape
                # both accumulate in float and round the result once to bfloat16
                assert torch.allclose(out.float(), reference, atol=1e-2, rtol=1e-2)
