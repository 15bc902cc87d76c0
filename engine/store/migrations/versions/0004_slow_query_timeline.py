"""Slow queries keep their timeline: where the time went, its cause, share and verdict."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import add_columns, create_index

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_columns("slow_queries", sa.Column("timeline", sa.JSON), sa.Column("cause", sa.String(32)),
                sa.Column("cause_share", sa.Float), sa.Column("verdict", sa.Text))
    create_index("ix_slow_queries_cause", "slow_queries", ["cause"])


def downgrade() -> None:
    op.drop_index("ix_slow_queries_cause", table_name="slow_queries")
    with op.batch_alter_table("slow_queries") as batch:
        batch.drop_column("verdict")
        batch.drop_column("cause_share")
        batch.drop_column("cause")
        batch.drop_column("timeline")
