"""Session starts: when a process started the engine on the store, so a history longer than
one process marks each restart of the whole process.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import create_index, create_table

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_table(
        "session_starts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("server", sa.String(256), nullable=False, server_default=""),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("orphans", sa.Integer, nullable=False),
    )
    create_index("ix_session_starts_created_at", "session_starts", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_session_starts_created_at", table_name="session_starts")
    op.drop_table("session_starts")
