"""`tokenflow serve`: the engine behind an OpenAI-compatible HTTP API (starlette + uvicorn)."""

from engine.server.app import create_app

__all__ = ["create_app"]
