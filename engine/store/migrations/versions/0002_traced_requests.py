"""Traced requests from other engines, and where each slow query came from."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import add_columns

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_columns("slow_queries", sa.Column("source", sa.String(256)))
    op.create_table(
        "traced_requests",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("received_at", sa.Float, nullable=False),
        sa.Column("source", sa.String(256), nullable=False),
        sa.Column("request_id", sa.String(256), nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("queue_s", sa.Float),
        sa.Column("ttft_s", sa.Float),
        sa.Column("prefill_s", sa.Float),
        sa.Column("decode_s", sa.Float),
        sa.Column("e2e_s", sa.Float),
        sa.Column("predicted_prefill_s", sa.Float),
        sa.Column("budget_score", sa.Float),
    )
    op.create_index("ix_traced_requests_source", "traced_requests", ["source"])


def downgrade() -> None:
    op.drop_index("ix_traced_requests_source", table_name="traced_requests")
    op.drop_table("traced_requests")
    with op.batch_alter_table("slow_queries") as batch:
        batch.drop_column("source")
