"""C* kept stable (`CStar`) and made a token budget; the engine and the console share it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engine.batch import StepShape
from engine.budget.cost_model import BudgetModel
from engine.config import ConfigError, EngineConfig

DEFAULT_WINDOW_S = 20.0
DEFAULT_HYSTERESIS = 0.25
MAX_SAMPLES = 65536


def token_budget_for(chunk: int, decodes: int, tile: int) -> int:
    """The budget fitting a `chunk`-token prefill beside `decodes` decodes, in whole tiles."""
    wanted = chunk + decodes
    return max(tile, -(-wanted // tile) * tile)


class CStar:
    """C* from the decode load smoothed over `window_s`; moved only after a window of drift."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S,
                 hysteresis: float = DEFAULT_HYSTERESIS) -> None:
        if not window_s > 0:
            raise ConfigError("window_s", f"must be > 0, got {window_s}")
        if not 0 <= hysteresis < 1:
            raise ConfigError("hysteresis", f"must be in [0, 1), got {hysteresis}")
        self.window_s = window_s
        self.hysteresis = hysteresis
        self.value: int | None = None
        self.unclamped: int | None = None
        self.decodes = 0
        self.changes = 0
        self._samples: deque[tuple[float, int, int]] = deque()
        self._decodes = 0
        self._context = 0
        self._outside_since: float | None = None

    def observe(self, now: float, decodes: int, context: int, budget: BudgetModel,
                tile: int, limit: int) -> int:
        """Add one step's load (D decodes at mean context S); the C* to use now."""
        quiet = bool(self._samples) and now - self._samples[-1][0] > self.window_s
        self._samples.append((now, decodes, decodes * context))
        self._decodes += decodes
        self._context += decodes * context
        while (self._samples[0][0] < now - self.window_s
               or len(self._samples) > MAX_SAMPLES):
            _, d, ds = self._samples.popleft()
            self._decodes -= d
            self._context -= ds
        if quiet:
            self._outside_since = None
        mean_decodes = round(self._decodes / len(self._samples))
        mean_context = self._context // self._decodes if self._decodes else 0
        unclamped = budget.recommended_chunk(mean_decodes, mean_context)
        wanted = min(max(unclamped, tile), max(limit, tile))
        current = self.value
        if current is None:
            self.value, self.unclamped, self.decodes = wanted, unclamped, mean_decodes
        elif abs(wanted - current) <= max(tile, self.hysteresis * current):
            self._outside_since = None
        elif self._outside_since is None:
            self._outside_since = now
        elif now - self._outside_since >= self.window_s:
            self.value, self.unclamped, self.decodes = wanted, unclamped, mean_decodes
            self.changes += 1
            self._outside_since = None
        return self.value


def auto_token_budget(config: EngineConfig, chunk: int,
                      predict: Callable[[StepShape], float], decodes: int, context: int,
                      max_model_len: int) -> int:
    if decodes == 0:
        return config.max_num_batched_tokens
    if config.auto_tpot_ms:
        chunk = max(chunk, largest_chunk_within(predict, config.auto_tpot_ms / 1e3, decodes,
                                                context, max_model_len))
    return token_budget_for(chunk, decodes, config.chunk_tile)


def largest_chunk_within(predict: Callable[[StepShape], float], seconds: float, decodes: int,
                         context: int, max_chunk: int) -> int:
    """The largest chunk (at most `max_chunk`) whose step is predicted within `seconds`."""
    contexts = (context,) * decodes
    low, high = 0, max_chunk
    while low < high:
        middle = (low + high + 1) // 2
        if predict(StepShape(prefill=((middle, 0),), decode_contexts=contexts)) <= seconds:
            low = middle
        else:
            high = middle - 1
    return low
