"""Slow queries say which rule stored them (budget_score, the TTFT or ITL SLO), how many
breaches a sampled one stands for, and what the user felt most with its cause; a breach
stored without a calibrated plan has no budget_score.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import add_columns

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # every row before this was stored by budget_score's rule, one request each
    add_columns("slow_queries",
                sa.Column("rules", sa.String(64), nullable=False, server_default="budget_score"),
                sa.Column("represents", sa.Integer, nullable=False, server_default="1"),
                sa.Column("felt_part", sa.String(32)), sa.Column("felt_cause", sa.String(32)),
                sa.Column("felt_share", sa.Float))
    with op.batch_alter_table("slow_queries") as batch:
        batch.alter_column("budget_score", existing_type=sa.Float, nullable=True)


def downgrade() -> None:
    with op.batch_alter_table("slow_queries") as batch:
        batch.alter_column("budget_score", existing_type=sa.Float, nullable=False)
        for column in ("felt_share", "felt_cause", "felt_part", "represents"):
            batch.drop_column(column)
        batch.drop_column("rules")
