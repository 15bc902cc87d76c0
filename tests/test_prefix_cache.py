"""Prefix caching through the stack: exact tokens with and without it on the
multi-turn profile under forced preemption, compaction of shared blocks, the live switch, the
metrics, and the multi-turn workload and conversation files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, EngineConfig, SamplingParams
from engine.harness.conversations import ConversationError
from engine.harness.driver import OutputTokens, RunResult, drive
from engine.harness.workload import build_workload
from engine.serve.prometheus import render_metrics

BLOCK_TOKENS_BYTES = 2 * 2 * 2 * 16 * 4  # synthetic:tiny fp32: K and V, 2 layers, 2 heads x 16


def _engine(caching: bool, blocks: int = 32, **changes: object) -> Engine:
    return Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                               kv_cache_bytes=blocks * 16 * BLOCK_TOKENS_BYTES,
                               max_num_batched_tokens=64, enable_prefix_caching=caching,
                               **changes))


def _multiturn(engine: Engine, conversations: int) -> RunResult:
    # every conversation at once and think times squeezed to nothing: the pool overflows
    workload = build_workload("multiturn", vocab_size=engine.model_config.vocab_size,
                              max_model_len=engine.max_model_len, num_requests=conversations,
                              rate=float("inf"), time_scale=1e-6)
    return drive(engine, workload)


def test_greedy_tokens_equal_without_caching_under_preemption() -> None:
    cached, plain = _engine(True), _engine(False)
    with_cache, without = _multiturn(cached, 6), _multiturn(plain, 6)
    tokens = {rid: r.token_ids for rid, r in with_cache.records.items()}
    assert tokens == {rid: r.token_ids for rid, r in without.records.items()}
    assert all(r.state == "FINISHED" for r in with_cache.records.values())
    assert with_cache.preemptions > 0  # the 32-block pool cannot hold six conversations
    summary, baseline = with_cache.summary(), without.summary()
    assert summary["hit_rate"] > 0.5
    assert summary["prefill_tokens_computed"] < 0.5 * baseline["prefill_tokens_computed"]
    assert baseline["prefix_cache_queries"] == 0 and baseline["hit_rate"] is None
    # a later turn found its history cached
    assert with_cache.records["c0000-t3"].cached_tokens > 0
    for engine in (cached, plain):
        engine.blocks.check_consistent([])
        assert engine.blocks.num_used == 0


def test_compaction_moves_shared_blocks_once_and_tokens_stay_exact() -> None:
    system = list(range(3, 40))
    prompts = [system + [50 + i] * (5 + i) for i in range(4)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = _engine(False).generate(prompts, params)
    engine = _engine(True, chunk_tile=1)
    engine.generate([[*system, 9]], SamplingParams(max_tokens=1))  # caches the system prompt
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = OutputTokens()
    for _ in range(3):
        for out in engine.step():
            tokens.add(out)
    live = list(engine.scheduler.requests.values())
    shared = {b for r in live for b in r.block_table if engine.blocks._ref_counts.get(b, 0) > 1}
    assert shared  # the system prompt's blocks are held by every request
    engine.blocks.compact(live, engine.runner.move_blocks)
    engine.blocks.check_consistent(live)
    assert sorted({b for r in live for b in r.block_table}) == list(
        range(engine.blocks.num_used))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            held = tokens.add(out)
            if out.finished:
                outputs[out.request_id] = held
    assert [outputs[i] for i in ids] == expected


def test_turning_caching_off_live_stops_hits() -> None:
    engine = _engine(True)
    prompt = list(range(3, 60))
    engine.generate([prompt], SamplingParams(max_tokens=2))
    engine.generate([prompt], SamplingParams(max_tokens=2))
    hits = engine.metrics.prefix_cache_hits_total
    assert hits == 48  # three full blocks of 16; the block of the last token is computed
    engine.update_config(enable_prefix_caching=False)
    engine.generate([prompt], SamplingParams(max_tokens=2))
    assert engine.metrics.prefix_cache_hits_total == hits
    assert engine.blocks.num_cached == 0
    snapshot = engine.snapshot()
    assert snapshot.prefix_cache_hits_total == hits
    assert snapshot.prefix_cache_hit_rate == pytest.approx(48 / (57 + 57))
    views = {v.id: v for v in snapshot.requests}
    assert sorted(v.cached_tokens for v in views.values()) == [0, 0, 48]


def test_metrics_use_vllm_names_in_tokens() -> None:
    engine = _engine(True)
    prompt = list(range(3, 40))
    engine.generate([prompt, prompt[:20]], SamplingParams(max_tokens=2))
    engine.generate([prompt], SamplingParams(max_tokens=2))
    families = {f.name: f for f in text_string_to_metric_families(
        render_metrics(engine, engine.snapshot()))}
    queries = families["tokenflow_prefix_cache_queries"]
    hits = families["tokenflow_prefix_cache_hits"]
    assert queries.type == hits.type == "counter"
    assert queries.samples[0].value == 37 + 20 + 37
    assert hits.samples[0].value == 32


def test_multiturn_turns_resend_their_history() -> None:
    workload = build_workload("multiturn", vocab_size=320, max_model_len=2048,
                              num_requests=3, seed=1)
    by_id = {w.request_id: w for w in workload}
    assert len(workload) == 3 * 4
    first, second = by_id["c0001-t0"], by_id["c0001-t1"]
    assert second.follows == first.request_id
    assert second.history_tokens == len(first.prompt_token_ids) + first.max_tokens
    assert second.prompt_token_ids[:len(first.prompt_token_ids)] == first.prompt_token_ids
    # one system prompt for every conversation
    starts = {w.prompt_token_ids[:150] for w in workload}
    assert len(starts) == 1


def test_conversation_file_replays_and_bad_lines_are_named(tmp_path: Path) -> None:
    good = tmp_path / "chats.jsonl"
    good.write_text(json.dumps({"id": "a", "system": "be brief", "turns": [
        {"user": "hello", "max_tokens": 3}, {"user_token_ids": [5, 6], "max_tokens": 2,
                                             "think_s": 1.0}]}) + "\n")
    engine = _engine(True)
    workload = build_workload(f"conversations:{good}", vocab_size=320, max_model_len=2048,
                              encode=engine.tokenizer.encode, time_scale=1e-6)
    assert [w.request_id for w in workload] == ["a-t0", "a-t1"]
    result = drive(engine, workload)
    assert all(r.state == "FINISHED" for r in result.records.values())
    second = result.records["a-t1"]
    first = result.records["a-t0"]
    # the second turn's history is the first turn's prompt and its actual reply
    assert second.prompt_token_ids[:len(first.prompt_token_ids) + 3] == (
        first.prompt_token_ids + tuple(first.token_ids))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "turns": [{"user": "hi", "max_tokens": 0}]}) + "\n")
    with pytest.raises(ConversationError, match=r"bad.jsonl:1: field 'turns\[0\].max_tokens'"):
        build_workload(f"conversations:{bad}", vocab_size=320, max_model_len=2048)


def test_a_cached_prompt_counts_only_the_chunks_it_computes() -> None:
    engine = _engine(True)
    engine.update_config(max_num_batched_tokens=32, chunk_tile=16)
    prompt = list(range(3, 60))
    engine.generate([prompt], SamplingParams(max_tokens=2))
    engine.generate([prompt], SamplingParams(max_tokens=2))
    views = sorted(engine.snapshot().requests, key=lambda v: v.cached_tokens)
    assert [(v.cached_tokens, v.chunks_done, v.chunks_total) for v in views] == [
        (0, 2, 2), (48, 1, 1)]  # 57 tokens in chunks of 32; then 9 past the cached 48
