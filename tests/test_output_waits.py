"""How a request waits for its next output: at once when one is queued, across the engine
check's intervals while the engine runs, and with a 503 once the engine thread has died."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from engine import Engine, EngineConfig
from engine.core.engine_core import RequestOutput
from engine.serve import completions
from engine.serve.completions import Generations
from engine.serve.loop import EngineLoop
from engine.serve.protocol import ApiError, BodyLimits
from engine.serve.shares import RequestShare

OUTPUT = RequestOutput("r", (7,), False, None, "decoding")


@pytest.fixture(scope="module")
def generations() -> Generations:
    loop = EngineLoop(Engine(EngineConfig(model="synthetic:tiny", device="cpu",
                                          dtype="float32")))  # never started: no thread
    return Generations(loop, max_queue=8, limits=BodyLimits(), share=RequestShare())


def test_an_output_that_comes_after_several_checks_is_still_heard(
        generations: Generations, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(completions, "ERROR_CHECK_S", 0.001)

    async def scenario() -> tuple[tuple[int, RequestOutput], tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        queue.put_nowait((0, OUTPUT))
        first = await generations._next(queue)
        asyncio.get_running_loop().call_later(0.02, queue.put_nowait, (1, OUTPUT))
        return first, await generations._next(queue)  # past a score of checks

    assert asyncio.run(scenario()) == ((0, OUTPUT), (1, OUTPUT))


def test_a_wait_on_a_dead_engine_ends_in_503(generations: Generations,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(completions, "ERROR_CHECK_S", 0.001)
    monkeypatch.setattr(generations.engine_loop, "error", RuntimeError("the step faulted"))

    async def scenario() -> None:
        await generations._next(asyncio.Queue())

    with pytest.raises(ApiError) as caught:
        asyncio.run(scenario())
    assert caught.value.status == 503 and "the step faulted" in caught.value.message


def test_an_answer_waits_for_the_journal_on_the_loop_and_a_stopped_or_silent_one_is_a_503(
        generations: Generations, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(completions, "JOURNAL_WAIT_S", 0.05)
    loop = generations.engine_loop

    def from_the_writers_thread(then: Callable[[bool], None]) -> None:
        threading.Thread(target=then, args=(True,)).start()

    monkeypatch.setattr(loop, "journal_served", from_the_writers_thread)
    asyncio.run(completions._journaled(loop))  # committed: the answer goes

    for served, said in ((lambda then: then(False), "did not commit"),  # the writer stopped
                         (lambda then: None, "within 0.05 s")):  # never told: the deadline
        monkeypatch.setattr(loop, "journal_served", served)
        with pytest.raises(ApiError) as caught:
            asyncio.run(completions._journaled(loop))
        assert caught.value.status == 503 and said in caught.value.message
