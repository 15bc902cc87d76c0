"""Per-request fault isolation: an error one request's sampling causes fails that
request alone (FAILED with the error, a Failed event of cause FAULT, counted by guard layer 7),
while the other requests of the same steps finish exactly and the engine goes on."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from engine import Engine, EngineConfig, RequestError, SamplingParams
from engine.batch import RequestOutput
from engine.events import Event, FailCause, Failed, GuardAction
from engine.harness.driver import OutputTokens
from engine.serve.loop import EngineLoop
from engine.store import StoreWriter, open_database, unfinished_requests
from engine.store.models import JournalRow

PROMPTS = [[(5 * i + 3 * n) % 250 + 3 for i in range(n)] for n in (4, 19, 33)]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def slipped_through(**fields: object) -> SamplingParams:
    """Sampling parameters holding values the edge validation refuses, as if one got past it:
    the engine must survive them anyway."""
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def tiny_engine() -> Engine:
    return Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32",
                               kv_cache_bytes=1 << 20, max_num_batched_tokens=32, chunk_tile=8))


def run_out(engine: Engine) -> tuple[dict[str, RequestOutput], dict[str, list[int]]]:
    """Step until nothing is left: each request's final output, and the tokens it heard."""
    done, tokens, held = {}, OutputTokens(), {}
    while engine.has_unfinished():
        for out in engine.step():
            held[out.request_id] = tokens.add(out)
            if out.finished:
                done[out.request_id] = out
    return done, held


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return tiny_engine().generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("poison", [
    {"seed": 2**64},  # torch's manual_seed raises on it
    {"seed": -(2**63) - 1},
    {"temperature": 1e-50},  # 0 in float32: logits / t are inf, probabilities NaN
], ids=["seed-too-big", "seed-too-small", "nan-probabilities"])
def test_a_request_whose_sampling_raises_fails_alone(expected: list[list[int]],
                                                     poison: dict[str, object]) -> None:
    engine = tiny_engine()
    events: list[Event] = []
    engine.bus.subscribe(events.append)
    good = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    bad = engine.add_request(PROMPTS[1], slipped_through(**poison))
    good.append(engine.add_request(PROMPTS[2], GREEDY))
    done, held = run_out(engine)
    engine.bus.drain()
    assert [held[rid] for rid in good] == expected
    assert all(done[rid].state == "FINISHED" for rid in good)
    assert done[bad].state == "FAILED" and "sampling failed" in done[bad].finish_reason
    failed = [e for e in events if isinstance(e, Failed)]
    assert [(e.request_id, e.cause) for e in failed] == [(bad, FailCause.FAULT)]
    assert any(isinstance(e, GuardAction) and e.layer == "fault_isolation" and bad in e.detail
               for e in events)
    snapshot = engine.snapshot()
    assert snapshot.faults_isolated_total == 1 and snapshot.requests_failed_total == 1
    assert engine.blocks.num_used == 0
    assert engine.generate(PROMPTS, GREEDY) == expected  # the engine goes on


def test_a_request_whose_ending_raises_ends_alone(expected: list[list[int]]) -> None:
    """A fault while ending a request (here the slow-query watch on it) is that request's:
    the others of the same steps finish exactly and the engine goes on."""
    engine = tiny_engine()
    good = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    bad = engine.add_request(PROMPTS[1], GREEDY)
    good.append(engine.add_request(PROMPTS[2], GREEDY))
    watch = engine.scheduler.watch
    ended = watch.ended

    def fragile(request: Any, config: EngineConfig) -> None:  # fault injection
        if request.id == bad:
            raise ValueError("poisoned")
        ended(request, config)

    watch.ended = fragile  # type: ignore[method-assign]
    done, held = run_out(engine)
    assert [held[rid] for rid in good] == expected
    assert all(done[rid].state == "FINISHED" for rid in good) and bad in done
    assert engine.blocks.num_used == 0
    assert engine.generate(PROMPTS, GREEDY) == expected  # the engine goes on


def test_a_tiny_top_p_keeps_the_top_token_instead_of_failing() -> None:
    """top_p below float32's smallest number compares as 0: it still samples the top token."""
    engine = tiny_engine()
    params = slipped_through(max_tokens=4, temperature=0.8, top_p=7e-46, seed=1)
    greedy = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.generate([PROMPTS[1]], params) == greedy


def test_a_failed_request_is_journaled_failed_and_never_resumed(tmp_path: Path) -> None:
    database = open_database(tmp_path / "journal.db")
    engine = tiny_engine()
    writer = StoreWriter(database, engine.bus, batch_window_s=0.01)
    try:
        ok = engine.add_request(PROMPTS[0], GREEDY)
        bad = engine.add_request(PROMPTS[1], slipped_through(temperature=1e-50))
        while engine.has_unfinished():
            engine.step()
        assert writer.flush(30.0)
        with database.session() as session:
            assert unfinished_requests(session) == []
            states = dict(session.execute(select(JournalRow.request_id, JournalRow.state)).all())
        assert states == {ok: "FINISHED", bad: "FAILED"}
    finally:
        writer.close()
        database.close()


def test_an_output_callback_that_raises_fails_its_request_and_the_loop_goes_on(
        expected: list[list[int]]) -> None:
    loop = EngineLoop(tiny_engine()).start()
    results: dict[str, list[int]] = {}
    tokens = OutputTokens()
    all_done = threading.Event()

    def collect(out: RequestOutput) -> None:
        held = tokens.add(out)
        if out.finished:
            results[out.request_id] = held
            if len(results) == len(PROMPTS):
                all_done.set()

    def broken(out: RequestOutput) -> None:
        raise ValueError("the client's stream is gone")

    try:
        bad = loop.submit(PROMPTS[0], GREEDY, on_output=broken)
        good = [loop.submit(p, GREEDY, on_output=collect) for p in PROMPTS]
        assert all_done.wait(120)
        assert [results[rid] for rid in good] == expected
        ended = loop.call(lambda engine: next(r for r in engine.scheduler.recent
                                              if r.id == bad)).result(60)
        assert ended.state == "FAILED" and "the client's stream is gone" in ended.reason
        assert loop.error is None
    finally:
        loop.stop()


def test_the_python_api_refuses_stop_ids_and_top_k_beyond_the_vocabulary() -> None:
    engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", dtype="float32"))
    vocab = engine.model_config.vocab_size
    for params in (SamplingParams(max_tokens=2, stop_token_ids=(vocab,)),
                   SamplingParams(max_tokens=2, top_k=vocab + 1)):
        with pytest.raises(RequestError, match="vocabulary"):
            engine.add_request([1, 2, 3], params)
    assert not engine.has_unfinished()
