"""Stores built for tests: a damaged one whose header is valid but whose pages are not."""

from __future__ import annotations

from pathlib import Path

from engine.events import EventBus, RequestAdded
from engine.store import StoreWriter, open_database


def damaged_store(path: Path) -> Path:
    """A store of 300 journal entries whose second half of pages is overwritten: it opens
    (the header and schema pages are whole) and fails where a query reads the journal."""
    database = open_database(path)
    bus = EventBus()
    writer = StoreWriter(database, bus)
    for i in range(300):
        bus.publish(RequestAdded(request_id=f"r{i}", prompt_token_ids=tuple(range(200)),
                                 sampling={"max_tokens": 8}, tenant="t"))
    bus.drain()
    writer.close()
    database.close()  # the last connection checkpoints the WAL into the file
    data = bytearray(path.read_bytes())
    assert data.startswith(b"SQLite format 3\x00")
    half = len(data) // 2
    data[half:] = b"\xa5" * (len(data) - half)
    path.write_bytes(bytes(data))
    return path
