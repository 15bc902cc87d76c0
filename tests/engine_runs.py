"""Serving an engine's requests to the end, for tests that compare the tokens."""

from __future__ import annotations

from engine.core.engine_core import EngineCore
from engine.harness.driver import OutputTokens


def finish(engine: EngineCore) -> dict[str, list[int]]:
    """Step until nothing is unfinished; each request's output tokens, by id."""
    done, tokens = {}, OutputTokens()
    while engine.has_unfinished():
        for out in engine.step():
            held = tokens.add(out)
            if out.finished:
                done[out.request_id] = held
    return done
