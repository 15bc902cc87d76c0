"""Intake: check a prompt's token ids and reject unservable requests before any state changes."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.errors import RequestError
from engine.events import RejectCause

BREAKER_FACTOR = 1.2  # protection layer 1: reject prompts over max_prefill_tokens × 1.2


@dataclass(frozen=True)
class Rejection:
    cause: RejectCause
    message: str  # says what to change


def prompt_token_ids(prompt: Sequence[int] | str, encode: Callable[[str], list[int]],
                     vocab_size: int) -> list[int]:
    """Token ids of a prompt; RequestError if it is malformed."""
    packed = _packed(prompt)
    if packed is not None:
        token_ids = packed.tolist()
    elif isinstance(prompt, str):
        token_ids = encode(prompt)
    else:
        try:
            token_ids = list(map(int, prompt))  # in C: prompts run to thousands of ids
        except (TypeError, ValueError):
            raise RequestError("prompt must be text or a list of integer token ids") from None
    if not token_ids:
        raise RequestError("the prompt is empty; send at least one token")
    if packed is not None:  # the bounds over the packed ids, without a Python int for each
        ids = np.frombuffer(packed, dtype=np.int64)
        low, high = int(ids.min()), int(ids.max())
    else:
        low, high = min(token_ids), max(token_ids)
    if low < 0 or high >= vocab_size:  # the search only on error
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return token_ids


def _packed(prompt: Sequence[int] | str) -> array[int] | None:
    """A list or tuple of ints as int64s, packed in C, or None (text, another sequence, an id
    that is no int or overflows): those go through int() one by one."""
    if type(prompt) not in (list, tuple):  # re-iterable: the fallback reads it again
        return None
    try:
        return array("q", prompt)  # ints and __index__ types only: int() takes more
    except (TypeError, OverflowError):
        return None


def rejection(prompt_tokens: int, max_tokens: int, config: EngineConfig, max_model_len: int,
              blocks: BlockManager) -> Rejection | None:
    """Why a request of this size can never be served, or None."""
    limit = config.max_prefill_tokens or max_model_len
    if prompt_tokens > limit * BREAKER_FACTOR:
        return Rejection(RejectCause.BREAKER,
                         f"circuit breaker: prompt has {prompt_tokens} tokens, over "
                         f"max_prefill_tokens {limit} × {BREAKER_FACTOR}; shorten the prompt")
    if prompt_tokens + max_tokens > max_model_len:
        return Rejection(RejectCause.TOO_LONG,
                         f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) exceeds "
                         f"max_model_len {max_model_len}; shorten the prompt or lower max_tokens")
    budget = config.max_num_batched_tokens
    if not config.chunked_prefill and prompt_tokens > budget:
        return Rejection(RejectCause.OVER_BUDGET,
                         f"chunked prefill is off and the prompt ({prompt_tokens}) exceeds "
                         f"max_num_batched_tokens {budget}; raise the budget or turn chunking on")
    needed = blocks.blocks_for(prompt_tokens + max_tokens)
    if needed > blocks.num_blocks:
        return Rejection(RejectCause.KV_POOL,
                         f"needs {needed} KV blocks but the pool has {blocks.num_blocks}; "
                         f"raise kv_cache_bytes or lower max_tokens")
    return None
