"""Calls from the engine's thread onto an asyncio loop, sent together once a step: the loop
wakes once a step, however many choices the step moved, as vLLM's engine core hands each
step's outputs to its front end in one message."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Mailbox:
    """What one step's outputs ask of one asyncio loop. Only the engine's thread posts and
    sends, so the held list needs no lock."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self.aio = aio
        self._held: list[tuple[Callable[..., object], tuple[object, ...]]] = []

    def post(self, call: Callable[..., object], *args: object) -> None:
        """Hold `call(*args)` for the loop until the step's outputs are all delivered."""
        self._held.append((call, args))

    def send(self) -> None:
        """Run everything posted since the last send on the loop, in order, in one callback.
        A closed loop (its server gone) gets nothing: nobody waits on it."""
        if not self._held or self.aio.is_closed():
            self._held.clear()
            return
        held, self._held = self._held, []
        self.aio.call_soon_threadsafe(self._run, held)

    def _run(self, held: list[tuple[Callable[..., object], tuple[object, ...]]]) -> None:
        for call, args in held:
            try:
                call(*args)
            except Exception as exc:  # one request's fault stays its own, as when each call
                # was a callback of its own: reported, and the others still run
                self.aio.call_exception_handler({"message": "a posted call failed",
                                                 "exception": exc})
