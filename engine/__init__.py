"""The embedded tokenflow engine: paged KV cache, chunked prefill, token-budget scheduler."""

from typing import TYPE_CHECKING, Any

from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.errors import EngineError, ModelLoadError, RequestError

if TYPE_CHECKING:
    from engine.batch import RequestOutput
    from engine.ops.equipped import Engine

__all__ = ["ConfigError", "Engine", "EngineConfig", "EngineError", "ModelLoadError",
           "RequestError", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # lazy: Engine imports torch (seconds), which the console's UI process never needs
    if name == "Engine":
        from engine.ops.equipped import Engine

        return Engine
    if name == "RequestOutput":
        from engine.batch import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
