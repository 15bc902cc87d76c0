"""Each client address's share of the engine: at most N of its choices run at once, and the
rest wait their turn, in order. One client's many requests (a burst, or streams it never
reads) then share each step with at most N of its own, not with all of them."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

DEFAULT_PER_ADDRESS = 32


@dataclass
class _Client:
    running: int = 0
    queue: deque[tuple[int, asyncio.Future[None]]] = field(default_factory=deque)


class ClientTurns:
    """Turns per address, on the event loop's thread. A request of more choices than the
    share runs alone, once none of its address's run."""

    def __init__(self, per_address: int = DEFAULT_PER_ADDRESS) -> None:
        if per_address < 1:
            raise ValueError(f"per_address must be at least 1, got {per_address}")
        self.per_address = per_address
        self._clients: dict[str, _Client] = {}

    def running(self, address: str) -> int:
        client = self._clients.get(address)
        return 0 if client is None else client.running

    def waiting(self, address: str) -> int:
        client = self._clients.get(address)
        return 0 if client is None else len(client.queue)

    async def take(self, address: str, count: int) -> None:
        """Return once `count` more of `address`'s choices may run; give each back when done."""
        client = self._clients.setdefault(address, _Client())
        if not client.queue and self._fits(client, count):
            client.running += count
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (count, turn)
        client.queue.append(entry)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # granted as it was cancelled
                self.give_back(address, count)
            else:
                client.queue.remove(entry)
                self._grant(address, client)  # it may have held back those behind it
            raise

    def give_back(self, address: str, count: int = 1) -> None:
        client = self._clients[address]
        client.running -= count
        self._grant(address, client)

    def _fits(self, client: _Client, count: int) -> bool:
        return client.running == 0 or client.running + count <= self.per_address

    def _grant(self, address: str, client: _Client) -> None:
        while client.queue and self._fits(client, client.queue[0][0]):
            count, turn = client.queue.popleft()
            client.running += count
            turn.set_result(None)
        if not client.running and not client.queue:
            del self._clients[address]
