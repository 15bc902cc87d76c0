"""`tokenflow serve`: the engine behind an OpenAI-compatible HTTP API; the app is in .app."""
