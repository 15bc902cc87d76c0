"""Crash recovery (pitfall 12): finish what a killed engine left in the request journal."""

from __future__ import annotations

import dataclasses

from engine.config import SamplingParams
from engine.core.engine import Engine
from engine.store import Database, mark_resumed, unfinished_requests

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def resume_unfinished(engine: Engine, database: Database,
                      skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Re-add every unfinished journal entry (except `skip`, already emitted) with the tokens
    it had generated: prompt and those are prefilled again (RECOMPUTE) and generation goes
    on, so greedy outputs equal an uninterrupted run's. Returns the resumed ids."""
    with database.session() as session:
        entries = [e for e in unfinished_requests(session) if e.request_id not in skip]
        for entry in entries:
            sampling = {k: v for k, v in entry.sampling.items() if k in _SAMPLING_FIELDS}
            engine.add_request(entry.prompt_token_ids, SamplingParams(**sampling),
                               tenant=entry.tenant, priority=entry.priority,
                               request_id=entry.request_id, tag=entry.tag,
                               generated=entry.generated_token_ids)
        mark_resumed(session, [e.request_id for e in entries])
    return [e.request_id for e in entries]
