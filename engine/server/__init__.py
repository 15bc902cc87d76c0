"""`tokenflow serve`: the engine behind an OpenAI-compatible HTTP API (starlette + uvicorn).

The app lives in engine.server.app; importing this package alone (for auth, say) stays light.
"""
