"""Pauses: when the operator paused the engine's stepping or resumed it, so a history longer
than one console's memory marks them.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import create_index, create_table

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_table(
        "pauses",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("server", sa.String(256), nullable=False, server_default=""),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("paused", sa.Boolean, nullable=False),
    )
    create_index("ix_pauses_created_at", "pauses", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_pauses_created_at", table_name="pauses")
    op.drop_table("pauses")
