"""Each client address's share of the engine: at most N of its choices run at once, the rest
wait their turn in order, and another address is not held back by them."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from engine.serve.app import create_app
from engine.serve.loop import EngineLoop
from engine.serve.thread import ServerThread
from engine.serve.turns import ClientTurns


def test_an_address_at_its_share_waits_and_another_goes_at_once() -> None:
    async def scenario() -> list[str]:
        turns, order = ClientTurns(per_address=2), []

        async def one(name: str, address: str, count: int = 1) -> None:
            await turns.take(address, count)
            order.append(name)

        await one("a1", "a")
        await one("a2", "a")
        waiting = [asyncio.create_task(one(f"a{i}", "a")) for i in (3, 4)]
        await asyncio.sleep(0)
        await one("b1", "b")  # another address is not held back
        assert order == ["a1", "a2", "b1"] and turns.waiting("a") == 2
        turns.give_back("a")
        await asyncio.sleep(0)
        assert order[-1] == "a3" and turns.waiting("a") == 1  # in order, one for one
        turns.give_back("a", 2)
        await asyncio.gather(*waiting)
        return order

    assert asyncio.run(scenario()) == ["a1", "a2", "b1", "a3", "a4"]


def test_a_request_of_more_choices_than_the_share_runs_alone() -> None:
    async def scenario() -> None:
        turns = ClientTurns(per_address=4)
        await turns.take("a", 1)
        big = asyncio.create_task(turns.take("a", 10))
        await asyncio.sleep(0)
        assert not big.done()
        turns.give_back("a")
        await big
        assert turns.running("a") == 10
        turns.give_back("a", 10)
        assert turns.running("a") == 0 and turns.waiting("a") == 0

    asyncio.run(scenario())


def test_a_cancelled_wait_leaves_its_place_to_those_behind_it() -> None:
    async def scenario() -> None:
        turns = ClientTurns(per_address=2)
        await turns.take("a", 1)
        big = asyncio.create_task(turns.take("a", 2))
        small = asyncio.create_task(turns.take("a", 1))
        await asyncio.sleep(0)
        assert not small.done()  # in order: behind the one that does not fit
        big.cancel()
        await asyncio.sleep(0)
        assert turns.running("a") == 2 and turns.waiting("a") == 0  # granted to the small one
        await small

    asyncio.run(scenario())


def test_a_share_under_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ClientTurns(per_address=0)


def _engine_requests(loop: EngineLoop) -> int:
    return loop.call(lambda engine: len(engine.scheduler.requests)).result(30)


def test_one_address_has_at_most_its_share_in_the_engine(loop: EngineLoop) -> None:
    turns = ClientTurns(per_address=2)
    body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    statuses: list[int] = []

    def post(address: str) -> None:
        transport = httpx.HTTPTransport(local_address=address)
        with httpx.Client(base_url=server.url, transport=transport, timeout=60) as client:
            statuses.append(client.post("/v1/completions", json=body).status_code)

    with ServerThread(create_app(loop, admin_token=None, turns=turns)) as server:
        loop.pause()  # nothing runs: the engine holds what it was given
        try:
            senders = [threading.Thread(target=post, args=("127.0.0.1",)) for _ in range(5)]
            senders.append(threading.Thread(target=post, args=("127.0.0.2",)))
            for sender in senders:
                sender.start()
            while turns.waiting("127.0.0.1") < 3 or turns.running("127.0.0.2") < 1:
                threading.Event().wait(0.01)  # until all six are in, not a timing judgement
            assert _engine_requests(loop) == 3  # two of the first address's, one of the other
        finally:
            loop.resume()
        for sender in senders:
            sender.join(60)
    assert statuses == [200] * 6
    assert turns.running("127.0.0.1") == turns.waiting("127.0.0.1") == 0
