"""The embedded tokenflow engine: paged KV cache, chunked prefill, token-budget scheduler."""

from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.engine import Engine, RequestOutput
from engine.errors import EngineError, ModelLoadError, RequestError

__all__ = ["ConfigError", "Engine", "EngineConfig", "EngineError", "ModelLoadError",
           "RequestError", "RequestOutput", "SamplingParams"]
