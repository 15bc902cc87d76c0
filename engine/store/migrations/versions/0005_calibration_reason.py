"""Calibration runs record why they ran: first at start, persistent drift, or on demand."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from engine.store.migration_steps import add_columns

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_columns("calibration_runs", sa.Column("reason", sa.Text, nullable=False,
                                              server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("calibration_runs") as batch:
        batch.drop_column("reason")
