"""A stream behind its engine (a slow client, a busy event loop) sends what piled up as one
chunk a choice, as vLLM's output collector merges what its consumer has not taken: the same
tokens, text and finish, in fewer chunks."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from engine import Engine, EngineConfig
from engine.batch import TokenLogprob
from engine.core.engine_core import RequestOutput
from engine.serve.app import create_app
from engine.serve.loop import EngineLoop
from engine.serve.mailbox import Mailbox
from engine.serve.outputs import coalesced
from engine.serve.thread import ServerThread


def out(rid: str, tokens: tuple[int, ...], *, finished: bool = False,
        logprobs: tuple[TokenLogprob, ...] | None = None,
        prompt_logprobs: tuple[TokenLogprob, ...] | None = None,
        text_end: int | None = None) -> RequestOutput:
    return RequestOutput(rid, tokens, finished, "stop" if finished else None,
                         "finished" if finished else "decoding", logprobs, prompt_logprobs,
                         text_end)


def test_each_choices_outputs_merge_in_order_keeping_what_each_carries() -> None:
    lp = [TokenLogprob(t, -float(t), 1, ()) for t in range(5)]
    first = out("a", (1,), logprobs=(lp[1],), prompt_logprobs=(lp[0],))
    merged = coalesced([(0, first), (1, out("b", (7,))), (0, out("a", (2, 3),
                        logprobs=(lp[2], lp[3]))), (0, out("a", (4,), finished=True,
                        logprobs=(lp[4],), text_end=3)), (1, out("b", (8,)))])
    assert [index for index, _ in merged] == [0, 1]
    a, b = merged[0][1], merged[1][1]
    assert a.new_token_ids == (1, 2, 3, 4) and a.logprobs == tuple(lp[1:])
    assert a.prompt_logprobs == (lp[0],) and a.finished and a.finish_reason == "stop"
    assert a.text_end == 3 and a.state == "finished"
    assert b.new_token_ids == (7, 8) and b.logprobs is None and not b.finished
    assert coalesced([(2, first)]) == [(2, first)]  # alone: the very output


@pytest.fixture(scope="module")
def loop() -> Iterator[EngineLoop]:
    started = EngineLoop(Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                                             dtype="float32"))).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def url(loop: EngineLoop) -> Iterator[str]:
    with ServerThread(create_app(loop, admin_token=None)) as running:
        yield running.url


def server_mailbox(loop: EngineLoop) -> Mailbox:
    """The mailbox the engine sends the HTTP server's outputs through (its asyncio loop's)."""
    return next(send.__self__ for send in loop.outputs.senders  # type: ignore[attr-defined]
                if isinstance(getattr(send, "__self__", None), Mailbox)
                and send.__self__.aio.is_running())  # type: ignore[attr-defined]


def test_the_tokens_a_held_event_loop_missed_go_out_as_one_chunk(loop: EngineLoop,
                                                                  url: str) -> None:
    body = {"prompt": [9, 10, 11], "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=url, timeout=60) as client:
        whole = client.post("/v1/completions", json=body).json()["choices"][0]
        loop.pause()  # the request goes in, and no step runs until the event loop is held
        try:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                held, release = threading.Event(), threading.Event()

                def hold() -> None:
                    held.set()
                    release.wait(60)

                server_mailbox(loop).aio.call_soon_threadsafe(hold)
                assert held.wait(60)
                loop.resume()  # all 16 tokens are made while the event loop is held
                while loop.call(lambda engine: engine.has_unfinished()).result(60):
                    pass
                release.set()
                lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        finally:
            release.set()
            loop.resume()
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line)["choices"][0] for line in lines[:-1]]
    assert len(chunks) == 1
    assert chunks[0]["token_ids"] == whole["token_ids"] and chunks[0]["text"] == whole["text"]
    assert chunks[0]["finish_reason"] == "length"
