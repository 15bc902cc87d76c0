"""The engine thread's calls onto an asyncio loop go over once a step, in order, each
request's fault its own; a step's outputs of many requests wake the loop once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from engine.config import SamplingParams
from engine.core.engine_core import RequestOutput
from engine.serve.loop import EngineLoop
from engine.serve.mailbox import Mailbox


def counting_wakes(aio: asyncio.AbstractEventLoop) -> list[int]:
    """The calls each wake of `aio` from another thread carried, as the loop's thread sees."""
    wakes: list[int] = []
    real = aio.call_soon_threadsafe

    def counted(callback: Callable[..., object], *args: Any) -> asyncio.Handle:
        wakes.append(len(args[0]) if args else 0)
        return real(callback, *args)

    aio.call_soon_threadsafe = counted  # type: ignore[method-assign]
    return wakes


def test_posted_calls_wait_for_the_send_then_run_in_order_in_one_wake() -> None:
    async def scenario() -> tuple[list[int], list[int], list[int]]:
        aio = asyncio.get_running_loop()
        wakes = counting_wakes(aio)
        mailbox, ran = Mailbox(aio), []
        for i in range(3):
            mailbox.post(ran.append, i)
        await asyncio.sleep(0)
        before = list(ran)
        done = asyncio.Event()
        mailbox.post(done.set)
        threading.Thread(target=mailbox.send).start()  # the engine's thread sends
        await done.wait()
        mailbox.send()  # nothing held: no wake
        return before, ran, wakes

    before, ran, wakes = asyncio.run(scenario())
    assert before == [] and ran == [0, 1, 2] and wakes == [4]


def test_a_failing_call_is_reported_and_the_others_still_run() -> None:
    async def scenario() -> tuple[list[str], list[object]]:
        aio = asyncio.get_running_loop()
        reported: list[object] = []
        aio.set_exception_handler(lambda _loop, context: reported.append(context["exception"]))
        mailbox, ran = Mailbox(aio), []
        mailbox.post(ran.append, "before")
        mailbox.post(int, "not a number")
        mailbox.post(ran.append, "after")
        mailbox.send()
        await asyncio.sleep(0)
        return ran, reported

    ran, reported = asyncio.run(scenario())
    assert ran == ["before", "after"]
    assert len(reported) == 1 and isinstance(reported[0], ValueError)


def test_a_closed_loop_is_sent_nothing() -> None:
    aio = asyncio.new_event_loop()
    mailbox = Mailbox(aio)
    aio.close()
    mailbox.post(print, "never")
    mailbox.send()  # no RuntimeError on the engine's thread


def test_a_steps_outputs_of_many_requests_wake_the_asyncio_loop_once(loop: EngineLoop) -> None:
    requests, max_tokens = 4, 6

    async def scenario() -> tuple[list[RequestOutput], list[int]]:
        aio = asyncio.get_running_loop()
        wakes = counting_wakes(aio)
        mailbox = Mailbox(aio)
        heard: asyncio.Queue[RequestOutput] = asyncio.Queue()
        loop.outputs.add_sender(mailbox.send)
        loop.pause()  # all four are in the engine before its first step
        try:
            for _ in range(requests):
                loop.submit([1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                            on_output=lambda out: mailbox.post(heard.put_nowait, out))
            loop.resume()
            outputs: list[RequestOutput] = []
            while sum(out.finished for out in outputs) < requests:
                outputs.append(await heard.get())
        finally:
            loop.outputs.remove_sender(mailbox.send)
        return outputs, wakes

    outputs, wakes = asyncio.run(scenario())
    assert sum(len(out.new_token_ids) for out in outputs) == requests * max_tokens  # none lost
    # a wake a step with each running request's output: one arrival may miss the first step
    assert sum(wakes) == len(outputs) == requests * max_tokens
    assert max(wakes) == requests and len(wakes) <= max_tokens + 1


def test_the_step_a_resume_wakes_delivers_its_outputs(loop: EngineLoop) -> None:
    """Resumed while the loop's thread waits idle, its first step is taken in the wait's
    branch: its outputs reach their listeners as any step's do."""
    heard: list[RequestOutput] = []
    finished = threading.Event()

    def listen(output: RequestOutput) -> None:
        heard.append(output)
        if output.finished:
            finished.set()

    loop.pause()
    loop.submit([1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True), on_output=listen)
    loop.call(lambda _engine: None).result()  # the request is in, held by the pause
    while not loop._wake._waiters:  # type: ignore[attr-defined]  # the thread waits idle
        threading.Event().wait(0.001)
    loop.resume()
    assert finished.wait(30)
    assert [len(out.new_token_ids) for out in heard] == [1]
