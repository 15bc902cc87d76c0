"""Multi-turn conversations: the workload that exercises the prefix cache (docs/harness.md)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import EngineError

FIRST_TOKEN_ID = 3
OPEN_LOOP_TURN_GAP_S = 5.0


class ConversationError(EngineError):
    """A conversation file or profile cannot be used."""


@dataclass(frozen=True)
class Turn:

    user: tuple[int, ...]
    max_tokens: int
    think_s: float = 0.0


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    arrival_s: float
    system: tuple[int, ...]
    turns: tuple[Turn, ...]
    tenant: str = "default"


@dataclass(frozen=True)
class MultiTurnProfile:

    conversations: int = 16
    turns: int = 4
    system_len: int = 1600
    user_len: int = 200
    reply_len: int = 200
    think_s: float = 0.5
    rate: float = 2.0


MULTITURN = MultiTurnProfile()
# the latest a request may arrive, 11.6 days: arrivals replay in real time (1e9 s is 31 years)
MAX_ARRIVAL_S = 1e6
LENGTH_JITTER = 0.25


def multiturn_conversations(profile: MultiTurnProfile, *, num_conversations: int | None,
                            rate: float | None, length_scale: float, vocab_size: int,
                            max_model_len: int, rng: random.Random) -> list[Conversation]:
    """Seeded conversations of the profile's shape; `rate` overrides its start rate. No
    length passes `max_model_len`: a longer one could never be sent, however scaled."""
    n = num_conversations or profile.conversations
    rate = profile.rate if rate is None else rate

    def scaled(mean: int, jitter: float = 1.0) -> int:
        return max(1, round(min(mean * length_scale * jitter, max_model_len)))

    def tokens(mean: int) -> tuple[int, ...]:
        length = scaled(mean, rng.uniform(1 - LENGTH_JITTER, 1 + LENGTH_JITTER))
        return tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(length))

    system = tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size)
                   for _ in range(scaled(profile.system_len)))
    conversations, start = [], 0.0
    for c in range(n):
        turns = tuple(Turn(tokens(profile.user_len), len(tokens(profile.reply_len)),
                           0.0 if t == 0 else profile.think_s) for t in range(profile.turns))
        conversations.append(Conversation(f"c{c:04d}", start, system, turns))
        if rate != float("inf"):
            start += rng.expovariate(rate)
    return conversations


def load_conversations(path: Path | str,
                       encode: Callable[[str], list[int]] | None) -> list[Conversation]:
    """Conversations from a JSONL file; any bad line fails the whole file, naming line and field."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConversationError(f"cannot read conversation file {path} "
                                f"({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConversationError(f"{path}: not valid UTF-8; save the conversation file as "
                                "UTF-8") from None
    conversations, seen = [], set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        conversation = _parse(where, line, encode)
        if conversation.conversation_id in seen:
            raise ConversationError(f"{where}: field 'id': {conversation.conversation_id!r} "
                                    "repeats an earlier line; ids must be unique")
        seen.add(conversation.conversation_id)
        conversations.append(conversation)
    if not conversations:
        raise ConversationError(f"{path} holds no conversation; write one JSON object a line")
    return conversations


MAX_DEPTH = 16  # a conversation nests 3 deep; 200,000 would exhaust the stack


def json_object(where: str, line: str, error: type[EngineError]) -> dict[str, Any]:
    """One JSONL line holding an object at most MAX_DEPTH deep; `error` says what is wrong."""
    too_deep = error(f"{where}: nests JSON deeper than {MAX_DEPTH} levels; a line holds one "
                     "flat object")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise too_deep from None
    except ValueError as exc:
        raise error(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise error(f"{where}: expected a JSON object, got {type(obj).__name__}")
    stack: list[tuple[Any, int]] = [(obj, 0)]  # no recursion: depth is what is checked
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise too_deep
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, dict | list))
    return obj


def _parse(where: str, line: str, encode: Callable[[str], list[int]] | None) -> Conversation:
    obj = json_object(where, line, ConversationError)

    def bad(field: str, need: str, value: Any) -> ConversationError:
        return ConversationError(f"{where}: field {field!r}: {need}, got {value!r}")

    def text_or_ids(o: dict[str, Any], name: str, required: bool) -> tuple[int, ...]:
        ids_name = f"{name}_token_ids"
        if name in o and ids_name in o:
            raise ConversationError(f"{where}: give one of {name!r} or {ids_name!r}, not both")
        if name in o:
            if not isinstance(o[name], str) or not o[name]:
                raise bad(name, "must be non-empty text", o[name])
            if encode is None:
                raise bad(name, "text needs the model's tokenizer; give token ids", o[name])
            return tuple(encode(o[name]))
        if ids_name in o:
            ids = o[ids_name]
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise bad(ids_name, "must be a non-empty list of non-negative integers", ids)
            return tuple(ids)
        if required:
            raise ConversationError(f"{where}: a turn needs {name!r} or {ids_name!r}")
        return ()

    cid = obj.get("id")
    if not isinstance(cid, str) or not cid:
        raise bad("id", "must be a non-empty string", cid)
    arrival = obj.get("arrival_s", 0.0)
    if not _seconds(arrival):
        raise bad("arrival_s", f"must be a number of seconds in [0, {MAX_ARRIVAL_S:g}]", arrival)
    tenant = obj.get("tenant", "default")
    if not isinstance(tenant, str):
        raise bad("tenant", "must be a string", tenant)
    raw_turns = obj.get("turns")
    if not isinstance(raw_turns, list) or not raw_turns:
        raise bad("turns", "must be a non-empty list of objects", raw_turns)
    turns = []
    for i, raw in enumerate(raw_turns):
        if not isinstance(raw, dict):
            raise bad(f"turns[{i}]", "must be an object", raw)
        max_tokens = raw.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise bad(f"turns[{i}].max_tokens", "must be an integer >= 1", max_tokens)
        think = raw.get("think_s", 0.0)
        if not _seconds(think):
            raise bad(f"turns[{i}].think_s",
                      f"must be a number of seconds in [0, {MAX_ARRIVAL_S:g}]", think)
        turns.append(Turn(text_or_ids(raw, "user", True), max_tokens, float(think)))
    return Conversation(cid, float(arrival), text_or_ids(obj, "system", False), tuple(turns),
                        tenant)


def _seconds(value: Any) -> bool:
    """Whether `value` is a JSON number of seconds a workload may wait, 0 to MAX_ARRIVAL_S."""
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and 0 <= value <= MAX_ARRIVAL_S)
