"""Which replica of a fleet serves a request: round-robin, least outstanding tokens, or session."""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, field

from engine.config import ConfigError
from engine.harness.workload import WorkloadRequest


class RoutePolicy(enum.StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_TOKENS = "least-tokens"
    SESSION = "session"

    @classmethod
    def parse(cls, name: str) -> RoutePolicy:
        try:
            return cls(name)
        except ValueError:
            raise ConfigError("router", f"unknown policy {name!r}; choose one of "
                              f"{', '.join(p.value for p in cls)}") from None


@dataclass
class Router:
    """Routes requests and tracks each replica's outstanding tokens (prompt plus max_tokens)."""

    policy: RoutePolicy
    replicas: int
    outstanding: list[int] = field(init=False)
    _next: int = field(default=0, init=False)
    _held: dict[str, tuple[int, int]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError("replicas", f"must be >= 1, got {self.replicas}")
        self.outstanding = [0] * self.replicas

    def route(self, request: WorkloadRequest) -> int:
        if self.policy is RoutePolicy.ROUND_ROBIN:
            replica, self._next = self._next, (self._next + 1) % self.replicas
        elif self.policy is RoutePolicy.LEAST_TOKENS:
            replica = min(range(self.replicas), key=self.outstanding.__getitem__)
        else:  # crc32 is stable across processes
            replica = zlib.crc32(request.tenant.encode()) % self.replicas
        tokens = len(request.prompt_token_ids) + request.max_tokens
        self.outstanding[replica] += tokens
        self._held[request.request_id] = (replica, tokens)
        return replica

    def finished(self, request_id: str) -> None:
        replica, tokens = self._held.pop(request_id)
        self.outstanding[replica] -= tokens
