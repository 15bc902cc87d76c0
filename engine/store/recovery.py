"""Crash recovery: finish what a killed engine left in the journal; quarantine repeat killers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.config import SamplingParams
from engine.core.engine_core import EngineCore
from engine.errors import EngineError
from engine.store import (
    QUARANTINE_AFTER,
    Database,
    claim_for_resume,
    close_entry,
    discard_unfinished,
    unfinished_requests,
)
from engine.store.database import explained
from engine.store.models import QUARANTINED

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
DISCARD_COMMAND = "tokenflow db discard-unfinished"
DISCARDED = f"discarded unfinished ({DISCARD_COMMAND} or the console)"


@dataclass(frozen=True)
class Resumption:
    resumed: tuple[str, ...]  # re-added to the engine, generation goes on
    quarantined: tuple[str, ...]  # newly quarantined by this resume
    failed: tuple[str, ...]  # entries the engine refused (closed as FAILED with the reason)
    # the tokens each resumed request had generated: its outputs carry only the ones after
    generated: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


def resume_unfinished(engine: EngineCore, database: Database,
                      skip: frozenset[str] | set[str] = frozenset()) -> Resumption:
    """Re-add every unfinished entry (but `skip`) with its tokens; takes the writer lock."""
    database.claim_writer()
    quarantined, failed = [], []
    with explained(database.location), database.session() as session:
        entries = []
        for entry in unfinished_requests(session):
            if entry.request_id in skip:
                continue
            if entry.resume_attempts >= QUARANTINE_AFTER:
                close_entry(session, entry.request_id, QUARANTINED,
                            f"quarantined: the process died in {entry.resume_attempts} "
                            "runs that resumed it; `tokenflow db release-quarantine "
                            f"{entry.request_id}` runs it again")
                quarantined.append(entry.request_id)
            else:
                entries.append(entry)
        # Durable before a single token is computed or "resumed N" is said.
        claim_for_resume(session, [e.request_id for e in entries])
        resumed, generated = [], {}
        for entry in entries:
            sampling = {k: v for k, v in entry.sampling.items() if k in _SAMPLING_FIELDS}
            try:
                engine.add_request(entry.prompt_token_ids, SamplingParams(**sampling),
                                   tenant=entry.tenant, priority=entry.priority,
                                   request_id=entry.request_id, tag=entry.tag,
                                   generated=entry.generated_token_ids, resumed=True)
            except (EngineError, TypeError, ValueError) as exc:
                close_entry(session, entry.request_id, "FAILED", f"not resumed: {exc}")
                failed.append(entry.request_id)
                continue
            resumed.append(entry.request_id)
            generated[entry.request_id] = tuple(entry.generated_token_ids)
    return Resumption(tuple(resumed), tuple(quarantined), tuple(failed), generated)


ORPHANED = ("aborted: the process running it stopped first, and whoever asked for it went "
            "with it (`tokenflow run --resume` finishes a killed run's requests instead)")


def abort_orphans(database: Database) -> tuple[str, ...]:
    """Close every unfinished entry as aborted (ORPHANED); the ids. The start-up rule:
    docs/engine.md, "Orphaned requests"."""
    database.claim_writer()
    with explained(database.path), database.session() as session:
        return tuple(discard_unfinished(session, ORPHANED, state="FINISHED"))

