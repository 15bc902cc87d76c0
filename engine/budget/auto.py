"""From C* to a token budget: the one policy the engine's auto_budget and the console's
"apply recommended" key share.

A step's budget holds the prefill chunk and one token per running decode, in whole chunk
tiles (pitfall 4), so C* is rounded up to a tile after the decodes are added.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.budget.cost_model import BudgetModel
from engine.config import EngineConfig
from engine.core.batch import StepShape


def token_budget_for(chunk: int, decodes: int, tile: int) -> int:
    """The budget that fits a `chunk`-token prefill beside `decodes` decodes, in whole tiles
    (at least one tile)."""
    wanted = chunk + decodes
    return max(tile, -(-wanted // tile) * tile)


def auto_token_budget(config: EngineConfig, budget: BudgetModel,
                      predict: Callable[[StepShape], float], decodes: int, context: int,
                      max_model_len: int) -> int:
    """C* for the live decode load (D decodes at mean context S) as a token budget. With no
    decode to protect the configured budget stands (seed 003 §13: bigger chunks then only
    shorten TTFT)."""
    if decodes == 0:
        return config.max_num_batched_tokens
    chunk = budget.recommended_chunk(decodes, context)
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
