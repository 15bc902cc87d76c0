"""C*, kept stable (`CStar`), and from C* to a token budget: the one policy the engine's
auto_budget and the console's "apply recommended" key share.

A step's budget holds the prefill chunk and one token per running decode, in whole chunk
tiles (pitfall 4), so C* is rounded up to a tile after the decodes are added.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engine.batch import StepShape
from engine.budget.cost_model import BudgetModel
from engine.config import ConfigError, EngineConfig

DEFAULT_WINDOW_S = 20.0  # the decode load C* is computed from is averaged over this
DEFAULT_HYSTERESIS = 0.25  # C* moves only for a change of more than this share
# steps the window averages at most: a clock that does not move never evicts by age
MAX_SAMPLES = 65536


def token_budget_for(chunk: int, decodes: int, tile: int) -> int:
    """The budget that fits a `chunk`-token prefill beside `decodes` decodes, in whole tiles
    (at least one tile)."""
    wanted = chunk + decodes
    return max(tile, -(-wanted // tile) * tile)


class CStar:
    """A stable C*: from the decode load smoothed over `window_s` (the mean D and the mean
    context S of the decodes, over every step in the window), clamped to [tile,
    max_num_batched_tokens], and moved only when the value wanted has stayed more than
    `hysteresis` of the current one (and more than a tile) away for a whole window. The live
    D and S of single steps swing with every arrival and finish; C* computed from them
    jumped every few seconds (issue 16).
    `value` is None until `observe` is first called on a calibrated engine."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S,
                 hysteresis: float = DEFAULT_HYSTERESIS) -> None:
        if not window_s > 0:
            raise ConfigError("window_s", f"must be > 0, got {window_s}")
        if not 0 <= hysteresis < 1:
            raise ConfigError("hysteresis", f"must be in [0, 1), got {hysteresis}")
        self.window_s = window_s
        self.hysteresis = hysteresis
        self.value: int | None = None
        # what `value` was set from: C* before the clamp, and the smoothed decodes beside it
        self.unclamped: int | None = None
        self.decodes = 0
        self.changes = 0  # times `value` moved after its first setting
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, D, D·S)
        self._decodes = 0  # running sums over the window
        self._context = 0
        self._outside_since: float | None = None  # the wanted C* left the band

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
        if quiet:  # nothing was seen for a whole window: the band is watched anew from now
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
            # a whole window outside the band: the load has changed, and the window now
            # holds only the new one, so C* moves once, to where it settles
            self.value, self.unclamped, self.decodes = wanted, unclamped, mean_decodes
            self.changes += 1
            self._outside_since = None
        return self.value


def auto_token_budget(config: EngineConfig, chunk: int,
                      predict: Callable[[StepShape], float], decodes: int, context: int,
                      max_model_len: int) -> int:
    """C* (`chunk`, as `CStar` holds it) beside the live decodes as a token budget. With no
    decode to protect the configured budget stands (seed 003 §13: bigger chunks then only
    shorten TTFT)."""
    if decodes == 0:
        return config.max_num_batched_tokens
    if config.auto_tpot_ms:
        # seed 003 §8: from C*, grow the chunk as far as the TPOT target allows
        chunk = max(chunk, largest_chunk_within(predict, config.auto_tpot_ms / 1e3, decodes,
                                                context, max_model_len))
    return token_budget_for(chunk, decodes, config.chunk_tile)


def largest_chunk_within(predict: Callable[[StepShape], float], seconds: float, decodes: int,
                         context: int, max_chunk: int) -> int:
    """The largest prefill chunk (at most `max_chunk`) whose step, beside the decodes, is
    predicted to take at most `seconds` (binary search; the predictor is monotone in the
    chunk)."""
    contexts = (context,) * decodes
    low, high = 0, max_chunk
    while low < high:
        middle = (low + high + 1) // 2
        if predict(StepShape(prefill=((middle, 0),), decode_contexts=contexts)) <= seconds:
            low = middle
        else:
            high = middle - 1
    return low
