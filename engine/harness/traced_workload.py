"""A workload replaying what an attached fleet served (`--workload traced:DB`)."""

from __future__ import annotations

import random
from pathlib import Path

from sqlalchemy import select

from engine.errors import EngineError
from engine.harness.workload import (
    WorkloadRequest,
    check_count,
    check_scale,
    prompt_ids,
    within_span,
)
from engine.store import open_database
from engine.store.models import TracedRequestRow

PREFIX = "traced:"


def traced_requests(spec: str, *, vocab_size: int, max_model_len: int, seed: int = 0,
                    num_requests: int | None = None, source: str | None = None,
                    time_scale: float = 1.0) -> list[WorkloadRequest]:
    """The traced requests of the store `spec` names, oldest first; too long ones are errors."""
    check_scale("time_scale", time_scale)
    check_count(num_requests)
    target = spec.removeprefix(PREFIX)
    if not target:
        raise EngineError("traced: give the store, e.g. traced:store.db")
    if "://" not in target and not Path(target).expanduser().is_file():
        raise EngineError(f"traced:{target}: no such store; give the --db the console "
                          "collected the traces into")
    database = open_database(target, read_only="://" not in target)
    try:
        query = select(TracedRequestRow.request_id, TracedRequestRow.source,
                       TracedRequestRow.started_at, TracedRequestRow.prompt_tokens,
                       TracedRequestRow.completion_tokens).order_by(
            TracedRequestRow.started_at, TracedRequestRow.id)
        if source is not None:
            query = query.where(TracedRequestRow.source == source)
        if num_requests is not None:
            query = query.limit(num_requests)
        with database.session() as session:
            rows = session.execute(query).all()
    finally:
        database.close()
    if not rows:
        raise EngineError(f"traced:{target}: the store holds no traced requests"
                          + (f" of source {source!r}" if source else "")
                          + "; attach the console to a traced server with --otlp-listen first")
    for row in rows:
        if row.prompt_tokens + row.completion_tokens > max_model_len:
            raise EngineError(f"traced request {row.request_id!r} holds {row.prompt_tokens} "
                              f"prompt and {row.completion_tokens} output tokens, past the "
                              f"model's length {max_model_len}; raise --max-model-len")
    lengths = [max(1, row.prompt_tokens) for row in rows]
    ids = prompt_ids(random.Random(seed), vocab_size, sum(lengths))
    first = rows[0].started_at
    requests: list[WorkloadRequest] = []
    seen: set[str] = set()
    start = 0
    for n, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        prompt = tuple(ids[start:start + length].tolist())
        start += length
        # two traced servers may reuse an id: the replay's stay unique
        request_id = str(row.request_id) if row.request_id not in seen else f"{row.request_id}#{n}"
        seen.add(request_id)
        requests.append(WorkloadRequest(
            request_id=request_id, arrival_s=(row.started_at - first) * time_scale,
            prompt_token_ids=prompt, max_tokens=max(1, row.completion_tokens),
            tag=str(row.source), ignore_eos=True))
    return within_span(requests)
