"""Slow queries say whether their request was resumed from the journal after a restart, and
with how many output tokens it came back (prefilled again with its prompt).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import add_columns

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # nullable: NULL is a request that was not resumed, as every row stored before this was
    add_columns("slow_queries", sa.Column("resumed_tokens", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("slow_queries") as batch:
        batch.drop_column("resumed_tokens")
