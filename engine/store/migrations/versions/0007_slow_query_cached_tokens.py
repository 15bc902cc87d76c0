"""Slow queries keep the prompt tokens their request found in the prefix cache (issue 20).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import add_columns

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # nullable: rows stored before this revision, and traced ones, do not know the count
    add_columns("slow_queries", sa.Column("cached_tokens", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("slow_queries") as batch:
        batch.drop_column("cached_tokens")
