"""Slow queries keep the prompt tokens their request found in the prefix cache."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import add_columns

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_columns("slow_queries", sa.Column("cached_tokens", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("slow_queries") as batch:
        batch.drop_column("cached_tokens")
