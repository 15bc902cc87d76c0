"""Schema steps the revisions take, each done only where it is not done yet.

An upgrade killed by a tokenflow older than transactional migrations (pysqlite committed
each ALTER on its own) left stores with a revision's first columns added and its version
stamp still the revision before; every later start failed on a duplicate column. Revisions
add their columns and indexes through these steps, so such a store is completed by the next
start, with no manual step.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


def add_columns(table: str, *columns: sa.Column) -> None:
    """Add each of `columns` to `table` unless it is there already."""
    present = {column["name"] for column in sa.inspect(op.get_bind()).get_columns(table)}
    missing = [column for column in columns if column.name not in present]
    if missing:
        with op.batch_alter_table(table) as batch:
            for column in missing:
                batch.add_column(column)


def create_index(name: str, table: str, columns: list[str]) -> None:
    """Create the index `name` unless `table` has it already."""
    if name not in {index["name"] for index in sa.inspect(op.get_bind()).get_indexes(table)}:
        op.create_index(name, table, columns)


def create_table(name: str, *columns: sa.Column) -> None:
    """Create the table `name` with `columns` unless the store has it already."""
    if not sa.inspect(op.get_bind()).has_table(name):
        op.create_table(name, *columns)
