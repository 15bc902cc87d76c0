"""Errors a user can act on: each message says what went wrong and how to fix it."""


class EngineError(Exception):
    """Base of every error the engine raises for bad input or environment."""


class ModelLoadError(EngineError):
    """The model path, files or architecture cannot be used."""


class RequestError(EngineError):
    """A request is malformed or cannot ever be served (e.g. longer than the model allows)."""
