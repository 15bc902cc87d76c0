"""Schema steps the revisions take, each done only where it is not done yet."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


def add_columns(table: str, *columns: sa.Column) -> None:
    present = {column["name"] for column in sa.inspect(op.get_bind()).get_columns(table)}
    missing = [column for column in columns if column.name not in present]
    if missing:
        with op.batch_alter_table(table) as batch:
            for column in missing:
                batch.add_column(column)


def create_index(name: str, table: str, columns: list[str]) -> None:
    if name not in {index["name"] for index in sa.inspect(op.get_bind()).get_indexes(table)}:
        op.create_index(name, table, columns)


def create_table(name: str, *columns: sa.Column) -> None:
    if not sa.inspect(op.get_bind()).has_table(name):
        op.create_table(name, *columns)
