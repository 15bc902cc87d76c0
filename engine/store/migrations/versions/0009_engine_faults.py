"""Engine faults: exceptions in the step loop, with traceback and the restart they caused."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import create_index, create_table

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    create_table(
        "engine_faults",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("server", sa.String(256), nullable=False, server_default=""),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("restarts", sa.Integer, nullable=False),
        sa.Column("place", sa.Text, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column("traceback", sa.Text, nullable=False),
        sa.Column("stopped", sa.Boolean, nullable=False),
        sa.Column("resumed", sa.Integer, nullable=False),
        sa.Column("failed", sa.Integer, nullable=False),
    )
    create_index("ix_engine_faults_server", "engine_faults", ["server", "id"])


def downgrade() -> None:
    op.drop_index("ix_engine_faults_server", table_name="engine_faults")
    op.drop_table("engine_faults")
