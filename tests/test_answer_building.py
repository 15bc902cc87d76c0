"""A non-streamed answer is built where it costs least: a small one on the event loop, one
of many entries (logprobs of many choices) on the answer thread, one at a time, so the loop
keeps answering and several large answers never take the GIL from everyone at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.batch import TokenLogprob
from engine.serve import completions
from engine.serve.app import create_app
from engine.serve.completions import ANSWER_THREAD, OFF_LOOP_ENTRIES, Choice, answer_entries
from engine.serve.loop import EngineLoop
from engine.serve.thread import ServerThread


@pytest.fixture(scope="module")
def server(loop: EngineLoop) -> Iterator[ServerThread]:
    with ServerThread(create_app(loop, admin_token=None, max_queue=64)) as running:
        yield running


def built_on_the_event_loop(server: ServerThread, monkeypatch: pytest.MonkeyPatch,
                            **body: object) -> list[bool]:
    """For each answer built while serving `body`: whether an event loop ran its thread."""
    seen: list[bool] = []
    real = completions._json_bytes

    def watched(data: Any) -> bytes:
        try:
            asyncio.get_running_loop()
            seen.append(True)
        except RuntimeError:  # no loop runs this thread
            seen.append(False)
        return real(data)

    monkeypatch.setattr(completions, "_json_bytes", watched)
    reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"temperature": 0, "ignore_eos": True, **body})
    assert reply.status_code == 200, reply.text
    return seen


def test_a_small_answer_is_built_on_the_event_loop(server: ServerThread,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert built_on_the_event_loop(server, monkeypatch, prompt="hello there",
                                   max_tokens=8) == [True]


def test_an_answer_of_many_logprobs_is_built_on_a_worker_thread(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    assert built_on_the_event_loop(server, monkeypatch, prompt="abc" * 30, max_tokens=1,
                                   echo=True, logprobs=20, n=8) == [False]


def test_an_answers_entries_count_tokens_and_each_logprob_alternative() -> None:
    scored = tuple(TokenLogprob(7, -1.0, 1, ((7, -1.0), (8, -2.0))) for _ in range(5))
    scorer = Choice(0, [1] * 5, token_ids=[7, 7], logprobs=list(scored[:2]), scored=scored)
    follower = Choice(1, [1] * 5, token_ids=[7], scorer=scorer)
    # the scorer: 5 + 2 tokens, 2 + 5 logprobs of 3 entries each; the follower shows the
    # scorer's prompt logprobs too
    assert answer_entries([scorer]) == 7 + 7 * 3
    assert answer_entries([scorer, follower]) == 7 + 7 * 3 + 6 + 5 * 3
    assert answer_entries([scorer]) < OFF_LOOP_ENTRIES


def test_large_answers_sent_at_once_are_built_one_at_a_time_on_the_answer_thread(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    building, most, threads = [0], [0], []
    lock = threading.Lock()
    real = completions._json_bytes

    def watched(data: Any) -> bytes:
        with lock:
            building[0] += 1
            most[0] = max(most[0], building[0])
            threads.append(threading.current_thread().name)
        try:
            return real(data)
        finally:
            with lock:
                building[0] -= 1

    monkeypatch.setattr(completions, "_json_bytes", watched)

    async def four() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            replies = await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": "abc" * 30, "max_tokens": 1, "echo": True, "logprobs": 20, "n": 8,
                "temperature": 0}) for _ in range(4)))
        return [reply.status_code for reply in replies]

    assert asyncio.run(four()) == [200] * 4
    assert len(threads) == 4 and all(name.startswith(ANSWER_THREAD) for name in threads)
    assert most[0] == 1
