"""Step faults: exceptions raised from the runner or scheduler at chosen steps, for supervisors."""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any, Literal

from engine.core.engine_core import EngineCore

Where = Literal["runner", "scheduler"]


class InjectedFault(RuntimeError):
    """Raised on purpose by StepFaults."""


class StepFaults:
    def __init__(self, engine: EngineCore, at: Container[int], where: Where = "runner",
                 before: Callable[[], object] | None = None) -> None:
        """Raise at the `at`-th calls (1-based) of `runner.run` or `scheduler.update`."""
        self.at = at
        self.before = before
        self.calls = 0
        self.raised = 0
        owner: Any = engine.runner if where == "runner" else engine.scheduler
        name = "run" if where == "runner" else "update"
        wrapped = getattr(owner, name)

        def faulty(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls in self.at:
                if self.before is not None:
                    self.before()
                self.raised += 1
                raise InjectedFault(f"injected into {where} call {self.calls}")
            return wrapped(*args, **kwargs)

        setattr(owner, name, faulty)
