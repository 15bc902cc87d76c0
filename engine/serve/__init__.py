"""`tokenflow serve`: the engine behind an OpenAI-compatible HTTP API (starlette + uvicorn).

The app lives in engine.serve.app; importing this package alone (for auth, say) stays light.
"""
